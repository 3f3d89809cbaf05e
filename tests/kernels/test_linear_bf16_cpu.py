"""The bfloat16 linear kernel (``shoal.kernels.linear_bf16_cpu``) and its choice.

Its paths (torch's bfloat16 GEMV for one or two rows, widened float32 GEMM for more) sum in
float32 and round once, so each must equal float32 math on the same bfloat16 values rounded
to bfloat16: within one bfloat16 rounding of the result (sums in another order may round the
other way at a tie-breaking boundary).
"""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.model.ops import choose_kernels

from shoal.kernels import linear_bf16_cpu


def _expected(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    if bias is not None:
        out = out + bias.double()
    return out


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 70])  # every path, odd row counts
@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 57), (300, 1000)])  # tails of 32 and 16
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_equals_float32_math_on_the_same_values(rng, rows, n, k, with_bias):
    x = torch.randn(rows, k, generator=rng).bfloat16()
    w = (torch.randn(n, k, generator=rng) / k ** 0.5).bfloat16()
    bias = torch.randn(n, generator=rng).bfloat16() if with_bias else None

    expected = _expected(x, w, bias)
    out = linear_bf16_cpu.linear_bf16(x, w, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # one bfloat16 rounding (relative 2^-8) of each result, plus float32 summation noise
    assert torch.all((out.double() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-4)


def test_linear_bf16_takes_views_and_leading_dimensions(rng):
    wide = torch.randn(5, 2, 160, generator=rng).bfloat16()
    x = wide[..., :128]  # rows further apart than their width
    w = torch.randn(48, 128, generator=rng).bfloat16()
    out = linear_bf16_cpu.linear_bf16(x, w)
    assert out.shape == (5, 2, 48)
    torch.testing.assert_close(out, linear_bf16_cpu.linear_bf16(x.contiguous(), w),
                               rtol=0, atol=0)
    empty = linear_bf16_cpu.linear_bf16(x[:0], w)
    assert empty.shape == (0, 2, 48)


def test_linear_bf16_refuses_what_it_cannot_read(rng):
    w = torch.randn(8, 16, generator=rng).bfloat16()
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        linear_bf16_cpu.linear_bf16(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="x has 15 features, the weight takes 16"):
        linear_bf16_cpu.linear_bf16(torch.randn(2, 15).bfloat16(), w)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        linear_bf16_cpu.linear_bf16(torch.randn(2, 8).bfloat16(), w.t())


@pytest.mark.parametrize(("attention", "onednn_bf16", "linear", "ops"), [
    # the native cpu backend runs the position-wise ops natively in bfloat16 too (cpu_ops)
    ("cpu", False, "native_bf16", "native_cpu"),  # Zen 3, AVX2: oneDNN has no bf16 kernels
    ("cpu", True, "onednn", "native_cpu"),  # AMX / AVX512-BF16: oneDNN packs bfloat16
    ("torch", False, "torch", "torch"),  # the reference backend: plain torch throughout
])
def test_bf16_on_cpu_chooses_onednn_where_it_packs_bf16_else_the_native_kernel(
        attention, onednn_bf16, linear, ops):
    choice = choose_kernels("cpu", torch.bfloat16, attention, False, onednn_available=True,
                            onednn_bf16=onednn_bf16)
    assert (choice.linear, choice.norm, choice.rotary) == (linear, ops, ops)
