"""The routed experts of an MoE block on CPU in float32 (``moe_experts_cpu.c`` in the native
library): SiLU-and-mul experts, each chosen expert's weights streamed once for all its tokens.

Same contract as ``moe_grouped.grouped_experts`` without biases and with SiLU:
``out[t] = sum_j topk_weights[t, j] * (w2[e] @ (silu(g) * u))`` where ``[g | u] =
w13[e] @ x[t]`` and ``e = topk_ids[t, j]``; ``w13 [E, 2I, H]``, ``w2 [E, H, I]``.

``supports`` says which calls the kernel takes (float32 CPU tensors, contiguous weights, H
and I multiples of 8); ``experts`` sends every other call to the grouped torch path, so a
caller can use it unconditionally.
"""

from __future__ import annotations

import torch

from shoal.kernels.moe_grouped import grouped_experts
from shoal.kernels.native_cpu import load

ALIGN = 8  # the AVX2 loops take 8 float32 per step, with no tail


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The kernel takes this call (else the grouped torch path runs)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return False
    if any(t.dtype != torch.float32 for t in (x, w13, w2)):
        return False
    if w13.dim() != 3 or w2.dim() != 3 or not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    return (x.shape[1] == hidden and two_inter % 2 == 0 and hidden % ALIGN == 0
            and inter % ALIGN == 0 and tuple(w2.shape) == (experts, hidden, inter))


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` in x's dtype: the kernel where ``supports``, else ``grouped_experts``."""
    if not supports(x, w13, w2):
        return grouped_experts(x, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    xc = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    if tokens == 0:
        return out
    rc = load().shoal_moe_experts_f32(xc.data_ptr(), tokens, hidden, two_inter // 2,
                                      num_experts, top_k, ids.data_ptr(), weights.data_ptr(),
                                      w13.data_ptr(), w2.data_ptr(), out.data_ptr())
    if rc != 0:  # the kernel's scratch could not be allocated: torch will say why, or cope
        return grouped_experts(x, w13, w2, topk_weights, topk_ids)
    return out
