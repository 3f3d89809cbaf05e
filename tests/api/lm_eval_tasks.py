"""lm-evaluation-harness tasks written by the tests themselves (a JSON-lines file and a task
YAML, no hub), and lm-eval's ``local-completions`` model pointed at a ``shoal serve``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{doc_to_text}"
"""


def write_task(root: Path, name: str, rows: list[dict[str, Any]], output_type: str,
               doc_to_text: str, rest: str) -> None:
    """``root/<name>.yaml`` over ``root/<name>.jsonl``; ``rest`` is the YAML after
    ``doc_to_text`` (targets, choices, metrics), Jinja braces written as they are."""
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    head = TASK.format(name=name, data=data, output_type=output_type, doc_to_text=doc_to_text)
    (root / f"{name}.yaml").write_text(head + rest)


def local_completions(server, model: str, tokenizer: Path):
    """lm-eval's OpenAI-completions client for ``server``: token ids sent as they are, one
    request at a time."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        model=model, base_url=server.v1 + "/completions", tokenizer=str(tokenizer),
        tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
        max_retries=1, batch_size=1)


def evaluate(lm, root: Path, tasks: list[str]) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` over the tasks in ``root``, every sample logged. Only
    ``root`` is indexed: lm-eval's own thousands of task files took 10-45 s a call here."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(root), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True,
                                   task_manager=manager, random_seed=0)
