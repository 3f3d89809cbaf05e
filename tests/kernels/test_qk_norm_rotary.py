"""Fused per-head RMSNorm + rotary matches the two reference ops applied in sequence."""

from __future__ import annotations

import pytest
import torch
from shoal.kernels.qk_norm_rotary import qk_norm_rotary
from shoal.kernels.reference import head_rms_norm_rotary_ref


def _cos_sin_cache(max_position: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("num_heads,head_dim", [(4, 16), (3, 12), (1, 8)])
def test_matches_norm_then_rotary(rng, num_heads, head_dim):
    x = torch.randn(9, num_heads, head_dim, generator=rng) * 3
    weight = 1 + 0.1 * torch.randn(head_dim, generator=rng)
    positions = torch.randint(0, 64, (9,), generator=rng)
    cache = _cos_sin_cache(64, head_dim)
    out = torch.full_like(x, float("nan"))

    qk_norm_rotary(x, weight, positions, cache, 1e-6, out=out)

    expected = head_rms_norm_rotary_ref(x, weight, positions, cache, 1e-6)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_in_place_on_a_strided_view_of_the_qkv_projection(rng):
    """The model applies it to q and k sliced from one fused projection, in place."""
    qkv = torch.randn(5, 4 + 2 + 2, 16, generator=rng)
    original = qkv.clone()
    weight = torch.ones(16)
    positions = torch.arange(5)
    cache = _cos_sin_cache(8, 16)
    k = qkv[:, 4:6]

    qk_norm_rotary(k, weight, positions, cache, 1e-6, out=k)

    torch.testing.assert_close(qkv[:, 4:6], head_rms_norm_rotary_ref(original[:, 4:6], weight, positions, cache, 1e-6))
    assert torch.equal(qkv[:, :4], original[:, :4]) and torch.equal(qkv[:, 6:], original[:, 6:])


def test_half_precision(rng):
    x = torch.randn(6, 2, 16, generator=rng).half()
    weight = torch.rand(16, generator=rng).half() + 0.5
    positions = torch.arange(6)
    cache = _cos_sin_cache(8, 16)

    out = qk_norm_rotary(x, weight, positions, cache, 1e-6)

    expected = head_rms_norm_rotary_ref(x, weight, positions, cache, 1e-6)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="even head_dim"):
        qk_norm_rotary(torch.zeros(1, 1, 7), torch.ones(7), torch.zeros(1, dtype=torch.long),
                       torch.zeros(4, 7), 1e-6)
