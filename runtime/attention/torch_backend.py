"""Pure-torch paged attention: the reference backend, on CPU and GPU.

New K/V are written through ``slot_mapping`` with one ``index_copy_`` into the flattened
cache. Decode rows (one query token) are handled together: their blocks are gathered in
one indexing op and attended with batched matmuls, grouped by KV head (GQA without
repeating K/V). Prefill chunks go through ``scaled_dot_product_attention`` one request at a
time: causal on the fresh K/V when nothing is cached before them, otherwise over the
context read through the block table with a causal mask shifted by the cached prefix.
Only positions below ``seq_len`` are ever allowed to influence a result, so whatever sits
in unused cache memory (even NaN) cannot leak in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionMetadata

# decode rows are gathered in chunks of at most this many K (and V) elements
_DECODE_GATHER_ELEMENTS = 1 << 25


@dataclass
class _DecodeChunk:
    token_idx: torch.Tensor  # long [Bc]: rows of q/out
    block_tables: torch.Tensor  # long [Bc, nb]
    seq_lens: torch.Tensor  # long [Bc]
    num_blocks: int
    min_seq_len: int


@dataclass
class _Prefill:
    row: int
    start: int  # token range of the chunk in the flat batch
    end: int
    seq_len: int  # context after this step (cached prefix + chunk)


@dataclass
class TorchAttentionPlan:
    decode_chunks: list[_DecodeChunk]
    prefills: list[_Prefill]
    all_decode_in_order: bool  # every row is one token and rows are tokens: out is direct


class TorchAttentionBackend:
    name = "torch"

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        starts = meta.query_start_loc_cpu
        seq_lens = meta.seq_lens_cpu
        decode_rows = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        prefills = [_Prefill(i, starts[i], starts[i + 1], seq_lens[i])
                    for i in range(len(seq_lens)) if starts[i + 1] - starts[i] > 1]
        chunks: list[_DecodeChunk] = []
        if decode_rows:
            device = meta.block_tables.device
            rows = torch.tensor(decode_rows, dtype=torch.long)
            row_lens = [seq_lens[i] for i in decode_rows]
            max_len = max(row_lens)
            num_blocks = -(-max_len // meta.block_size)
            per_row = max(1, num_blocks * meta.block_size)
            # bounds the gathered copy; 256 = a typical KV heads x head_dim per token
            chunk_rows = max(1, _DECODE_GATHER_ELEMENTS // (per_row * 256))
            rows_dev = rows.to(device)
            tables = meta.block_tables.index_select(0, rows_dev)[:, :num_blocks].long()
            token_idx = torch.tensor([starts[i] for i in decode_rows], dtype=torch.long,
                                     device=device)
            lens = torch.tensor(row_lens, dtype=torch.long, device=device)
            for lo in range(0, len(decode_rows), chunk_rows):
                hi = min(lo + chunk_rows, len(decode_rows))
                nb = -(-max(row_lens[lo:hi]) // meta.block_size)
                chunks.append(_DecodeChunk(token_idx[lo:hi], tables[lo:hi, :nb], lens[lo:hi],
                                           nb, min(row_lens[lo:hi])))
        in_order = not prefills and len(decode_rows) == len(seq_lens)
        meta.extra = TorchAttentionPlan(chunks, prefills, in_order)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        plan = meta.extra
        if not isinstance(plan, TorchAttentionPlan):
            plan = self.build_metadata(meta).extra
            assert isinstance(plan, TorchAttentionPlan)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        if plan.all_decode_in_order and len(plan.decode_chunks) == 1:
            return _decode(q, k_cache, v_cache, plan.decode_chunks[0], scale, sliding_window)
        out = torch.empty_like(q)
        for chunk in plan.decode_chunks:
            q_rows = q.index_select(0, chunk.token_idx)
            out.index_copy_(0, chunk.token_idx,
                            _decode(q_rows, k_cache, v_cache, chunk, scale, sliding_window))
        block_tables = meta.block_tables
        for p in plan.prefills:
            out[p.start:p.end] = _prefill(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end],
                                          k_cache, v_cache, block_tables, meta.block_size, p,
                                          scale, sliding_window)
        return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: _DecodeChunk,
            scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [B, Hq, D], one query per row at position seq_len - 1 -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    span = chunk.num_blocks * k_cache.shape[1]
    # [B, nb, bs, Hk, D] -> [B, Hk, S, D]; one gather per tensor for the whole chunk
    keys = k_cache[chunk.block_tables].view(batch, span, num_kv_heads, head_dim)
    values = v_cache[chunk.block_tables].view(batch, span, num_kv_heads, head_dim)
    positions = torch.arange(span, device=q.device)
    invalid = positions[None, :] >= chunk.seq_lens[:, None]  # [B, S]
    if sliding_window is not None:
        invalid |= positions[None, :] <= (chunk.seq_lens[:, None] - 1 - sliding_window)
    if span > chunk.min_seq_len or sliding_window is not None:
        # zero what lies outside the context: a masked score must not become NaN * 0
        keys.masked_fill_(invalid[:, :, None, None], 0.0)
        values.masked_fill_(invalid[:, :, None, None], 0.0)
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [B, Hk, G, S]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hk, G, D]
    return out.reshape(batch, num_heads, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, p: _Prefill,
             scale: float, sliding_window: int | None) -> torch.Tensor:
    query_len = p.end - p.start
    prefix = p.seq_len - query_len
    if prefix == 0:
        keys, values = k, v
    else:
        nb = -(-p.seq_len // block_size)
        blocks = block_tables[p.row, :nb].long()
        keys = k_cache[blocks].flatten(0, 1)[: p.seq_len]
        values = v_cache[blocks].flatten(0, 1)[: p.seq_len]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    kh = keys.transpose(0, 1).unsqueeze(0)  # [1, Hk, S, D]
    vh = values.transpose(0, 1).unsqueeze(0)
    gqa = qh.shape[1] != kh.shape[1]
    if prefix == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
    else:
        q_pos = torch.arange(prefix, p.seq_len, device=q.device)[:, None]
        k_pos = torch.arange(p.seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale,
                                             enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)

