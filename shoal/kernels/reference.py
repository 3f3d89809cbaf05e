"""Plain torch references for every Triton kernel in this package.

They are written for clarity, not speed: loops over requests, explicit gathers, float32
math. Tests compare each kernel against its reference on random inputs; the torch attention
backend of the runtime is a separate implementation, so the two do not share mistakes.

Shapes (the paged KV layout of ``runtime/attention/backend.py``, NHD):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     [T]   block_id * block_size + offset; negative = padding, not written
  query_start_loc:  [B+1] where each request's query tokens start in the flat batch
  seq_lens:         [B]   context length including this step's tokens
  block_tables:     [B, max_blocks]

Sliding window ``W``: the query at position ``p`` sees the keys at positions ``(p - W, p]``
(the last ``W`` tokens, itself included), as in HF Mistral/Qwen.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one request: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    blocks = block_table.to(torch.long)[positions // block_size]
    return cache[blocks, positions % block_size]


def paged_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B+1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole cached context; with
    ``softcap``, scores become ``softcap * tanh(scores / softcap)``; with ``sinks``, one more
    logit per head joins the softmax and its probability is dropped (gpt-oss)."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        keys = gather_context(k_cache, block_tables[r], seq_len).float()
        values = gather_context(v_cache, block_tables[r], seq_len).float()
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)  # [Q, 1]
        key_pos = torch.arange(seq_len).unsqueeze(0)  # [1, S]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
        if sinks is not None:  # the sink as a last column, dropped after the softmax
            column = sinks.float()[:, None, None].expand(-1, query_len, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalise in float32, cast to the input dtype, then scale."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def rotary_ref(
    x: torch.Tensor,  # [T, num_heads, head_dim]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_position, head_dim // 2]
    sin: torch.Tensor,
) -> torch.Tensor:
    """Neox-style rotary embedding (rotate the two halves of the head), as Llama/Qwen use."""
    half = x.shape[-1] // 2
    cos = cos[positions.long()].float().unsqueeze(1)
    sin = sin[positions.long()].float().unsqueeze(1)
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def head_rms_norm_rotary_ref(
    x: torch.Tensor,  # [T, num_heads, head_dim]
    weight: torch.Tensor,  # [head_dim]
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm followed by rotary, the pair the fused kernel computes."""
    return rotary_ref(rms_norm_ref(x, weight, eps), positions, cos, sin)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation on the fused gate/up projection, as the torch model computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
    """Mixture of SwiGLU experts, one expert at a time: ``x [T, H]``, ``w13 [E, 2I, H]``
    (gate rows, then up rows), ``w2 [E, H, I]``, ``topk_weights``/``topk_ids [T, k]``.
    The math is float32, or float64 for float64 ``x`` (the exact side for a kernel that sums
    in float32 in its own order); the result is in ``x``'s dtype."""
    math = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=math, device=x.device)
    for expert in range(w13.shape[0]):
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token].to(math) @ w13[expert].to(math).T
        hidden = silu_and_mul_ref(gate_up)
        out.index_add_(0, token, (hidden @ w2[expert].to(math).T)
                       * topk_weights[token, slot].to(math).unsqueeze(1))
    return out.to(x.dtype)


def lora_shrink_expand_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                           max_rank: int, token_slots: torch.Tensor) -> torch.Tensor:
    """``out`` plus each adapter row's ``(x[t] @ A[slot].T) @ B[slot]``, a loop over rows in
    float32; ``a [slots * max_rank, K]``, ``b [slots * max_rank, N]``; slot -1: the base."""
    result = out.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            rows = slice(slot * max_rank, (slot + 1) * max_rank)
            result[t] += (x[t].float() @ a[rows].float().T) @ b[rows].float()
    return result
