"""Mixture-of-experts as one grouped computation: tokens sorted by expert, two grouped GEMMs.

Each token goes to k experts, so a step holds ``N = T * k`` (token, expert) assignments.
Sorting them by expert makes every expert's rows contiguous; then one ``torch._grouped_mm``
per projection multiplies each expert's rows by that expert's weight (ATen loops over the
groups in C++, calling the CPU BLAS per group; on Hopper it is one CUTLASS grouped GEMM).
No Python loop over experts, no padding, no copy of the weights: the experts' tensors are
read in place through transposed views.

Weights in the checkpoint's ``[out, in]`` orientation, stacked over experts:
  w13: [E, 2 * I, H]   each expert's gate rows, then its up rows
  w2:  [E, H, I]
  b13, b2 (optional, gpt-oss): [E, 2I], [E, H] biases of the two projections
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_ids [T, k]`` -> (``order [N]``: assignment indices grouped by expert, in
    token order within an expert; ``ends [E]`` int32: where each expert's rows end)."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.cumsum(0).to(torch.int32)


def clamped_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt-oss's activation on ``[gate | up]`` rows."""
    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)

    return act


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_torch,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for ``x [T, H]``, where
    ``expert_e(x) = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]``. Returns ``[T, H]`` in ``x``'s
    dtype."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    order, ends = sort_by_expert(topk_ids, w13.shape[0])
    token = order // top_k
    rows = x[token]  # [N, H], each expert's rows contiguous
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    if b13 is not None or b2 is not None:
        row_expert = topk_ids.reshape(-1)[order]
    if b13 is not None:
        gate_up += b13[row_expert]
    # the routing weight scales the I-wide activations (the down projection is linear in
    # them), a quarter of the elements of its H-wide output in a Qwen3-MoE
    scale = topk_weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
    hidden = act(gate_up)
    hidden *= scale
    out = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=ends)
    if b2 is not None:
        out += b2[row_expert] * scale
    # each token's k rows added into it in expert order, as transformers' own loop adds them
    # (in x's dtype); one pass, instead of un-sorting the rows into a copy and summing that
    return torch.zeros_like(x).index_add_(0, token, out)
