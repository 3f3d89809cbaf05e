"""Pure-torch paged attention: the reference backend, on CPU and GPU.

New K/V are written through ``slot_mapping`` with one ``index_copy_`` into the flattened
cache. Decode rows (one query token each) are attended together: sorted by context length
and cut into a few chunks; a chunk's context is gathered with one ``index_select`` per K and
V, straight into a ``[rows, kv_heads, positions, head_dim]`` layout in a reused workspace
(no page faults from fresh large buffers, no layout copy), then attended with one batched
matmul per side for all heads (GQA without repeating K/V). Few, large ops: on a shared
2-core machine every op pays a scheduling cost, so the op count per layer stays constant.
Prefill chunks go through ``scaled_dot_product_attention`` one request at a time: causal on
the fresh K/V when nothing is cached before them, otherwise over the context read through
the block table with a causal mask shifted by the cached prefix. SDPA has neither softcaps
(Gemma 2) nor attention sinks (gpt-oss): with either, the scores are written out.

Positions at or past ``seq_len`` never influence a result: their scores are masked and
the gather reads the row's first slot in their place, so whatever sits in unused cache
memory (even NaN) is never read.

A float8 cache (``--kv-cache-dtype fp8``): rows are quantized on write, gathered as bytes and
widened to the model's dtype; the K scale joins the softmax scale and the V scale multiplies
the output. Prefill chunks attend over K/V as the cache holds them (rounded through float8),
as a kernel reading the cache would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.attention.kv_cache_dtype import is_fp8, round_trip, unit_scales, write_fp8_kv

PlanT = TypeVar("PlanT")

# a decode chunk gathers at most this many context tokens (rows x padded length)
_DECODE_CHUNK_TOKENS = 1 << 16


@dataclass
class _DecodeChunk:
    token_idx: torch.Tensor  # long [Bc]: rows of q/out
    slots: torch.Tensor  # long [Bc, S]: cache slot per context position; past a row's end,
    #                      the row's first slot (always written), so nothing unused is read
    seq_lens: torch.Tensor  # long [Bc]
    prepared: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    def prepare(self, num_kv_heads: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather index into the cache viewed as [slots * kv_heads, head_dim], ordered
        [Bc, kv_heads, S], and the score mask [Bc, 1, 1, S]; built by the first layer."""
        key = (num_kv_heads, window)
        if key not in self.prepared:
            positions = torch.arange(self.slots.shape[1], device=self.slots.device)
            invalid = positions[None, :] >= self.seq_lens[:, None]
            slots = self.slots
            if window is not None:
                invalid |= positions[None, :] <= self.seq_lens[:, None] - 1 - window
                # positions outside the window (or past the end) read the window's first slot
                # instead, masked anyway: a windowed layer never touches a block outside it
                first = torch.clamp(self.seq_lens - window, min=0)
                slots = torch.where(invalid, slots.gather(1, first[:, None]), slots)
            heads = torch.arange(num_kv_heads, device=slots.device)
            index = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
            self.prepared[key] = (index, invalid[:, None, None, :])
        return self.prepared[key]


@dataclass
class PrefillSpan:
    row: int
    start: int  # token range of the chunk in the flat batch
    end: int
    seq_len: int  # context after this step (cached prefix + chunk)


