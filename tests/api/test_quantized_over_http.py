"""Quantized checkpoints served over HTTP: greedy output equals HF transformers' own CPU
loading of the same checkpoint (transformers dequantizes it), token for token, near-ties
excepted; /v1/models and the metrics say the quantization."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.api.conftest import assert_equal_up_to_a_near_tie, greedy_token_ids
from tests.hf_reference import greedy_with_margins

MAX_TOKENS = 12
NEAR_TIE = 1e-3


def assert_greedy_equals_hf(server, model_dir, hf_loader=None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    outputs = greedy_token_ids(server, prompts, MAX_TOKENS)
    model = (hf_loader or (lambda d: AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32)))(model_dir).eval()
    exact = 0
    for prompt, ours in zip(prompts, outputs, strict=True):
        want, margins = greedy_with_margins(model, prompt, MAX_TOKENS)
        exact += ours == want
        assert_equal_up_to_a_near_tie(ours, want, margins, NEAR_TIE)
    assert exact >= len(prompts) - 1


def serve(start_server, model_dir, *flags: str):
    """A server for one checkpoint; a 64-token step keeps the warm-up short, and startup may
    take long on a loaded machine."""
    server = start_server("--max-model-len", "64", "--max-num-batched-tokens", "64", *flags,
                          model_dir=model_dir, wait=False)
    try:
        server.wait_ready(timeout=300)
    except BaseException:
        server.stop()
        raise
    return server


def says_quantization(server, method: str) -> None:
    models = httpx.get(server.v1 + "/models", timeout=5).json()["data"]
    assert [m["quantization"] for m in models] == [method]
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    assert f'shoal:model_config_info{{model_name="shoal-test",quantization="{method}"}} 1.0' \
        in text


def ct_reference(model_dir):
    """transformers' own loading of a compressed-tensors checkpoint, dequantized on load
    (compressed-tensors' decompression into the HF class)."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True))


def _fields(words):
    """int32 [..., n] -> [..., n * 8] 4-bit fields, lowest bits first (AutoGPTQ's unpack)."""
    import torch

    return ((words.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 15).reshape(
        *words.shape[:-1], -1)


def gptq_awq_reference(model_dir):
    """transformers cannot load GPTQ / AWQ here (it needs optimum + gptqmodel or autoawq,
    which build CUDA extensions): the reference is the checkpoint dequantized by AutoGPTQ's
    formula (``(q - (qzeros + 1)) * scales[g_idx]``) or AutoAWQ's (its reverse field order,
    ``(q - qzeros) * scales``), written independently of the runtime's unpacking, loaded into
    transformers' own class for the architecture."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    method = config.quantization_config["quant_method"]
    del config.quantization_config
    state = load_file(str(model_dir / "model.safetensors"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    group = json.loads((model_dir / "config.json").read_text())[
        "quantization_config"]["group_size"]
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's AWQ_REVERSE_ORDER
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        scales = state[f"{name}.scales"].float()
        if method == "gptq":
            q = _fields(state[f"{name}.qweight"].t()).t()  # [in, out]
            zeros = _fields(state[f"{name}.qzeros"]) + 1
            index = state[f"{name}.g_idx"].long()
        else:
            qweight, qzeros = state[f"{name}.qweight"], state[f"{name}.qzeros"]
            q = _fields(qweight).reshape(qweight.shape[0], -1, 8)[..., reverse].reshape(
                qweight.shape[0], -1)
            zeros = _fields(qzeros).reshape(qzeros.shape[0], -1, 8)[..., reverse].reshape(
                qzeros.shape[0], -1)
            index = torch.arange(q.shape[0]) // group
        with torch.no_grad():
            module.weight.copy_(((q - zeros[index]) * scales[index]).t())
    return model


def _quant_dir(fmt: str):
    from shoal.runtime.model.make_quant_model import cached_quant_model

    return cached_quant_model("qwen3", "tiny", fmt)


# one server per quantization method; the other variants run the same engine offline below
@pytest.mark.parametrize("fmt, method, reference", [
    ("ct-w4-group-asym", "compressed-tensors", ct_reference),
    ("gptq-w4-actorder", "gptq", gptq_awq_reference),
    ("awq-w4", "awq", gptq_awq_reference),
])
def test_int_weight_greedy_over_http_equals_reference(start_server, fmt, method,
                                                      reference) -> None:
    model_dir = _quant_dir(fmt)
    server = serve(start_server, model_dir)
    try:
        says_quantization(server, method)
        assert_greedy_equals_hf(server, model_dir, reference)
    finally:
        server.stop()


@pytest.mark.parametrize("fmt, reference", [
    ("ct-w4-group", ct_reference), ("ct-w4-channel", ct_reference),
    ("ct-w8-channel", ct_reference), ("ct-w8-group-asym", ct_reference),
    ("gptq-w4", gptq_awq_reference),
    ("ct-fp8-dynamic", ct_reference), ("ct-w8a8-int", ct_reference),
])
def test_int_weight_variants_offline_equal_reference(fmt, reference) -> None:
    from shoal.runtime.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    model_dir = _quant_dir(fmt)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    # a 64-token step as the servers above: the warm-up step is of that size
    outputs = LLM(str(model_dir), num_kv_blocks=64, max_model_len=64,
                  max_num_batched_tokens=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    model = reference(model_dir).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        want, margins = greedy_with_margins(model, prompt, MAX_TOKENS)
        assert_equal_up_to_a_near_tie(ours, want, margins, NEAR_TIE)


@pytest.fixture(scope="module")
def fp8_dir():
    from shoal.runtime.model.make_quant_model import cached_quant_model

    return cached_quant_model("qwen3", "tiny", "fp8-block")


def test_fp8_block_greedy_over_http_equals_hf(start_server, fp8_dir) -> None:
    server = serve(start_server, fp8_dir, "--quantization", "fp8")
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
