"""The native weight-only int4/int8 matmul (``shoal.kernels.int_matmul_cpu``) against float64
math on the weights it dequantizes, computed here from the unpacked codes (not by the kernel).

The kernel sums in float32 in another order than float64 math, so results are compared with
a tolerance relative to the output's size, never bit for bit; bfloat16 activations are
rounded by the caller, and the result once more to bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.kernels import int_matmul_cpu
from shoal.kernels.int_matmul_cpu import IntPacked, dequantize, int_matmul, pack_int4, unpack_int4
from shoal.kernels.native_cpu import unavailable_reason
from tests.kernels.conftest import portable_library

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"native library: {unavailable_reason()}")


def _weights(rng: torch.Generator, n: int, k: int, bits: int, group: int
             ) -> tuple[IntPacked, torch.Tensor]:
    """Random codes, scales and offsets in the kernel's layout, and float64 W from them."""
    codes = torch.randint(0, 1 << bits, (n, k), generator=rng).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=rng) * 0.05 + 0.01
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=rng).float()
    offsets = -zeros * scales
    packed = pack_int4(codes) if bits == 4 else codes
    w = IntPacked(packed, scales, offsets, bits, group, k)
    w.check()
    index = torch.arange(k) // group
    reference = codes.double() * scales.double()[:, index] + offsets.double()[:, index]
    return w, reference


def _close(out: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    assert out.shape == want.shape
    error = (out.double() - want).abs().max().item()
    assert error <= tolerance * want.abs().max().item(), (error, want.abs().max().item())


def test_nibble_order_is_ggufs() -> None:
    """Byte i of a 32-column sub-block: column i low, column 16 + i high (Q4_0/Q4_1)."""
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    codes[0, 32:] = 15 - codes[0, 32:]
    packed = pack_int4(codes)
    assert packed.shape == (1, 32)
    for i in range(16):
        assert int(packed[0, i]) == int(codes[0, i]) | int(codes[0, 16 + i]) << 4
        assert int(packed[0, 16 + i]) == int(codes[0, 32 + i]) | int(codes[0, 48 + i]) << 4
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize(("n", "k", "bits", "group"), [
    (13, 64, 4, 32),  # a last tile of one row, two groups
    (64, 1024, 4, 128),  # two column chunks
    (37, 96, 8, 96),  # per channel, a partial chunk
    (130, 640, 8, 32),
    (70, 1600, 4, 1600),  # per channel, a chunk boundary inside the group
])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 64, 100])  # every tile height, GEMM path
def test_matmul_equals_float64_on_the_dequantized_weights(rng, n, k, bits, group, rows):
    w, reference = _weights(rng, n, k, bits, group)
    x = torch.randn(rows, k, generator=rng)
    _close(int_matmul(x, w), x.double() @ reference.t(), 2e-6)
    xb = x.bfloat16()
    out = int_matmul(xb, w)
    assert out.dtype == torch.bfloat16
    _close(out, xb.double() @ reference.t(), 1e-2)  # one bfloat16 rounding of the result


def test_dequantize_and_leading_dimensions(rng) -> None:
    w, reference = _weights(rng, 48, 256, 4, 64)
    assert torch.allclose(dequantize(w).double(), reference, rtol=1e-6, atol=1e-7)
    assert torch.allclose(dequantize(w, 16, 40).double(), reference[16:40], rtol=1e-6,
                          atol=1e-7)
    x = torch.randn(2, 3, 256, generator=rng)
    _close(int_matmul(x, w), x.double() @ reference.t(), 2e-6)
    strided = torch.randn(5, 512, generator=rng)[:, ::2]  # rows not contiguous in memory
    _close(int_matmul(strided, w), strided.double() @ reference.t(), 2e-6)
    assert int_matmul(torch.empty(0, 256), w).shape == (0, 48)


