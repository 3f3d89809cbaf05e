"""The GPU weight-only GEMM (``shoal.kernels.dequant_gemm``: int4, int8, FP8 block-scaled) in
triton's interpreter against torch's matmul on the weights dequantized by the reference
formulas (the int layout's ``W = code * scale + offset``; FP8's ``fp8 * scale`` per block).
Tiny shapes, partial tiles on every side; a tolerance, never bit equality (another order
of the sums, and half-precision weights rounded as the dequantize-then-matmul path does).
Half precision is float16 here: the interpreter's bfloat16 ``tl.dot`` returns garbage
(triton 3.9, a plain bf16 x bf16 dot too); bfloat16 is compiled by ``make gpu-check``."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.dequant_gemm import FP8, INT4, INT8, choose_tiles, dequant_gemm
from shoal.kernels.int_matmul_cpu import pack_int4


def _close(out: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    assert out.shape == want.shape and out.dtype == want.dtype
    error = (out.double() - want.double()).abs().max().item()
    assert error <= tolerance * want.double().abs().max().item(), error


def _unpacked(codes: torch.Tensor, bits: int) -> torch.Tensor:
    from shoal.kernels.int_matmul_cpu import unpack_int4

    return unpack_int4(codes) if bits == 4 else codes


def _int_weights(rng: torch.Generator, n: int, k: int, bits: int, group: int):
    codes = torch.randint(0, 1 << bits, (n, k), generator=rng).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=rng) * 0.05 + 0.01
    offsets = -torch.randint(0, 1 << bits, (n, k // group), generator=rng).float() * scales
    index = torch.arange(k) // group
    dense = codes.float() * scales[:, index] + offsets[:, index]
    return (pack_int4(codes) if bits == 4 else codes), scales, offsets, dense


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize("rows", [1, 20, 70])  # each tile height, partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int_weights_equal_the_dequantized_matmul(rng, bits, group, rows, dtype,
                                                  scale_dtype) -> None:
    n, k = 40, 192  # partial column tiles; 192 is one and a half int4 K steps
    codes, scales, offsets, _ = _int_weights(rng, n, k, bits, group)
    scales, offsets = scales.to(scale_dtype), offsets.to(scale_dtype)  # as compact keeps them
    index = torch.arange(k) // group
    dense = _unpacked(codes, bits).float() * scales.float()[:, index] + \
        offsets.float()[:, index]
    x = torch.randn(rows, k, generator=rng).to(dtype)
    out = dequant_gemm(x, codes, scales, offsets, INT4 if bits == 4 else INT8, group)
    want = x.float() @ dense.to(dtype).float().t()
    _close(out, want.to(dtype), 2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(("k", "block_in"), [(256, 128), (200, 128), (96, 96), (100, 100)])
@pytest.mark.parametrize("rows", [3, 33])
def test_fp8_block_weights_equal_the_dequantized_matmul(rng, k, block_in, rows) -> None:
    from shoal.runtime.model.quant.fp8_block import dequantize_rows

    n = 36
    weight = (torch.randn(n, k, generator=rng) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(n, -(-k // block_in), generator=rng) + 0.5
    x = torch.randn(2, rows, k, generator=rng).half()  # leading dimensions kept
    out = dequant_gemm(x, weight, scales, None, FP8, block_in)
    want = x.float() @ dequantize_rows(weight, scales, block_in, torch.float16).float().t()
    _close(out, want.half(), 1e-2)


def test_shapes_that_do_not_fit_are_refused(rng) -> None:
    codes, scales, offsets, _ = _int_weights(rng, 8, 64, 4, 32)
    with pytest.raises(ValueError, match="do not fit 96 input columns"):
        dequant_gemm(torch.randn(1, 96), codes, scales, offsets, INT4, 32)
    with pytest.raises(ValueError, match="offsets"):
        dequant_gemm(torch.randn(1, 64), codes, scales, None, INT4, 32)


def test_tiles_cover_whole_sub_blocks() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for m in (1, 16, 17, 33, 64, 65, 512):
            tiles = choose_tiles(m, dtype)
            assert tiles.block_k % 32 == 0 and tiles.block_m >= min(m, 16)