@dataclass
class TorchAttentionPlan:
    decode_chunks: list[_DecodeChunk]
    prefills: list[PrefillSpan]
    all_decode: bool  # every row is a single decode token


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        num_reqs = len(seq_lens)
        decode_rows = [i for i in range(num_reqs) if starts[i + 1] - starts[i] == 1]
        prefills = prefill_spans(meta)
        chunks = _decode_chunks(meta, sorted(decode_rows, key=lambda i: -seq_lens[i]))
        meta.extra = TorchAttentionPlan(chunks, prefills, len(decode_rows) == num_reqs)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        plan = step_plan(self, meta, TorchAttentionPlan)
        fp8 = is_fp8(k_cache.dtype)
        if not fp8:
            kv_scales = None  # the cache holds the model's dtype: nothing to scale
        elif kv_scales is None:
            kv_scales = unit_scales(k_cache.device)
        write_kv(k, v, k_cache, v_cache, meta, kv_scales)
        out = torch.empty_like(q)
        for chunk in plan.decode_chunks:
            result = self._decode(q.index_select(0, chunk.token_idx), k_cache, v_cache, chunk,
                                  scale, sliding_window, softcap, sinks, kv_scales)
            out.index_copy_(0, chunk.token_idx, result)
        if plan.prefills and fp8:  # attend over what the cache holds
            assert kv_scales is not None
            k = round_trip(k, kv_scales[0], k_cache.dtype)
            v = round_trip(v, kv_scales[1], v_cache.dtype)
        attend_prefills(out, q, k, v, k_cache, v_cache, meta, plan.prefills, scale,
                        sliding_window, softcap, sinks, kv_scales)
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
                chunk: _DecodeChunk, scale: float, sliding_window: int | None,
                softcap: float | None = None,
                sinks: torch.Tensor | None = None,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D], one query per row at position seq_len - 1 -> [B, Hq, D]."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        index, invalid = chunk.prepare(num_kv_heads, sliding_window)
        span = chunk.slots.shape[1]
        k_buf, v_buf = self._buffers(index.numel() * head_dim, k_cache)
        torch.index_select(k_cache.view(-1, head_dim), 0, index, out=k_buf.view(-1, head_dim))
        torch.index_select(v_cache.view(-1, head_dim), 0, index, out=v_buf.view(-1, head_dim))
        keys = k_buf.view(batch, num_kv_heads, span, head_dim)
        values = v_buf.view(batch, num_kv_heads, span, head_dim)
        if kv_scales is not None:  # float8 rows widened; the K scale joins the softmax's
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            scale = kv_scales[0] * scale  # type: ignore[assignment]
        qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)  # [B, Hk, G, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        scores.masked_fill_(invalid, float("-inf"))
        group_sinks = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
        probs = softmax_with_sinks(scores, group_sinks).to(q.dtype)
        out = torch.matmul(probs, values).view(batch, num_heads, head_dim)
        return out if kv_scales is None else out.mul_(kv_scales[1].to(out.dtype))


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the last dim; with ``sinks`` (broadcast to ``scores`` but for a
    last dim of 1), each sink's exp joins its row's denominator and takes no value: the row
    sums to less than 1 (gpt-oss). A row whose scores are all masked then attends to nothing."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    scores, sinks = scores.float(), sinks.float()
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    weights = torch.exp(scores - peak)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sinks - peak))


def step_plan(backend: AttentionBackend, meta: AttentionMetadata, kind: type[PlanT]) -> PlanT:
    """The backend's plan for this step: built once per step by the model runner (shared by
    every layer), or here for a caller that skipped ``build_metadata``."""
    plan = meta.extra if isinstance(meta.extra, kind) else backend.build_metadata(meta).extra
    assert isinstance(plan, kind)
    return plan


def attend_prefills(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    spans: list[PrefillSpan], scale: float, sliding_window: int | None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    kv_scales: torch.Tensor | None = None) -> None:
    """Each prefill chunk's attention into its rows of ``out`` (a float8 cache: ``k``/``v``
    already rounded as the cache holds them, ``kv_scales`` its scales)."""
    for p in spans:
        out[p.start:p.end] = prefill_attention(q, k, v, k_cache, v_cache, meta, p, scale,
                                               sliding_window, softcap, sinks, kv_scales)


def prefill_spans(meta: AttentionMetadata) -> list[PrefillSpan]:
    """The requests with more than one query token this step."""
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    return [PrefillSpan(i, starts[i], starts[i + 1], seq_lens[i])
            for i in range(len(seq_lens)) if starts[i + 1] - starts[i] > 1]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, kv_scales: torch.Tensor | None = None) -> None:
    """This step's new K/V into their cache slots (quantized with ``kv_scales`` into a
    float8 cache)."""
    if is_fp8(k_cache.dtype):
        write_fp8_kv(k, v, k_cache, v_cache, meta.slot_mapping,
                     unit_scales(k.device) if kv_scales is None else kv_scales)
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)


