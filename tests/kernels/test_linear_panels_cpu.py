"""The dense panel linear (``shoal.kernels.linear_panels_cpu``) against float64 math, float32
and bfloat16 weights, with and without a bias, 1 to 300 rows (one register block of 6 rows,
partial blocks, and row chunks: 300 rows of 1000 columns are a chunk of 252 and one of 48), output
sizes that are not a multiple of the 16-feature panel, views and leading dimensions, and the
portable C loops.

The kernel sums in float32 in its own order and rounds a bfloat16 result once, so results
are compared with a tolerance, never bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.kernels import linear_panels_cpu
from shoal.kernels.native_cpu import unavailable_reason
from tests.kernels.conftest import portable_library

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"native library: {unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16]


def _problem(rng: torch.Generator, rows: int, n: int, k: int, dtype: torch.dtype,
             with_bias: bool):
    x = torch.randn(rows, k, generator=rng).to(dtype)
    w = (torch.randn(n, k, generator=rng) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=rng).to(dtype) if with_bias else None
    return x, w, bias


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
           bias: torch.Tensor | None) -> None:
    want = x.double().reshape(-1, x.shape[-1]) @ w.double().t()
    if bias is not None:
        want = want + bias.double()
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], w.shape[0])
    err = (out.double().reshape(want.shape) - want).abs()
    if x.dtype == torch.float32:  # float32 sums of up to 1000 products
        assert err.max().item() <= 2e-5 * (want.abs().max().item() + 1e-30)
    else:  # one bfloat16 rounding (relative 2^-8) of each result, plus float32 noise
        assert torch.all(err <= want.abs() * 2 ** -8 + 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (33, 57), (300, 1000)])  # tails of 1 and 12
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_math(rng, dtype, rows, n, k, with_bias) -> None:
    x, w, bias = _problem(rng, rows, n, k, dtype, with_bias)
    panels = linear_panels_cpu.pack(w)
    _check(linear_panels_cpu.linear(x, panels, n, bias), x, w, bias)


def test_pack_lays_out_16_features_column_by_column_with_a_zero_tail(rng) -> None:
    w = torch.randn(37, 5, generator=rng)
    panels = linear_panels_cpu.pack(w)
    assert panels.shape == (3, 5, 16) and panels.dtype == w.dtype and panels.is_contiguous()
    assert torch.equal(panels[1, 3], w[16:32, 3])
    assert torch.equal(panels[2, :, :5], w[32:].t()) and not panels[2, :, 5:].any()
    assert linear_panels_cpu.pack(w.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_read_back_from_the_panels_are_the_weights_rows(rng, dtype) -> None:
    """A tied embedding's lookups: any id, the tail panel's included, any leading shape."""
    w = torch.randn(37, 24, generator=rng).to(dtype)
    ids = torch.tensor([[0, 15, 16], [36, 31, 32]])
    got = linear_panels_cpu.rows(linear_panels_cpu.pack(w), ids)
    assert got.shape == (2, 3, 24) and torch.equal(got, w[ids])


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_leading_dimensions_and_no_rows(rng, dtype) -> None:
    wide = torch.randn(5, 2, 160, generator=rng).to(dtype)
    x = wide[..., :128]  # rows further apart than their width
    w = torch.randn(48, 128, generator=rng).to(dtype)
    panels = linear_panels_cpu.pack(w)
    out = linear_panels_cpu.linear(x, panels, 48)
    _check(out, x, w, None)
    assert torch.equal(out, linear_panels_cpu.linear(x.contiguous(), panels, 48))
    assert linear_panels_cpu.linear(x[:0], panels, 48).shape == (0, 2, 48)


def test_refuses_what_it_cannot_read(rng) -> None:
    w = torch.randn(20, 16, generator=rng)
    panels = linear_panels_cpu.pack(w)
    with pytest.raises(ValueError, match="panel linear: x"):
        linear_panels_cpu.linear(torch.randn(2, 16).bfloat16(), panels, 20)
    with pytest.raises(ValueError, match="panel linear: x"):
        linear_panels_cpu.linear(torch.randn(2, 15), panels, 20)
    with pytest.raises(ValueError, match="panel linear: x"):
        linear_panels_cpu.linear(torch.randn(2, 16), panels, 40)  # 3 panels' worth
    with pytest.raises(ValueError, match="panel linear: bias"):
        linear_panels_cpu.linear(torch.randn(2, 16), panels, 20, torch.zeros(16))
    with pytest.raises(ValueError, match="panel weights"):
        linear_panels_cpu.pack(w.half())


def test_portable_c_path_on_a_cpu_without_avx2(rng, tmp_path: Path, monkeypatch) -> None:
    """The loops other CPUs get (``portable_library``: no AVX2, no FMA intrinsics)."""
    here = Path(linear_panels_cpu.__file__)
    portable = portable_library(here.with_name("linear_panels_cpu.c"), tmp_path,
                                ("shoal_linear_panels",))
    monkeypatch.setattr(linear_panels_cpu, "load", lambda: portable)
    for dtype in DTYPES:
        for rows in (1, 7, 300):
            x, w, bias = _problem(rng, rows, 33, 1000, dtype, with_bias=True)
            _check(linear_panels_cpu.linear(x, linear_panels_cpu.pack(w), 33, bias), x, w,
                   bias)
