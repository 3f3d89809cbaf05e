"""The native routed-experts kernel (``shoal.kernels.moe_experts_cpu``) against float64 math
(``moe_ref`` of ``shoal.kernels.reference``), for 1 to 300 tokens, uneven expert loads and experts
that no token chose, with float32 and bfloat16 weights, hidden sizes over one column block,
on both of the kernel's paths (dot products for an expert with few rows, a packed panel for
one with many) and with the weights prepacked at load (every expert through its panels).

The kernel sums in float32 in its own order, so results are compared with a tolerance
relative to the output's size, never bit for bit; a bfloat16 output is rounded once, so its
tolerance is bfloat16's rounding (the float64 reference takes the same bfloat16 inputs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.kernels import moe_experts_cpu
from shoal.kernels.moe_grouped import grouped_experts
from shoal.kernels.native_cpu import unavailable_reason
from shoal.kernels.reference import moe_ref
from tests.kernels.conftest import portable_library

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"native library: {unavailable_reason()}")


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    return moe_ref(x.double(), w13.double(), w2.double(), weights, ids)


# relative to the largest output: float32 sums of up to ~1500 products; bfloat16's rounding
# of each output (2^-9 of its size, half an ulp) with room
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 4e-3}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.abs().max().item() + 1e-30
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err:.3g} for outputs up to {scale:.3g}"


def _problem(rng: torch.Generator, tokens: int, experts: int, hidden: int, inter: int,
             top_k: int, skewed: bool, dtype: torch.dtype = torch.float32):
    x = torch.randn(tokens, hidden, generator=rng).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=rng) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=rng) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=rng)
    if skewed:  # most tokens go to the low experts: one heavy expert, several idle ones
        logits += torch.linspace(6.0, -6.0, experts)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 17, 64, 300])
def test_matches_float64_for_1_to_300_tokens(rng, tokens: int, dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _problem(rng, tokens, 8, 64, 24, 2, skewed=tokens % 2 == 1,
                                        dtype=dtype)
    assert moe_experts_cpu.supports(x, w13, w2)
    _close(moe_experts_cpu.experts(x, w13, w2, weights, ids),
           _reference(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_uneven_loads_and_idle_experts_at_the_bench_shape(rng, dtype: torch.dtype) -> None:
    """Hidden 1024, 64 experts of 256, top-8 (make_moe_model's bench size): one expert
    carrying nearly every token, others none; hidden spans two column blocks. Experts with
    8 rows or more take the packed path, the others the dot products: both in one call."""
    x, w13, w2, weights, ids = _problem(rng, 37, 64, 1024, 256, 8, skewed=True, dtype=dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=64)
    assert (counts == 0).any() and counts.max() >= 30
    assert ((counts > 0) & (counts < 8)).any()
    _close(moe_experts_cpu.experts(x, w13, w2, weights, ids),
           _reference(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_last_column_block_shorter_than_the_others(rng, dtype: torch.dtype) -> None:
    """Hidden 1168 and intermediate 520: each projection's columns end in a partial block
    (KC = 512), on the dot path (few rows an expert) and the packed one (many)."""
    for tokens in (3, 40):
        x, w13, w2, weights, ids = _problem(rng, tokens, 4, 1168, 520, 2, skewed=False,
                                            dtype=dtype)
        _close(moe_experts_cpu.experts(x, w13, w2, weights, ids),
               _reference(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 300])
def test_prepacked_experts_match_float64(rng, tokens: int, dtype: torch.dtype) -> None:
    """Weights packed once (``pack_experts``, as the loader does) run every expert, one row
    or hundreds, through their panels; hidden 1168 / intermediate 520 (not multiples of any
    column block) and the bench shape with idle and heavy experts."""
    for experts, hidden, inter, top_k in ((4, 1168, 520, 2), (64, 1024, 256, 8)):
        if tokens == 300 and experts == 64:
            tokens = 64  # the float64 reference's loop is the slow part
        x, w13, w2, weights, ids = _problem(rng, tokens, experts, hidden, inter, top_k,
                                            skewed=tokens % 2 == 1, dtype=dtype)
        w13p, w2p = moe_experts_cpu.pack_experts(w13, w2)
        assert w13p.numel() == w13.numel() and w2p.numel() == w2.numel()
        assert w13p.dtype == w2p.dtype == dtype
        _close(moe_experts_cpu.experts_packed(x, w13p, w2p, weights, ids),
               _reference(x, w13, w2, weights, ids), dtype)


def test_pack_experts_lays_out_each_work_items_panel(rng) -> None:
    """Panel g of an expert: its gate rows 8g..8g+7 then the same up rows, column by
    column; panel n of the down projection: rows 16n..16n+15, column by column."""
    _, w13, w2, _, _ = _problem(rng, 1, 3, 32, 16, 1, skewed=False)
    w13p, w2p = moe_experts_cpu.pack_experts(w13, w2)
    assert w13p.shape == (3, 2, 32, 16) and w2p.shape == (3, 2, 16, 16)
    e, g, c = 2, 1, 5
    assert torch.equal(w13p[e, g, c, :8], w13[e, 8 * g:8 * g + 8, c])
    assert torch.equal(w13p[e, g, c, 8:], w13[e, 16 + 8 * g:16 + 8 * g + 8, c])
    assert torch.equal(w2p[e, 1, c], w2[e, 16:32, c])


def test_scratch_is_reused_across_calls_and_grown_for_larger_ones(rng, monkeypatch) -> None:
    monkeypatch.delattr(moe_experts_cpu._scratch, "buffer", raising=False)  # earlier tests'
    x, w13, w2, weights, ids = _problem(rng, 40, 8, 64, 24, 2, skewed=False)
    moe_experts_cpu.experts(x, w13, w2, weights, ids)
    first = moe_experts_cpu._scratch.buffer
    moe_experts_cpu.experts(x[:3], w13, w2, weights[:3], ids[:3])
    assert moe_experts_cpu._scratch.buffer is first
    big = _problem(rng, 400, 8, 64, 24, 2, skewed=False)
    _close(moe_experts_cpu.experts(*big), _reference(*big))
    assert moe_experts_cpu._scratch.buffer.numel() > first.numel()


def test_a_token_routed_twice_to_an_expert_and_unsorted_ids(rng) -> None:
    x, w13, w2, _, _ = _problem(rng, 5, 4, 16, 8, 3, skewed=False)
    ids = torch.tensor([[3, 0, 3], [1, 1, 1], [0, 2, 3], [2, 2, 0], [3, 3, 3]])
    weights = torch.rand(5, 3, generator=rng)
    _close(moe_experts_cpu.experts(x, w13, w2, weights, ids),
           _reference(x, w13, w2, weights, ids))


def test_shapes_the_kernel_does_not_take_run_the_grouped_path(rng) -> None:
    x, w13, w2, weights, ids = _problem(rng, 6, 4, 20, 12, 2, skewed=False)  # H, I not x8
    assert not moe_experts_cpu.supports(x, w13, w2)
    assert not moe_experts_cpu.supports(*_problem(rng, 2, 4, 24, 8, 2, skewed=False)[:3])
    torch.testing.assert_close(moe_experts_cpu.experts(x, w13, w2, weights, ids),
                               grouped_experts(x, w13, w2, weights, ids))
    half = [t.half() for t in _problem(rng, 3, 4, 16, 8, 2, skewed=False)[:3]]
    assert not moe_experts_cpu.supports(*half)
    mixed = _problem(rng, 3, 4, 16, 8, 2, skewed=False)[:3]
    assert not moe_experts_cpu.supports(mixed[0].bfloat16(), *mixed[1:])
    empty = moe_experts_cpu.experts(torch.zeros(0, 64), *_problem(rng, 1, 4, 64, 8, 2,
                                                                  False)[1:3],
                                    torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert empty.shape == (0, 64)


def test_portable_c_path_on_a_cpu_without_avx2(rng, tmp_path: Path, monkeypatch) -> None:
    """The loops other CPUs get (``portable_library``: no AVX2, no FMA intrinsics)."""
    # the quantized experts dequantize their rows through the int kernel's source
    here = Path(moe_experts_cpu.__file__)
    portable = portable_library(here.with_name("moe_experts_cpu.c"), tmp_path,
                                ("shoal_moe_experts", "shoal_moe_experts_scratch_bytes",
                                 "shoal_moe_experts_q", "shoal_moe_experts_packed"),
                                (here.with_name("int_matmul_cpu.c"),))
    monkeypatch.setattr(moe_experts_cpu, "load", lambda: portable)
    for dtype in DTYPES:
        for tokens, hidden in ((1, 64), (4, 64), (50, 1168)):
            x, w13, w2, weights, ids = _problem(rng, tokens, 8, hidden, 24, 2, skewed=True,
                                                dtype=dtype)
            _close(moe_experts_cpu.experts(x, w13, w2, weights, ids),
                   _reference(x, w13, w2, weights, ids), dtype)
            _close(moe_experts_cpu.experts_packed(x, *moe_experts_cpu.pack_experts(w13, w2),
                                                  weights, ids),
                   _reference(x, w13, w2, weights, ids), dtype)
    # quantized experts: FP8 blocks and int4 with 4-bit zero points, the portable loops
    from shoal.kernels.int_matmul_cpu import FP8, NO_OFFSET, ZEROS_U4
    from tests.kernels.test_moe_experts_quantized import (
        test_quantized_experts_match_float64 as quantized,
    )

    for bits, group, mode in ((FP8, 32, NO_OFFSET), (4, 32, ZEROS_U4)):
        for tokens in (1, 40):
            quantized(rng, bits, group, mode, tokens)
