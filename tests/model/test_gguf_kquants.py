"""GGUF K-quants (Q4_K, Q6_K) kept in their blocks on CPU: the weights the native kernel
multiplies equal the gguf package's dequantization exactly, and the engine on a "_K_M"-style
file (Q4_K with Q6_K parts, fused layers mixing both) matches transformers' GGUF loading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from .gguf_files import assert_greedy_equals_hf, hf_from_gguf, write_gguf

pytest.importorskip("gguf")


def _native() -> bool:
    from shoal.kernels.native_cpu import unavailable_reason

    return unavailable_reason() is None


pytestmark = pytest.mark.skipif(not _native(), reason="the native library does not build here")


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """Every bit pattern of codes and sub-scales, fp16 super-block scales finite."""
    from shoal.runtime.model.quant.gguf_int import BLOCK_BYTES

    blocks = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = (rng.standard_normal((rows, cols // 256, 2)) * 1e-3).astype(np.float16)
    at = [0, 2] if kind == "Q4_K" else [208]  # Q4_K: d, dmin first; Q6_K: d last
    for i, offset in enumerate(at):
        blocks[..., offset:offset + 2] = halves[..., i:i + 1].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("heads", [None, 4])  # llama q/k rows un-permuted
def test_kernel_weights_equal_the_gguf_dequantization(kind: str, heads: int | None) -> None:
    from shoal.runtime.model.gguf_checkpoint import GGUFTensor
    from shoal.runtime.model.quant.gguf_int import gguf_packed

    from shoal.kernels.int_matmul_cpu import dequantize, int_matmul

    rng = np.random.default_rng(0)
    rows, cols = 40, 768
    tensor = GGUFTensor("blk.0.attn_q.weight", "q", kind, (rows, cols),
                        _random_blocks(rng, rows, cols, kind), heads)
    packed = gguf_packed(tensor)
    assert packed is not None
    reference = tensor.dequantize()
    assert torch.equal(dequantize(packed), reference)
    if kind == "Q6_K":  # the blocks as stored: 6.56 bits a weight
        assert packed.codes.numel() == rows * cols // 256 * 210 and packed.scales.numel() == 0
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 5, 300):  # the one-row path, the tiles, the GEMM band path
        x = torch.randn(batch, cols, generator=gen)
        want = x.double() @ reference.double().t()
        error = (int_matmul(x, packed).double() - want).abs().max().item()
        assert error <= 2e-6 * want.abs().max().item()


def test_a_k_quant_the_columns_do_not_fit_is_not_taken() -> None:
    from shoal.runtime.model.gguf_checkpoint import GGUFTensor
    from shoal.runtime.model.quant.gguf_int import gguf_packed

    blocks = np.zeros((2, 144), np.uint8)
    assert gguf_packed(GGUFTensor("w", "w", "Q4_K", (4, 128), blocks)) is None


# a Q4_K_M-like mix: Q6_K output head, v and down projections in some layers; a Q6_K gate
# beside a Q4_K up (a fused layer of two layouts)
K_TYPES = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K",
           "blk.1.ffn_down.weight": "Q6_K", "blk.2.ffn_gate.weight": "Q6_K"}


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory) -> Path:
    from shoal.runtime.model.make_model import cached_model

    folder = tmp_path_factory.mktemp("gguf-k")
    # llama small: every input width (256, 768) a whole number of 256-column super-blocks
    return write_gguf(cached_model("llama", "small", seed=0), folder / "k.gguf", "llama",
                      "Q4_K", True, K_TYPES)


def test_engine_greedy_equals_transformers_on_a_k_quant_file(k_quant_file: Path) -> None:
    from shoal.runtime.llm import LLM
    from shoal.runtime.model.linear import _Linear
    from shoal.runtime.model.quant.gguf_int import NativeParts

    reference, tokenizer = hf_from_gguf(k_quant_file)
    llm = LLM(k_quant_file, device="cpu", dtype="float32", num_kv_blocks=64)
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, _Linear)}
    assert all(hasattr(m, "int_packed_codes") for m in linears.values())
    mixed = {n for n, m in linears.items() if isinstance(m.int_kernel, NativeParts)}
    assert mixed == {"model.layers.0.self_attn.qkv_proj", "model.layers.2.mlp.gate_up_proj"}
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.weight.is_meta and head.int_packed_codes.dtype == torch.uint8
    ids = torch.tensor([[0, 5, 17], [4095, 2, 2]])
    with torch.no_grad():
        assert torch.equal(embed(ids), reference.model.embed_tokens.weight[ids])
    assert_greedy_equals_hf(llm, reference, tokenizer)
