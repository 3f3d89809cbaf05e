"""One-kernel RMSNorm matches the reference and the model's own RMSNorm layer."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.reference import rms_norm_ref
from shoal.kernels.rms_norm import rms_norm


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 24), (1, 100)])
def test_matches_reference_for_any_leading_shape(rng, shape):
    x = torch.randn(shape, generator=rng) * 4
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=rng)

    out = torch.full_like(x, float("nan"))

    rms_norm(x, weight, 1e-6, out=out)

    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_models_rmsnorm_layer(rng, dtype):
    from shoal.runtime.model.layers import RMSNorm

    layer = RMSNorm(48, 1e-6, dtype, "cpu")
    layer.weight.data = (1 + 0.1 * torch.randn(48, generator=rng)).to(dtype)
    x = (torch.randn(6, 48, generator=rng) * 3).to(dtype)

    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(rms_norm(x, layer.weight, 1e-6), layer(x), rtol=tol, atol=tol)


def test_strided_rows_are_accepted(rng):
    wide = torch.randn(4, 80, generator=rng)
    x = wide[:, 8:40]
    weight = torch.rand(32, generator=rng) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_weight_of_the_wrong_size_is_rejected():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
