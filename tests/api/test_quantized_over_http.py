"""Quantized checkpoints served over HTTP: greedy output equals HF transformers' own CPU
loading of the same checkpoint (transformers dequantizes it), token for token, near-ties
excepted; /v1/models and the metrics say the quantization."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

MAX_TOKENS = 12
NEAR_TIE = 1e-3


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    margins = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1])
               for step in out.logits]
    return out.sequences[0, len(prompt):].tolist(), margins


def assert_greedy_equals_hf(server, model_dir, hf_loader=None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    batch = client.completions.create(
        model=server.model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    outputs = [c.model_extra["token_ids"] for c in sorted(batch.choices, key=lambda c: c.index)]
    model = (hf_loader or (lambda d: AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32)))(model_dir).eval()
    exact = 0
    for prompt, ours in zip(prompts, outputs, strict=True):
        want, margins = hf_greedy(model, prompt)
        assert len(ours) == MAX_TOKENS
        exact += ours == want
        for pos, (got, expected) in enumerate(zip(ours, want, strict=True)):
            if got != expected:
                assert margins[pos] < NEAR_TIE, (pos, ours, want)
                break
    assert exact >= len(prompts) - 1


def says_quantization(server, method: str) -> None:
    models = httpx.get(server.v1 + "/models", timeout=5).json()["data"]
    assert [m["quantization"] for m in models] == [method]
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    assert f'shoal:model_config_info{{model_name="shoal-test",quantization="{method}"}} 1.0' \
        in text


@pytest.fixture(scope="module")
def fp8_dir():
    from shoal.runtime.model.make_quant_model import cached_quant_model

    return cached_quant_model("qwen3", "tiny", "fp8-block")


def test_fp8_block_greedy_over_http_equals_hf(start_server, fp8_dir) -> None:
    server = start_server("--quantization", "fp8", "--max-model-len", "64", model_dir=fp8_dir)
    try:
        says_quantization(server, "fp8")
        assert_greedy_equals_hf(server, fp8_dir)
    finally:
        server.stop()


def test_full_precision_model_says_none() -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from shoal.runtime.api.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    families = {f.name: f.samples for f in text_string_to_metric_families(
        metrics.render().decode())}
    assert families["shoal:model_config_info"] == []  # not known before the engine is ready
    metrics.set_model_config("")
    families = {f.name: f.samples for f in text_string_to_metric_families(
        metrics.render().decode())}
    (sample,) = families["shoal:model_config_info"]
    assert sample.labels == {"model_name": "m", "quantization": "none"}