def _decode_chunks(meta: AttentionMetadata, rows: list[int]) -> list[_DecodeChunk]:
    """Rows sorted longest first, cut so a chunk's padded context stays bounded."""
    if not rows:
        return []
    device = meta.block_tables.device
    bs = meta.block_size
    seq_lens = meta.seq_lens_cpu
    chunks: list[_DecodeChunk] = []
    offsets = torch.arange(bs, device=device)
    lo = 0
    while lo < len(rows):
        nb = -(-seq_lens[rows[lo]] // bs)  # the longest row of the chunk comes first
        span = nb * bs
        hi = lo + 1
        # bounded size, and rows at least half as long as the first: padding stays below 2x
        while (hi < len(rows) and (hi - lo + 1) * span <= _DECODE_CHUNK_TOKENS
               and 2 * seq_lens[rows[hi]] >= seq_lens[rows[lo]]):
            hi += 1
        chunk_rows = rows[lo:hi]
        lens = torch.tensor([seq_lens[i] for i in chunk_rows], dtype=torch.long).to(device)
        row_index = torch.tensor(chunk_rows, dtype=torch.long).to(device)
        tables = meta.block_tables.index_select(0, row_index)[:, :nb].long()
        slots = (tables[:, :, None] * bs + offsets).reshape(len(chunk_rows), span)
        in_context = torch.arange(span, device=device)[None, :] < lens[:, None]
        chunks.append(_DecodeChunk(
            token_idx=torch.tensor([meta.query_start_loc_cpu[i] for i in chunk_rows],
                                   dtype=torch.long).to(device),
            slots=torch.where(in_context, slots, slots[:, :1]), seq_lens=lens))
        lo = hi
    return chunks


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, p: PrefillSpan,
                      scale: float, sliding_window: int | None,
                      softcap: float | None = None,
                      sinks: torch.Tensor | None = None,
                      kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One request's chunk of queries (rows ``p.start:p.end`` of the flat q/k/v) attending
    causally over its cached prefix and itself; with a window, over only the keys of the
    blocks the window reaches."""
    q, k, v = q[p.start:p.end], k[p.start:p.end], v[p.start:p.end]
    block_tables, block_size = meta.block_tables, meta.block_size
    query_len = p.end - p.start
    prefix = p.seq_len - query_len
    key_start = 0  # the first key position any query of the chunk may see
    if sliding_window is not None:
        key_start = max(0, prefix - sliding_window + 1) // block_size * block_size
    if prefix == 0:
        keys, values = k, v
    else:
        nb = -(-p.seq_len // block_size)
        blocks = block_tables[p.row, key_start // block_size:nb].long()
        keys = k_cache[blocks].flatten(0, 1)[: p.seq_len - key_start]
        values = v_cache[blocks].flatten(0, 1)[: p.seq_len - key_start]
        if is_fp8(k_cache.dtype):
            scales = unit_scales(q.device) if kv_scales is None else kv_scales
            keys = (keys.float() * scales[0]).to(q.dtype)
            values = (values.float() * scales[1]).to(q.dtype)
    if prefix == 0:
        key_start = 0
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    kh = keys.transpose(0, 1).unsqueeze(0)  # [1, Hk, S, D]
    vh = values.transpose(0, 1).unsqueeze(0)
    gqa = qh.shape[1] != kh.shape[1]
    explicit = softcap is not None or sinks is not None  # SDPA has neither
    if prefix == 0 and sliding_window is None and not explicit:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)
    q_pos = torch.arange(prefix, p.seq_len, device=q.device)[:, None]
    k_pos = torch.arange(key_start, p.seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    if not explicit:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale,
                                             enable_gqa=gqa)
    else:  # the scores written out, capped, masked, softmaxed (with the sinks)
        group = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, -1, 1, 1))
        out = torch.matmul(probs.to(q.dtype), vh)
    return out.squeeze(0).transpose(0, 1)