def test_gemm_path_and_kernel_agree(rng, monkeypatch) -> None:
    """The same rows through both paths (the row threshold moved) give the same sums up to
    float32 order."""
    w, reference = _weights(rng, 80, 512, 4, 128)
    x = torch.randn(20, 512, generator=rng)
    by_kernel = int_matmul(x, w)
    monkeypatch.setattr(int_matmul_cpu, "GEMM_MIN_ROWS", 1)
    _close(int_matmul(x, w), x.double() @ reference.t(), 2e-6)
    _close(by_kernel, int_matmul(x, w).double(), 2e-6)


def _sixteen_bit(w: IntPacked, dtype: torch.dtype) -> tuple[IntPacked, IntPacked]:
    """``w``'s scales and offsets rounded to ``dtype``: (kept in it, the same values in
    float32)."""
    scales, offsets = w.scales.to(dtype), w.offsets.to(dtype)
    return (IntPacked(w.codes, scales, offsets, w.bits, w.group, w.in_features),
            IntPacked(w.codes, scales.float(), offsets.float(), w.bits, w.group,
                      w.in_features))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 64)])
def test_16_bit_scales_give_the_same_weights(rng, dtype, bits, group) -> None:
    from shoal.kernels.int_matmul_cpu import compact

    w16, w32 = _sixteen_bit(_weights(rng, 40, 256, bits, group)[0], dtype)
    w16.check()
    assert torch.equal(dequantize(w16), dequantize(w32))
    reference = dequantize(w32).double()
    for rows in (1, 5, 300):  # one row, the tiles, the GEMM path
        x = torch.randn(rows, 256, generator=rng)
        _close(int_matmul(x, w16), x.double() @ reference.t(), 2e-6)
    kept = compact(w32)  # exact in 16 bits: kept there, the same weights
    assert kept.scales.dtype in (torch.float16, torch.bfloat16)
    assert torch.equal(dequantize(kept), dequantize(w32))
    w, _ = _weights(rng, 8, 64, 4, 32)
    assert compact(w) is w  # random float32 scales are not


@pytest.mark.parametrize("bad", ["bits", "columns", "group", "codes"])
def test_layouts_the_kernel_cannot_read_are_refused(rng, bad: str) -> None:
    w, _ = _weights(rng, 8, 64, 4, 32)
    if bad == "bits":
        w.bits = 3
    elif bad == "columns":
        w.in_features = 48
    elif bad == "group":
        w.group = 16
    else:
        w.codes = w.codes[:, :16]
    with pytest.raises(ValueError):
        w.check()


def test_portable_c_path_on_a_cpu_without_avx2(rng, tmp_path: Path, monkeypatch) -> None:
    """The loops other CPUs get (``portable_library``: no AVX2, no FMA), against the same
    float64 math."""
    portable = portable_library(Path(int_matmul_cpu.__file__).with_name("int_matmul_cpu.c"),
                                tmp_path, ("shoal_int_matmul_f32", "shoal_int_dequant_f32"))
    monkeypatch.setattr(int_matmul_cpu, "load", lambda: portable)
    for n, k, bits, group in [(13, 64, 4, 32), (37, 96, 8, 96), (70, 1600, 4, 1600)]:
        w, reference = _weights(rng, n, k, bits, group)
        # code * scale + offset rounded twice here (no FMA): within a few float32 ulps of
        # the offset, which is up to 15 * 0.06 in these weights
        assert torch.allclose(dequantize(w).double(), reference, rtol=1e-6, atol=1e-6)
        for rows in (1, 2, 4, 300):  # one row, the tiles, the GEMM path
            x = torch.randn(rows, k, generator=rng)
            _close(int_matmul(x, w), x.double() @ reference.t(), 2e-6)
        for dtype in (torch.float16, torch.bfloat16):  # 16-bit scales, no F16C
            w16, w32 = _sixteen_bit(w, dtype)
            assert torch.equal(dequantize(w16), dequantize(w32))
