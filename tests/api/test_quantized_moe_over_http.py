"""Quantized mixture-of-experts checkpoints: the experts stay quantized (one packed matrix
per projection, one grouped kernel call per MoE block) and greedy output equals HF
transformers' own loading of the same checkpoint, token for token, near-ties excepted.

Checkpoints are tiny Qwen3-MoE / Mixtral models made by transformers' classes and quantized
per expert as the publishers' tools write them (compressed-tensors by its own library with the
routers ignored, as llm-compressor's MoE recipes do; FP8 blocks as Qwen3-30B-A3B-FP8; GPTQ
(act-order too: each expert's ``g_idx`` its own permutation) and AWQ packed as AutoGPTQ /
AutoAWQ pack)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.api.conftest import assert_equal_up_to_a_near_tie
from tests.api.test_quantized_over_http import (
    MAX_TOKENS,
    NEAR_TIE,
    _fields,
    assert_greedy_equals_hf,
    ct_reference,
    says_quantization,
    serve,
)
from tests.hf_reference import greedy_with_margins


def _quant_dir(arch: str, fmt: str) -> Path:
    from shoal.runtime.model.make_quant_model import cached_quant_model

    return cached_quant_model(arch, "tiny", fmt)


def dequantized_reference(model_dir: Path, tmp_dir: Path):
    """transformers cannot load GPTQ / AWQ here (CUDA-only extensions): every quantized
    linear of the checkpoint (per-expert ones included) dequantized by AutoGPTQ's formula or
    AutoAWQ's, written as a full-precision checkpoint and loaded by transformers' own class
    (which stacks the experts as it loads any per-expert checkpoint)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    qc = config.pop("quantization_config")
    state = load_file(str(model_dir / "model.safetensors"))
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's AWQ_REVERSE_ORDER
    out = {k: v for k, v in state.items()
           if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key[:-len(".qweight")]
        scales = state[f"{name}.scales"].float()
        if qc["quant_method"] == "gptq":
            q = _fields(state[key].t()).t()
            zeros = _fields(state[f"{name}.qzeros"]) + 1
            index = state[f"{name}.g_idx"].long()
        else:
            qweight, qzeros = state[key], state[f"{name}.qzeros"]
            q = _fields(qweight).reshape(qweight.shape[0], -1, 8)[..., reverse].reshape(
                qweight.shape[0], -1)
            zeros = _fields(qzeros).reshape(qzeros.shape[0], -1, 8)[..., reverse].reshape(
                qzeros.shape[0], -1)
            index = torch.arange(q.shape[0]) // qc["group_size"]
        out[f"{name}.weight"] = ((q - zeros[index]) * scales[index]).t().contiguous()
    tmp_dir.mkdir(exist_ok=True)
    (tmp_dir / "config.json").write_text(json.dumps(config))
    save_file(out, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(tmp_dir, dtype=torch.float32)


def ct_decompressed_reference(model_dir: Path, tmp_dir: Path):
    """An asymmetric compressed-tensors checkpoint's experts cannot be loaded by transformers
    5.25 (its MoE decompression drops ``weight_zero_point``): every module decompressed by
    compressed-tensors' own compressor, written full precision, loaded by transformers."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config.pop("quantization_config"))
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    state = load_file(str(model_dir / "model.safetensors"))
    out = {k: v for k, v in state.items() if ".weight_" not in k}
    for key in [k for k in state if k.endswith(".weight_packed")]:
        name = key[:-len(".weight_packed")]
        local = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(f"{name}.weight_")}
        out[f"{name}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    tmp_dir.mkdir(exist_ok=True)
    (tmp_dir / "config.json").write_text(json.dumps(config))
    save_file(out, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(tmp_dir, dtype=torch.float32)


def fp8_reference(model_dir: Path):
    """transformers' own FP8 loading (``quant_method: fp8``), dequantized on CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_gptq_experts_greedy_over_http_equal_the_reference(start_server, tmp_path) -> None:
    """The one server of the module serves GPTQ: its startup reads the config without
    compressed-tensors' package, whose import (it pulls transformers' modeling stack) made a
    compressed-tensors server start ~2.5x slower here; the other formats go through the same
    engine offline below."""
    model_dir = _quant_dir("qwen3_moe", "gptq-w4")
    server = serve(start_server, model_dir, "--quantization", "gptq")
    try:
        says_quantization(server, "gptq")
        assert_greedy_equals_hf(server, model_dir,
                                lambda d: dequantized_reference(d, tmp_path / "dequantized"))
    finally:
        server.stop()


@pytest.mark.parametrize("arch, fmt", [
    ("qwen3_moe", "ct-w4-group"), ("mixtral", "ct-w4-group-asym"), ("qwen3_moe", "ct-fp8-dynamic"),
    ("qwen3_moe", "fp8-block"), ("mixtral", "awq-w4"), ("mixtral", "gptq-w4-actorder"),
])
def test_quantized_experts_offline_equal_the_reference(arch, fmt, tmp_path) -> None:
    from shoal.runtime.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    model_dir = _quant_dir(arch, fmt)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    if fmt == "ct-w4-group-asym":
        reference = ct_decompressed_reference(model_dir, tmp_path / "decompressed")
    elif fmt.startswith("ct-"):
        reference = ct_reference(model_dir)
    elif fmt.startswith("fp8"):
        reference = fp8_reference(model_dir)
    else:
        reference = dequantized_reference(model_dir, tmp_path / "dequantized")
    for prompt, output in zip(prompts, outputs, strict=True):
        want, margins = greedy_with_margins(reference.eval(), prompt, MAX_TOKENS)
        assert_equal_up_to_a_near_tie(output.outputs[0].token_ids, want, margins, NEAR_TIE)
