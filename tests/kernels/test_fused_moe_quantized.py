"""The Triton fused MoE on quantized experts (``fused_moe.fused_moe_quantized``), run by
triton's interpreter on CPU, against the float path (``fused_moe``) on the same weights
dequantized here from the codes: int4 and int8 with a scale and offset per group, FP8 with a
scale per block. Tiny shapes: the interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.fused_moe import fused_moe, fused_moe_quantized
from shoal.kernels.int_matmul_cpu import FP8, NO_OFFSET, OFFSETS, IntPacked, pack_int4


def _packed(rng: torch.Generator, n: int, k: int, bits: int, group: int
            ) -> tuple[IntPacked, torch.Tensor]:
    scales = (torch.rand(n, k // group, generator=rng) * 0.05 + 0.01) / (1 << max(0, bits - 4))
    index = torch.arange(k) // group
    if bits == FP8:
        w = (torch.randn(n, k, generator=rng) * 50).to(torch.float8_e4m3fn)
        return (IntPacked(w.view(torch.uint8), scales, torch.empty(0, dtype=torch.uint8), FP8,
                          group, k, NO_OFFSET), w.float() * scales[:, index])
    codes = torch.randint(0, 1 << bits, (n, k), generator=rng).to(torch.uint8)
    offsets = -torch.randint(0, 1 << bits, (n, k // group), generator=rng).float() * scales
    packed = IntPacked(pack_int4(codes) if bits == 4 else codes, scales, offsets, bits, group,
                       k, OFFSETS)
    packed.check()
    return packed, codes.float() * scales[:, index] + offsets[:, index]


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64), (FP8, 32)])
@pytest.mark.parametrize("tokens", [1, 19])
def test_quantized_experts_match_the_float_kernel(rng, bits, group, tokens) -> None:
    experts, hidden, inter, top_k = 4, 64, 32, 2
    w13, w13_dense = _packed(rng, experts * 2 * inter, hidden, bits, group)
    w2, w2_dense = _packed(rng, experts * hidden, inter, bits, min(group, inter))
    x = torch.randn(tokens, hidden, generator=rng)
    logits = torch.randn(tokens, experts, generator=rng)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    got = fused_moe_quantized(x, w13, w2, weights, ids, experts)
    want = fused_moe(x, w13_dense.view(experts, 2 * inter, hidden),
                     w2_dense.view(experts, hidden, inter), weights, ids)
    # float32 sums in another order (a fresh seed each run: 1e-4 was missed by one element of
    # 1216, 3.5e-4 on a value near 2.5, in a fresh-clone CI run); a wrong scale, offset or
    # code is off by a percent or more
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_zero_points_are_refused_on_the_gpu_path(rng) -> None:
    from shoal.kernels.int_matmul_cpu import ZERO_CONST

    w13, _ = _packed(rng, 4 * 64, 64, 4, 32)
    w2, _ = _packed(rng, 4 * 64, 32, 4, 32)
    w13 = IntPacked(w13.codes, w13.scales, torch.tensor([8], dtype=torch.uint8), 4, 32, 64,
                    ZERO_CONST)
    x = torch.randn(2, 64)
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="zero points"):
        fused_moe_quantized(x, w13, w2, torch.ones(2, 2), ids, 4)
