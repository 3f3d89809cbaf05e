"""Resident weight memory of the engine's model: int4 (compressed-tensors, group 128) at
most 0.35x and block-scaled FP8 (128x128) at most 0.55x of the same model in bfloat16.

The model is shaped so its linear layers hold most weights, as in a served LLM (a 256-token
vocabulary beside 2 layers of 256 x 1024 MLPs): embeddings and norms are not quantized by
these checkpoints, and count in both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dense")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (the kernels' packed weights), each
    storage counted once (a tied LM head is the embedding), plus the oneDNN-packed copies
    that replace dense weights where oneDNN packs this dtype (float32 anywhere, bfloat16
    on CPUs with AMX or AVX512-BF16): the dense parameter is then on the meta device."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict().values():
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    # an opaque oneDNN tensor has no storage to read; its elements are the weight's
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    return sum(seen.values()) + sum(p.numel() * p.element_size() for p in packed)


def _build(model_dir: Path) -> torch.nn.Module:
    from shoal.runtime.attention.selector import get_attention_backend
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.loader import build_model
    from shoal.runtime.model.parallel import ParallelContext

    config = load_model_config(model_dir)
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    backend = get_attention_backend("torch", cpu, dtype, config.attention_features)
    return build_model(config, model_dir, backend, ParallelContext(0, 1), 64, dtype, cpu)


@pytest.mark.parametrize("fmt, bound", [("ct-w4-group128", 0.35), ("fp8-block128", 0.55)])
def test_quantized_weights_resident_bytes(dense_dir: Path, tmp_path: Path, fmt: str,
                                          bound: float) -> None:
    from shoal.runtime.model.make_quant_model import make_quant_model

    dense = resident_weight_bytes(_build(dense_dir))
    model = _build(make_quant_model(dense_dir, fmt, tmp_path / fmt))
    ratio = resident_weight_bytes(model) / dense
    assert ratio <= bound, f"{fmt}: {ratio:.3f}x of bfloat16"
    assert ratio > 0.2  # the embeddings and the packed codes are all counted
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.isfinite(model.model.layers[0].mlp.gate_up_proj(x)).all()
