"""Multi-head latent attention over the paged latent cache, in plain torch.

What a layer caches per token is DeepSeek's compressed KV, not keys and values: the
normalised latent ``c`` (``kv_lora_rank``) in the layer's first cache tensor and the rotated
shared key ``k_pe`` (``qk_rope_head_dim``) in its second, both ``[blocks, block_size, 1,
width]`` and written through ``slot_mapping`` like K/V. Each head's key is ``[W_UK_h c ;
k_pe]`` and its value ``W_UV_h c``, where ``W_UK``/``W_UV`` are the rows of ``kv_b_proj``
(``[heads, nope + v, kv_lora_rank]``).

Prefill chunks expand: the context's latents (this chunk's own, or the cached prefix's read
through the block table, plus this chunk) go through ``kv_b_proj`` once, then ordinary
causal attention over full keys and values; a prompt is many queries per latent, so the
expansion is paid once for all of them.

Decode rows absorb the up-projections instead (one query per row reading a long context):
``q_h . k_s = (W_UK_h^T q_nope_h) . c_s + q_pe_h . k_pe_s`` and ``sum_s p_s W_UV_h c_s =
W_UV_h (sum_s p_s c_s)``, so the scores and the weighted sum run on the latents themselves
(one shared "head" for all query heads: multi-query attention of width ``kv_lora_rank``)
and nothing per head is expanded for the context. Rows are grouped as the torch backend
groups them (``TorchAttentionPlan``: sorted by length, chunked, positions past a row's end
reading its first slot and masked), so a step's plan is built once for every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.attention.torch_backend import (
    PrefillSpan,
    TorchAttentionPlan,
    _DecodeChunk,
    step_plan,
)


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                 rope_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """This step's latents ``[T, kv_lora_rank]`` and rotated keys ``[T, rope]`` into their
    slots."""
    latent_cache.view(-1, latent_cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent)
    rope_cache.view(-1, rope_cache.shape[-1]).index_copy_(0, meta.slot_mapping, k_pe)


def mla_attention(backend: AttentionBackend, q_nope: torch.Tensor, q_pe: torch.Tensor,
                  latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                  rope_cache: torch.Tensor, meta: AttentionMetadata, kv_b: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """``q_nope [T, H, nope]``, ``q_pe [T, H, rope]`` (rotated), ``latent [T, L]``
    (normalised), ``k_pe [T, rope]`` (rotated); ``kv_b [H, nope + v, L]`` this rank's heads
    of ``kv_b_proj``. Writes the step's latents and returns ``[T, H, v]``."""
    plan = step_plan(backend, meta, TorchAttentionPlan)
    write_latent(latent, k_pe, latent_cache, rope_cache, meta)
    nope = q_nope.shape[-1]
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for chunk in plan.decode_chunks:
        rows = chunk.token_idx
        result = _decode_absorbed(q_nope.index_select(0, rows), q_pe.index_select(0, rows),
                                  latent_cache, rope_cache, chunk, w_uk, w_uv, scale)
        out.index_copy_(0, rows, result)
    for span in plan.prefills:
        out[span.start:span.end] = _prefill_expanded(q_nope, q_pe, latent, k_pe, latent_cache,
                                                     rope_cache, meta, span, kv_b, scale)
    return out


def _decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                     rope_cache: torch.Tensor, chunk: _DecodeChunk, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row at position ``seq_len - 1``: ``[B, H, *] -> [B, H, v]``."""
    batch = q_nope.shape[0]
    index, invalid = chunk.prepare(1, None)  # one cached "head": the latent
    span = chunk.slots.shape[1]
    latents = latent_cache.view(-1, latent_cache.shape[-1]).index_select(0, index)
    keys_pe = rope_cache.view(-1, rope_cache.shape[-1]).index_select(0, index)
    latents = latents.view(batch, span, -1)  # [B, S, L]
    keys_pe = keys_pe.view(batch, span, -1)  # [B, S, rope]
    # W_UK absorbed into the query, per head: [H, B, nope] @ [H, nope, L] -> [B, H, L]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    scores = torch.baddbmm(torch.bmm(q_pe, keys_pe.transpose(1, 2)), q_latent,
                           latents.transpose(1, 2)).mul_(scale)  # [B, H, S]
    scores.masked_fill_(invalid.view(batch, 1, span), float("-inf"))
    # at least float32 (a bfloat16 model's scores), as the torch backend's softmax
    wide = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=wide).to(latents.dtype)
    out_latent = torch.bmm(probs, latents)  # [B, H, L]
    # W_UV applied after the sum, per head: [H, B, L] @ [H, L, v] -> [B, H, v]
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _prefill_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                      k_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                      meta: AttentionMetadata, p: PrefillSpan, kv_b: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One request's chunk of queries over its cached prefix and itself, keys and values
    expanded from the latents: ``[L_q, H, v]``."""
    query_len = p.end - p.start
    prefix = p.seq_len - query_len
    if prefix == 0:
        c, kr = latent[p.start:p.end], k_pe[p.start:p.end]
    else:  # the whole context from the cache (this chunk's rows were written above)
        blocks = meta.block_tables[p.row, :-(-p.seq_len // meta.block_size)].long()
        c = latent_cache[blocks].flatten(0, 2)[:p.seq_len]
        kr = rope_cache[blocks].flatten(0, 2)[:p.seq_len]
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    kv = F.linear(c, kv_b.reshape(-1, kv_b.shape[-1])).view(c.shape[0], heads, -1)
    keys = torch.cat((kv[..., :nope], kr[:, None, :].expand(-1, heads, -1)), dim=-1)
    values = kv[..., nope:]
    queries = torch.cat((q_nope[p.start:p.end], q_pe[p.start:p.end]), dim=-1)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (queries, keys, values))
    if prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(prefix, p.seq_len, device=q_nope.device)[:, None]
        k_pos = torch.arange(p.seq_len, device=q_nope.device)[None, :]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=k_pos <= q_pos, scale=scale)
    return out.squeeze(0).transpose(0, 1)
