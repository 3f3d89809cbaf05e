"""Resident weight memory of the engine's model: int4 (compressed-tensors group 128 and
group 32, symmetric and not; GPTQ and AWQ group 32) at most 0.35x and block-scaled FP8
(128x128) at most 0.55x of the same model in bfloat16; MoE experts kept quantized likewise.

At group 32 the scales and zero points decide it: codes are 4 bits a weight, a 16-bit scale
half a bit, a zero point kept as 4 bits an eighth (none when every group shares one); the
checkpoint is a bfloat16 release (llm-compressor then writes bfloat16 scales; GPTQ and AWQ
write float16).

The model is shaped so its linear layers hold most weights, as in a served LLM (a 256-token
vocabulary beside 2 layers of 256 x 1024 MLPs): embeddings and norms are not quantized by
these checkpoints, and count in both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shoal.runtime.model.linear import resident_weight_bytes


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dense")
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _build(model_dir: Path) -> torch.nn.Module:
    from shoal.runtime.attention.selector import get_attention_backend
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.loader import build_model
    from shoal.runtime.model.parallel import ParallelContext

    config = load_model_config(model_dir)
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    backend = get_attention_backend("torch", cpu, dtype, config.attention_features)
    return build_model(config, model_dir, backend, ParallelContext(0, 1), 64, dtype, cpu)


@pytest.mark.parametrize("fmt, bound", [
    ("ct-w4-group128", 0.35), ("ct-w4-group", 0.35), ("ct-w4-group-asym", 0.35),
    ("gptq-w4", 0.35), ("awq-w4", 0.35), ("fp8-block128", 0.55)])
def test_quantized_weights_resident_bytes(dense_dir: Path, tmp_path: Path, fmt: str,
                                          bound: float) -> None:
    from shoal.runtime.model.make_quant_model import make_quant_model

    dense = resident_weight_bytes(_build(dense_dir))
    model = _build(make_quant_model(dense_dir, fmt, tmp_path / fmt))
    ratio = resident_weight_bytes(model) / dense
    print(f"{fmt}: {ratio:.3f}x of bfloat16")
    assert ratio <= bound, f"{fmt}: {ratio:.3f}x of bfloat16"
    assert ratio > 0.2  # the embeddings and the packed codes are all counted
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.isfinite(model.model.layers[0].mlp.gate_up_proj(x)).all()


# FP8 blocks keep a float32 scale per row and block of columns: 8 + 32 / block bits a
# weight, 9/16 at the tiny model's 32-column blocks (8.25 / 16 at 128 columns, as published)
@pytest.mark.parametrize("fmt, bound", [("ct-w4-group", 0.35), ("gptq-w4", 0.35),
                                        ("ct-fp8-dynamic", 0.55), ("fp8-block", 9 / 16)])
def test_moe_experts_stay_quantized_and_run_once_per_block(fmt: str, bound: float,
                                                           monkeypatch) -> None:
    """The experts of a quantized Qwen3-MoE checkpoint are kept as one packed matrix per
    projection (no full-precision expert weight exists), their bytes against the same
    experts in bfloat16, and each MoE block is one call of the grouped kernel."""
    from shoal.runtime.model.make_quant_model import cached_quant_model
    from shoal.runtime.model.moe import FusedExperts

    from shoal.kernels import moe_experts_cpu

    model = _build(cached_quant_model("qwen3_moe", "tiny", fmt))
    blocks = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert blocks and not [n for n, p in model.named_parameters() if "experts" in n]
    experts = blocks[0]
    kept = sum(b.nbytes for b in experts.buffers())
    bf16 = experts.num_experts * 3 * experts.local * experts.hidden * 2
    print(f"{fmt} experts: {kept / bf16:.3f}x of bfloat16")
    assert kept / bf16 <= bound
    calls = []
    real = moe_experts_cpu.experts_quantized
    monkeypatch.setattr(moe_experts_cpu, "experts_quantized",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(5, experts.hidden, dtype=torch.bfloat16)
    out = model.model.layers[0].mlp(x)
    assert torch.isfinite(out).all() and len(calls) == 1
