"""lm-evaluation-harness (from PyPI) against ``shoal serve`` with its ``local-completions``
model, on two small tasks written here (no hub): a multiple-choice task (loglikelihoods
from ``echo`` + ``logprobs``) and a generate_until task. Every loglikelihood equals HF's
log-softmax over the very ids lm-eval sent, within 1e-4."""

from __future__ import annotations

import pytest
import torch

from .lm_eval_tasks import evaluate, local_completions, write_task

pytest.importorskip("lm_eval")

QUESTIONS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"],
     "answer": 0},
    {"question": "import os\nimport", "choices": [" sys", " os", " re"], "answer": 0},
    {"question": "for i in range(10):\n   ", "choices": [" print(i)", " pass"], "answer": 1},
]
MC_REST = """doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_REST = """doc_to_target: "{{choices[0]}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    write_task(root, "shoal_mc", QUESTIONS, "multiple_choice", "{{question}}", MC_REST)
    write_task(root, "shoal_gen", QUESTIONS, "generate_until", "{{question}}", GEN_REST)
    return root


@pytest.mark.slow
def test_lm_eval_loglikelihood_and_generate_until_tasks(tiny_chat_server, tiny_qwen2, tasks_dir,
                                                       monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    # the keyless server the third-party-client modules share: no start of its own
    lm = local_completions(tiny_chat_server, "shoal-test", tiny_qwen2)
    results = evaluate(lm, tasks_dir, ["shoal_mc", "shoal_gen"])
    assert set(results["results"]) == {"shoal_mc", "shoal_gen"}
    assert 0.0 <= results["results"]["shoal_mc"]["acc,none"] <= 1.0
    generated = [s["resps"][0][0] for s in results["samples"]["shoal_gen"]]
    assert len(generated) == len(QUESTIONS) and all(isinstance(g, str) for g in generated)

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    compared = 0
    for sample in results["samples"]["shoal_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            want = sum(logprobs[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))
            assert abs(float(resp[0][0]) - want) < 1e-4, (context, continuation)
            compared += 1
    assert compared == sum(len(q["choices"]) for q in QUESTIONS)
