"""The grouped expert computations (torch grouped GEMM on CPU, the Triton fused-MoE kernel
under the interpreter) against a per-expert loop reference."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.fused_moe import align_by_expert, fused_moe
from shoal.kernels.moe_grouped import grouped_experts, sort_by_expert
from shoal.kernels.reference import moe_ref


def random_moe(rng, tokens, hidden, inter, experts, top_k, dtype=torch.float32):
    x = torch.randn(tokens, hidden, generator=rng).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=rng) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=rng) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=rng)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 8, 2), (33, 16, 4), (5, 4, 4)])
def test_grouped_torch_path_matches_the_per_expert_loop(rng, tokens, experts, top_k):
    x, w13, w2, weights, ids = random_moe(rng, tokens, 48, 24, experts, top_k)
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids),
                               moe_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_grouped_torch_path_in_bfloat16(rng):
    x, w13, w2, weights, ids = random_moe(rng, 20, 64, 32, 8, 2, torch.bfloat16)
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids),
                               moe_ref(x, w13, w2, weights, ids), rtol=3e-2, atol=3e-2)


def test_no_tokens_gives_an_empty_result(rng):
    x, w13, w2, weights, ids = random_moe(rng, 0, 16, 8, 4, 2)
    assert grouped_experts(x, w13, w2, weights, ids).shape == (0, 16)


def test_sort_by_expert_groups_rows_in_token_order():
    ids = torch.tensor([[2, 0], [0, 1], [2, 0]])
    order, ends = sort_by_expert(ids, 4)
    assert order.tolist() == [1, 2, 5, 3, 0, 4]
    assert ends.tolist() == [3, 4, 6, 6]


def test_align_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [0, 1], [2, 0]])  # expert 0: 3 rows, 1: 1, 2: 2, 3: none
    sorted_ids, block_expert = align_by_expert(ids, 4, block_m=2)
    assert sorted_ids.tolist() == [1, 2, 5, 6, 3, 6, 0, 4]  # 6 = N: padding
    assert block_expert.tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter",
                         [(3, 4, 2, 32, 16), (19, 8, 2, 40, 24), (2, 6, 3, 16, 48)])
def test_triton_fused_moe_matches_the_per_expert_loop(rng, tokens, experts, top_k, hidden,
                                                      inter):
    x, w13, w2, weights, ids = random_moe(rng, tokens, hidden, inter, experts, top_k)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids),
                               moe_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_triton_fused_moe_rejects_mismatched_down_weights(rng):
    x, w13, w2, weights, ids = random_moe(rng, 2, 16, 8, 4, 2)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(x, w13, w2[:, :, :4], weights, ids)


def test_triton_fused_moe_in_half_precision(rng):
    """float16: the interpreter's bfloat16 (numpy has none) is not a faithful stand-in."""
    x, w13, w2, weights, ids = random_moe(rng, 9, 32, 16, 4, 2, torch.float16)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids),
                               moe_ref(x, w13, w2, weights, ids), rtol=3e-2, atol=3e-2)
