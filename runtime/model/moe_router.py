"""Routers: which k experts each token goes to, and with what weight.

Pure functions of the router logits ``[T, E]`` (computed in float32, as the reference
implementations do), returning ``(weights [T, k] float32, ids [T, k] int64)``:

- ``softmax_topk``: softmax over all experts, the k largest, optionally renormalised to sum
  to 1 (Mixtral always; Qwen2/3-MoE by ``norm_topk_prob``).
- ``topk_softmax``: gpt-oss. The k largest logits, then a softmax over those k.
- ``grouped_sigmoid_topk``: DeepSeek-V3 / GLM-4.5. Sigmoid scores; a correction bias shifts
  which experts are chosen but not their weights; experts fall in ``n_group`` groups, each
  group scored by the sum of its two best, and only the ``topk_group`` best groups compete;
  weights optionally renormalised, then multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
from shoal.runtime.model.moe_config import MoeConfig

Routing = tuple[torch.Tensor, torch.Tensor]  # (weights [T, k] float32, expert ids [T, k] int64)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> Routing:
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def grouped_sigmoid_topk(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                         correction_bias: torch.Tensor | None, renormalize: bool,
                         scaling: float) -> Routing:
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1),
                                    float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route(config: MoeConfig, logits: torch.Tensor,
          correction_bias: torch.Tensor | None = None) -> Routing:
    """The configured router on ``logits [T, E]``."""
    if config.scoring == "sigmoid":
        return grouped_sigmoid_topk(logits, config.top_k, config.n_group, config.topk_group,
                                    correction_bias, config.norm_topk_prob,
                                    config.routed_scaling_factor)
    if config.scoring == "topk_softmax":
        return topk_softmax(logits, config.top_k)
    weights, ids = softmax_topk(logits, config.top_k, config.norm_topk_prob)
    return weights * config.routed_scaling_factor if config.routed_scaling_factor != 1.0 \
        else weights, ids
