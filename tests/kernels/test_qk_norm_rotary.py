"""Fused per-head RMSNorm + rotary matches the two reference ops applied in sequence, and
the model's own q/k norm + rotary layers."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.qk_norm_rotary import qk_norm_rotary
from shoal.kernels.reference import head_rms_norm_rotary_ref


def _tables(max_position: int, head_dim: int, theta: float = 10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("num_heads,head_dim", [(4, 16), (3, 12), (1, 8)])
def test_matches_norm_then_rotary(rng, num_heads, head_dim):
    x = torch.randn(9, num_heads, head_dim, generator=rng) * 3
    weight = 1 + 0.1 * torch.randn(head_dim, generator=rng)
    positions = torch.randint(0, 64, (9,), generator=rng)
    cos, sin = _tables(64, head_dim)
    out = torch.full_like(x, float("nan"))

    qk_norm_rotary(x, weight, positions, cos, sin, 1e-6, out=out)

    expected = head_rms_norm_rotary_ref(x, weight, positions, cos, sin, 1e-6)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_matches_the_models_qk_norm_and_rotary_layers(rng):
    from shoal.runtime.model.layers import RMSNorm, RotaryEmbedding

    norm = RMSNorm(32, 1e-6, torch.float32, "cpu")
    norm.weight.data = 1 + 0.1 * torch.randn(32, generator=rng)
    rotary = RotaryEmbedding.default(32, 128, 1e6, torch.float32, "cpu")
    q = torch.randn(7, 4, 32, generator=rng)
    k = torch.randn(7, 2, 32, generator=rng)
    positions = torch.randint(0, 128, (7,), generator=rng)

    want_q, want_k = rotary(positions, norm(q), norm(k))

    got_q = qk_norm_rotary(q, norm.weight, positions, rotary.cos, rotary.sin, 1e-6)
    got_k = qk_norm_rotary(k, norm.weight, positions, rotary.cos, rotary.sin, 1e-6)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_in_place_on_a_strided_view_of_the_qkv_projection(rng):
    """q and k are slices of one fused projection: strided rows, written in place."""
    qkv = torch.randn(5, 4 + 2 + 2, 16, generator=rng)
    original = qkv.clone()
    weight = torch.ones(16)
    positions = torch.arange(5)
    cos, sin = _tables(8, 16)
    k = qkv[:, 4:6]

    qk_norm_rotary(k, weight, positions, cos, sin, 1e-6, out=k)

    expected = head_rms_norm_rotary_ref(original[:, 4:6], weight, positions, cos, sin, 1e-6)
    torch.testing.assert_close(qkv[:, 4:6], expected)
    assert torch.equal(qkv[:, :4], original[:, :4]) and torch.equal(qkv[:, 6:], original[:, 6:])


def test_half_precision(rng):
    x = torch.randn(6, 2, 16, generator=rng).half()
    weight = torch.rand(16, generator=rng).half() + 0.5
    positions = torch.arange(6)
    cos, sin = _tables(8, 16)

    out = qk_norm_rotary(x, weight, positions, cos, sin, 1e-6)

    expected = head_rms_norm_rotary_ref(x, weight, positions, cos, sin, 1e-6)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_bad_shapes_are_rejected():
    cos, sin = _tables(4, 8)
    with pytest.raises(ValueError, match="even head_dim"):
        qk_norm_rotary(torch.zeros(1, 1, 7), torch.ones(7), torch.zeros(1, dtype=torch.long), cos, sin, 1e-6)
    with pytest.raises(ValueError, match="cos must be"):
        qk_norm_rotary(torch.zeros(1, 1, 8), torch.ones(8), torch.zeros(1, dtype=torch.long),
                       torch.zeros(4, 8), sin, 1e-6)
