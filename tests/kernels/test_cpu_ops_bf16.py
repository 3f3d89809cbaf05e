"""The native bfloat16 position-wise ops (``cpu_ops`` over ``cpu_ops_bf16.c``) against the
torch bfloat16 ops a model runs without them (``ops.Kernels`` with the torch choice, and
``rope.rotate``): the same roundings in the same places, so within a bfloat16 rounding step
(a sum's order or an exp's last bit may differ), on the shapes and strided views the model
passes them."""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.model.layers import RotaryEmbedding
from shoal.runtime.model.ops import Kernels, choose_kernels

from shoal.kernels import cpu_ops, native_cpu

BF16 = torch.bfloat16
# one bfloat16 rounding step of values of size ~1-10
CLOSE = {"rtol": 2 ** -7, "atol": 2 ** -6}


@pytest.fixture(scope="module")
def torch_ops() -> Kernels:
    native_cpu.load()
    return Kernels(choose_kernels("cpu", BF16, "torch", False, False))


@pytest.mark.parametrize("rows", [0, 1, 3, 130])
def test_rms_norm_matches_the_torch_path_with_and_without_the_residual(torch_ops, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1024, generator=gen) * 4).to(BF16)
    residual = torch.randn(rows, 1024, generator=gen).to(BF16)
    weight = torch.randn(1024, generator=gen).to(BF16)

    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6),
                               torch_ops.rms_norm(x, weight, 1e-6), **CLOSE)
    expected, expected_stream = torch_ops.rms_norm(x, weight, 1e-6, residual)
    stream = residual.clone()
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6, stream), expected, **CLOSE)
    assert torch.equal(stream, expected_stream)  # one bfloat16 add, rounded once, in place


def test_rms_norm_reads_strided_rows(torch_ops):
    wide = torch.randn(5, 200).to(BF16)
    x, weight = wide[:, 8:72], torch.randn(64).to(BF16)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5),
                               torch_ops.rms_norm(x.contiguous(), weight, 1e-5), **CLOSE)


@pytest.mark.parametrize("rows", [0, 2, 64])
@pytest.mark.parametrize("size", [7, 1536])  # a tail shorter than a vector, several chunks
def test_silu_and_mul_matches_the_torch_path(torch_ops, rows, size):
    gate_up = (torch.randn(rows, 2 * size) * 6).to(BF16)  # saturating tails of the sigmoid
    expected = torch_ops.gated_activation("silu")(gate_up)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), expected, **CLOSE)


def _qkv(tokens: int, q_heads: int, kv_heads: int, head_dim: int):
    rotary = RotaryEmbedding.default(head_dim, 64, 10000.0, BF16, "cpu")
    cos, sin = rotary.cos_sin(torch.randint(0, 64, (tokens,)))
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim) * 3).to(BF16)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads,
                                                                         head_dim)
    both = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    return rotary, cos, sin, qkv, q, k, both


def test_rotary_in_place_matches_the_torch_rotation():
    rotary, cos, sin, qkv, q, k, both = _qkv(9, 4, 2, 32)
    v_before = qkv[:, 6 * 32:].clone()
    expected_q, expected_k = rotary.rotate((cos, sin), q, k)
    cpu_ops.rotary_neox_(both, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(q, expected_q, **CLOSE)
    torch.testing.assert_close(k, expected_k, **CLOSE)
    assert torch.equal(qkv[:, 6 * 32:], v_before)  # v untouched


@pytest.mark.parametrize("tokens", [1, 40])
def test_qk_norm_and_rotary_in_place_match_the_norm_then_the_rotation(torch_ops, tokens):
    rotary, cos, sin, qkv, q, k, both = _qkv(tokens, 16, 8, 128)
    q_weight, k_weight = torch.randn(128).to(BF16), torch.randn(128).to(BF16)
    v_before = qkv[:, 24 * 128:].clone()
    expected_q, expected_k = rotary.rotate(
        (cos, sin), torch_ops.rms_norm(q, q_weight, 1e-6), torch_ops.rms_norm(k, k_weight, 1e-6))
    cpu_ops.qk_norm_rotary_(both, 16, q_weight, k_weight, 1e-6, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(q, expected_q, **CLOSE)
    torch.testing.assert_close(k, expected_k, **CLOSE)
    assert torch.equal(qkv[:, 24 * 128:], v_before)


def test_ops_refuse_mixed_types():
    with pytest.raises(ValueError, match="weight must be"):
        cpu_ops.rms_norm(torch.randn(2, 8).to(BF16), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="residual must be a bfloat16"):
        cpu_ops.rms_norm(torch.randn(2, 8).to(BF16), torch.randn(8).to(BF16), 1e-6,
                         torch.randn(2, 8))
    with pytest.raises(ValueError, match="cos must be a bfloat16"):
        cpu_ops.rotary_neox_(torch.randn(3, 2, 8).to(BF16), torch.randn(3, 4),
                             torch.randn(3, 4))
    with pytest.raises(ValueError, match="qk must be bfloat16"):
        cpu_ops.qk_norm_rotary_(torch.randn(3, 2, 8), 1, torch.randn(8), torch.randn(8), 1e-6,
                                torch.randn(3, 4), torch.randn(3, 4))
