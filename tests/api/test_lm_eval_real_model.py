"""lm-evaluation-harness on the real default model (SmolLM2-135M-Instruct, the GGUF make
setup installs), through ``shoal serve``'s completions API (lm-eval's ``local-completions``),
against lm-eval's own HF model (``HFLM``) on transformers' loading of the same file: the same
accuracy on the same task, every loglikelihood within 2e-3.

The task is written here (no hub): 24 English general-knowledge questions with three
choices each, which a 135M instruct model answers well above chance and not perfectly, so
the accuracy says something about the weights being right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ..model.gguf_files import reference_checkpoint

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid"], 0),
    ("What is the capital of Japan?", ["Beijing", "Tokyo", "Seoul"], 1),
    ("What is the capital of Italy?", ["Rome", "Athens", "Vienna"], 0),
    ("What is the capital of Germany?", ["Munich", "Hamburg", "Berlin"], 2),
    ("What color is the sky on a clear day?", ["green", "blue", "red"], 1),
    ("What color is grass?", ["green", "purple", "orange"], 0),
    ("How many legs does a dog have?", ["two", "six", "four"], 2),
    ("How many days are in a week?", ["seven", "ten", "five"], 0),
    ("Which animal says moo?", ["cat", "cow", "dog"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth"], 2),
    ("What do bees make?", ["honey", "milk", "silk"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand"], 1),
    ("Which is the largest ocean?", ["Pacific", "Arctic", "Indian"], 0),
    ("What is two plus two?", ["three", "five", "four"], 2),
    ("Which season comes after winter?", ["autumn", "spring", "summer"], 1),
    ("What gas do plants take in from the air?", ["carbon dioxide", "helium", "neon"], 0),
    ("Which animal is known as the king of the jungle?", ["zebra", "mouse", "lion"], 2),
    ("What is the opposite of hot?", ["cold", "loud", "tall"], 0),
    ("Who wrote Romeo and Juliet?", ["Charles Dickens", "William Shakespeare", "Mark Twain"],
     1),
    ("What is the boiling point of water in Celsius?", ["50", "100", "200"], 1),
    ("Which organ pumps blood through the body?", ["lung", "liver", "heart"], 2),
    ("What is the largest mammal?", ["blue whale", "elephant", "giraffe"], 0),
    ("In which continent is Egypt?", ["Asia", "Africa", "Europe"], 1),
    ("What do you call a baby cat?", ["puppy", "calf", "kitten"], 2),
]
TASK = """task: shoal_general_knowledge
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_real")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (root / "shoal_general_knowledge.yaml").write_text(TASK.format(data=data))
    return root


@pytest.fixture(scope="module")
def gguf() -> Path:
    from shoal.runtime.model_source import default_model

    return default_model()


def _evaluate(lm, tasks_dir: Path) -> tuple[float, list[float]]:
    """(accuracy, each choice's loglikelihood in request order)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=lm, tasks=["shoal_general_knowledge"], log_samples=True,
        task_manager=TaskManager(include_path=str(tasks_dir)), random_seed=0)
    samples = sorted(results["samples"]["shoal_general_knowledge"], key=lambda s: s["doc_id"])
    logliks = [float(resp[0][0]) for s in samples for resp in s["resps"]]
    return results["results"]["shoal_general_knowledge"]["acc,none"], logliks


def test_lm_eval_on_the_default_model_scores_as_transformers(start_server, gguf, tasks_dir,
                                                              monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = reference_checkpoint(gguf)
    server = start_server("--dtype", "float32", model_dir=gguf, wait=False)
    server.wait_ready(timeout=600)  # 30 layers loaded and warmed up: minutes on a loaded CPU
    ours = LocalCompletionsAPI(
        model="shoal-test", base_url=server.v1 + "/completions", tokenizer=str(folder),
        tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
        max_retries=1, batch_size=1)
    our_acc, our_logliks = _evaluate(ours, tasks_dir)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder), batch_size=1)
    hf_acc, hf_logliks = _evaluate(hf, tasks_dir)

    assert len(our_logliks) == len(hf_logliks) == 3 * len(QUESTIONS)
    worst = max(abs(a - b) for a, b in zip(our_logliks, hf_logliks, strict=True))
    print(f"lm-eval accuracy: shoal {our_acc:.4f}, HF {hf_acc:.4f}; worst loglikelihood "
          f"difference {worst:.2e}")
    assert worst < 2e-3, worst
    assert our_acc == hf_acc
    assert our_acc > 0.5, our_acc  # well above chance (1/3): the weights are the model's
