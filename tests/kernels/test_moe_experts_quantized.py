"""Quantized routed experts on the native kernel (``moe_experts_cpu.experts_quantized``) and
the packed layout's zero-point and FP8 forms (``int_matmul_cpu``), against float64 math on
weights dequantized here from the codes, independently of the kernel.

Sums are float32 in the kernel's order, so outputs are compared with a tolerance relative to
their size; the dequantized weights themselves must be exactly the reference's.
"""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import moe_experts_cpu
from shoal.kernels.int_matmul_cpu import (
    FP8,
    NO_OFFSET,
    OFFSETS,
    ZERO_CONST,
    ZEROS_U4,
    ZEROS_U8,
    IntPacked,
    dequantize,
    int_matmul,
    pack_int4,
    zero_points,
)
from shoal.kernels.native_cpu import unavailable_reason
from shoal.kernels.reference import moe_ref

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"native library: {unavailable_reason()}")


def _packed(rng: torch.Generator, n: int, k: int, bits: int, group: int, mode: int,
            scale_dtype: torch.dtype = torch.float32) -> tuple[IntPacked, torch.Tensor]:
    """Random weights in the layout and float64 W computed from the codes."""
    scales = (torch.rand(n, k // group, generator=rng) * 0.05 + 0.01).to(scale_dtype)
    s = scales.double()[:, torch.arange(k) // group]
    if bits == FP8:
        w = (torch.randn(n, k, generator=rng) * 100).to(torch.float8_e4m3fn)
        packed = IntPacked(w.view(torch.uint8), scales, torch.empty(0, dtype=torch.uint8),
                           FP8, group, k, NO_OFFSET)
        return packed, w.double() * s
    codes = torch.randint(0, 1 << bits, (n, k), generator=rng).to(torch.uint8)
    if mode == ZERO_CONST:
        zeros = torch.full((n, k // group), float(1 << (bits - 1)))
    else:
        zeros = torch.randint(0, 16 if mode == ZEROS_U4 else 1 << bits, (n, k // group),
                              generator=rng).float()
    if mode == OFFSETS:
        offsets, kept = (-zeros * scales.float()).to(scale_dtype), OFFSETS
    else:
        found = zero_points(zeros, bits)
        assert found is not None
        offsets, kept = found
        assert kept == mode
    w = IntPacked(pack_int4(codes) if bits == 4 else codes, scales, offsets, bits, group, k,
                  kept)
    w.check()
    if mode == OFFSETS:
        return w, codes.double() * s + offsets.double()[:, torch.arange(k) // group]
    # the kernel forms -z * s in float32, then one FMA: the reference rounds the same way
    o = (-zeros * scales.float()).double()[:, torch.arange(k) // group]
    return w, codes.double() * s + o


CASES = [(4, 32, ZEROS_U4), (4, 64, ZERO_CONST), (4, 32, OFFSETS), (8, 32, ZEROS_U8),
         (8, 64, ZERO_CONST), (FP8, 32, NO_OFFSET), (FP8, 64, NO_OFFSET)]


@pytest.mark.parametrize("bits, group, mode", CASES)
def test_dense_matmul_and_dequantize_in_every_zero_form(rng, bits, group, mode) -> None:
    w, want = _packed(rng, 48, 128, bits, group, mode, torch.bfloat16)
    assert torch.equal(dequantize(w).double(), want.float().double())
    for rows in (1, 3):
        x = torch.randn(rows, 128, generator=rng)
        out = int_matmul(x, w).double()
        ref = x.double() @ want.t()
        assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    return moe_ref(x.double(), w13, w2, weights, ids)


@pytest.mark.parametrize("bits, group, mode", CASES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_quantized_experts_match_float64(rng, bits, group, mode, tokens) -> None:
    """Few tokens an expert (the dot path) and many (the packed panel), uneven loads."""
    experts, hidden, inter, top_k = 8, 128, 64, 2
    w13, w13_ref = _packed(rng, experts * 2 * inter, hidden, bits, group, mode)
    w2, w2_ref = _packed(rng, experts * hidden, inter, bits, min(group, inter), mode)
    x = torch.randn(tokens, hidden, generator=rng)
    logits = torch.randn(tokens, experts, generator=rng) + torch.linspace(3.0, -3.0, experts)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    want = _reference(x, w13_ref.view(experts, 2 * inter, hidden),
                      w2_ref.view(experts, hidden, inter), weights, ids)
    for dtype, tolerance in ((torch.float32, 3e-5), (torch.bfloat16, 2e-2)):
        xin = x.to(dtype)
        if dtype != torch.float32:
            want = _reference(xin.float(), w13_ref.view(experts, 2 * inter, hidden),
                              w2_ref.view(experts, hidden, inter), weights, ids)
        got = moe_experts_cpu.experts_quantized(xin, w13, w2, weights, ids, experts)
        assert got.dtype == dtype and got.shape == want.shape
        err = (got.double() - want).abs().max().item()
        assert err <= tolerance * want.abs().max().item(), (dtype, err)


def test_zero_points_take_the_narrowest_form() -> None:
    assert zero_points(torch.full((4, 2), 8.0), 4)[1] == ZERO_CONST
    z, mode = zero_points(torch.tensor([[1.0, 2.0, 3.0]]), 4)
    assert mode == ZEROS_U4 and z.tolist() == [1 | 2 << 4, 3]
    assert zero_points(torch.tensor([[1.0, 16.0]]), 4)[1] == ZEROS_U8  # GPTQ's stored 15 + 1
    assert zero_points(torch.tensor([[0.5, 1.0]]), 4) is None
    assert zero_points(torch.tensor([[0.0, 256.0]]), 8) is None
