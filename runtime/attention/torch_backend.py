"""Pure-torch paged attention: the reference backend, on CPU and GPU.

New K/V are written through ``slot_mapping`` with one ``index_copy_`` into the flattened
cache. Decode rows (one query token each) are attended together: sorted by context length
and cut into chunks, each chunk's blocks are gathered whole (one ``index_select`` per K and
V into a reused workspace, so no page faults from fresh large buffers) and attended with
batched matmuls per KV head on strided views (GQA without repeating K/V, no layout copy).
Prefill chunks go through ``scaled_dot_product_attention`` one request at a time: causal on
the fresh K/V when nothing is cached before them, otherwise over the context read through
the block table with a causal mask shifted by the cached prefix.

Positions at or past ``seq_len`` never influence a result: their scores are masked and
their gathered values zeroed, so whatever sits in unused cache memory (even NaN) stays out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionMetadata

# a decode chunk gathers at most this many context tokens (rows x padded length)
_DECODE_CHUNK_TOKENS = 1 << 15


@dataclass
class _DecodeChunk:
    token_idx: torch.Tensor  # long [Bc]: rows of q/out
    block_ids: torch.Tensor  # long [Bc * nb]: the rows' block tables, flattened
    seq_lens: torch.Tensor  # long [Bc]
    num_blocks: int  # nb: blocks per row after padding to the longest row
    pad_index: torch.Tensor | None  # long: flat [Bc * S] positions past a row's end
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [Bc,1,S]

    def mask(self, span: int, window: int | None) -> torch.Tensor:
        """True where a score must be dropped; built by the first layer, reused by the rest."""
        if window not in self.masks:
            positions = torch.arange(span, device=self.seq_lens.device)
            invalid = positions[None, :] >= self.seq_lens[:, None]
            if window is not None:
                invalid |= positions[None, :] <= self.seq_lens[:, None] - 1 - window
            self.masks[window] = invalid[:, None, :]
        return self.masks[window]


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
    all_decode: bool  # every row is a single decode token


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        num_reqs = len(seq_lens)
        decode_rows = [i for i in range(num_reqs) if starts[i + 1] - starts[i] == 1]
        prefills = [_Prefill(i, starts[i], starts[i + 1], seq_lens[i])
                    for i in range(num_reqs) if starts[i + 1] - starts[i] > 1]
        chunks = _decode_chunks(meta, sorted(decode_rows, key=lambda i: -seq_lens[i]))
        meta.extra = TorchAttentionPlan(chunks, prefills, len(decode_rows) == num_reqs)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        plan = meta.extra
        if not isinstance(plan, TorchAttentionPlan):
            plan = self.build_metadata(meta).extra
            assert isinstance(plan, TorchAttentionPlan)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        for chunk in plan.decode_chunks:
            result = self._decode(q.index_select(0, chunk.token_idx), k_cache, v_cache, chunk,
                                  scale, sliding_window)
            out.index_copy_(0, chunk.token_idx, result)
        for p in plan.prefills:
            out[p.start:p.end] = _prefill(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end],
                                          k_cache, v_cache, meta.block_tables, meta.block_size,
                                          p, scale, sliding_window)
        return out

    def _buffers(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reused gather buffers of ``numel`` elements (grown, never shrunk)."""
        key = (like.dtype, like.device)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < 2 * numel:
            buf = torch.empty(2 * numel, dtype=like.dtype, device=like.device)
            self._workspace[key] = buf
        return buf[:numel], buf[numel:2 * numel]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                chunk: _DecodeChunk, scale: float, sliding_window: int | None) -> torch.Tensor:
        """q [B, Hq, D], one query per row at position seq_len - 1 -> [B, Hq, D]."""
        batch, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        span = chunk.num_blocks * block_size
        block_numel = block_size * num_kv_heads * head_dim
        k_buf, v_buf = self._buffers(batch * chunk.num_blocks * block_numel, q)
        k_rows = k_buf.view(-1, block_numel)
        v_rows = v_buf.view(-1, block_numel)
        torch.index_select(k_cache.view(num_blocks, block_numel), 0, chunk.block_ids, out=k_rows)
        torch.index_select(v_cache.view(num_blocks, block_numel), 0, chunk.block_ids, out=v_rows)
        if chunk.pad_index is not None:  # unused memory must not reach probs @ V as NaN * 0
            v_buf.view(batch * span, -1).index_fill_(0, chunk.pad_index, 0.0)
        keys = k_buf.view(batch, span, num_kv_heads, head_dim)
        values = v_buf.view(batch, span, num_kv_heads, head_dim)
        invalid = chunk.mask(span, sliding_window)
        group = num_heads // num_kv_heads
        qg = q.view(batch, num_kv_heads, group, head_dim)
        out = torch.empty_like(qg)
        for h in range(num_kv_heads):
            # strided per-head views: batched GEMMs read them in place, no layout copy
            scores = torch.bmm(qg[:, h], keys[:, :, h].transpose(1, 2)).mul_(scale)
            scores.masked_fill_(invalid, float("-inf"))  # [B, G, S]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[:, h] = torch.bmm(probs, values[:, :, h])
        return out.view(batch, num_heads, head_dim)


def _decode_chunks(meta: AttentionMetadata, rows: list[int]) -> list[_DecodeChunk]:
    """Rows sorted longest first, cut so a chunk's padded context stays bounded."""
    if not rows:
        return []
    device = meta.block_tables.device
    bs = meta.block_size
    seq_lens = meta.seq_lens_cpu
    chunks: list[_DecodeChunk] = []
    lo = 0
    while lo < len(rows):
        nb = -(-seq_lens[rows[lo]] // bs)  # the longest row of the chunk comes first
        span = nb * bs
        hi = lo + 1
        # bounded size, and rows at least 3/4 as long as the first so padding stays small
        while (hi < len(rows) and (hi - lo + 1) * span <= _DECODE_CHUNK_TOKENS
               and 4 * seq_lens[rows[hi]] >= 3 * seq_lens[rows[lo]]):
            hi += 1
        chunk_rows = rows[lo:hi]
        lens = torch.tensor([seq_lens[i] for i in chunk_rows], dtype=torch.long)
        pads = (torch.arange(span)[None, :] >= lens[:, None]).view(-1).nonzero().view(-1)
        row_index = torch.tensor(chunk_rows, dtype=torch.long).to(device)
        tables = meta.block_tables.index_select(0, row_index)[:, :nb]
        chunks.append(_DecodeChunk(
            token_idx=torch.tensor([meta.query_start_loc_cpu[i] for i in chunk_rows],
                                   dtype=torch.long).to(device),
            block_ids=tables.reshape(-1).long(),
            seq_lens=lens.to(device),
            num_blocks=nb,
            pad_index=pads.to(device) if pads.numel() else None))
        lo = hi
    return chunks


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

