"""One-kernel SwiGLU activation matches silu(gate) * up."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.reference import silu_and_mul_ref
from shoal.kernels.silu_and_mul import silu_and_mul


@pytest.mark.parametrize("shape", [(5, 2 * 48), (2, 3, 2 * 7), (3, 2 * 1500)])
def test_matches_reference(rng, shape):
    x = torch.randn(shape, generator=rng) * 3
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"))

    silu_and_mul(x, out=out)

    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-5, atol=1e-5)


def test_half_precision_rounds_like_the_torch_ops(rng):
    x = (torch.randn(4, 64, generator=rng) * 3).half()
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=1e-3, atol=1e-3)


def test_an_odd_last_dimension_is_rejected():
    with pytest.raises(ValueError, match="gate and up"):
        silu_and_mul(torch.zeros(2, 5))
