"""Paged attention over a flat mixed batch, in one launch.

The batch is varlen: request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]``
(a prefill chunk, possibly after a cached prefix, or one decode token) and attends over
``seq_lens[r]`` cached tokens read through its block table. The new K/V must already be in
the cache (``reshape_and_cache`` runs first), so a prefix hit, a chunk continuation and a
decode are the same computation: the query at position ``p`` sees keys ``<= p``.

Grid: (request, query tile, kv head). A program loads the query tile's rows for every
query head that shares its kv head (GQA), so each K/V page is read once for the group,
then walks the keys causally reachable from the tile in tiles of ``TILE_N`` tokens
(several pages when pages are small: each token's page is looked up in the block table)
with an online softmax (flash attention's running max and sum). Programs whose tile lies past the request's query length
exit at once; a pure-decode batch launches ``num_reqs * num_kv_heads`` programs.

Gemma 2's logit softcap (``cap * tanh(s / cap)``, before the mask) and gpt-oss's attention
sinks (a per-head logit in every softmax's denominator: the running max and sum start at the
sink instead of at nothing, in the first split only) are runtime values, so they add no
compiled variants; tanh is written with exp2 (``1 - 2 / (e^2x + 1)``) to stay on stable calls.

Uses only long-stable ``tl.*`` calls (load/store/dot/exp2/where/max/sum), so the same
source runs on triton 3.6 (GPU machine) and 3.9 (interpreter here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.kernels.launch import check_launchable

LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_ptr,  # SPLIT: fp32 [splits, T, H, head_dim], each split's unnormalised output
    max_ptr,  # SPLIT: fp32 [splits, T, H], each split's running max (base 2)
    sum_ptr,  # SPLIT: fp32 [splits, T, H], each split's softmax denominator
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    sliding_window,  # keys a query sees, itself included (a huge value when unlimited)
    softcap_log2,  # the logit softcap times log2(e); 0: no softcap
    sinks_ptr,  # fp32 [num_heads]: attention sinks, read when has_sinks
    has_sinks,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    group,  # query heads per kv head
    group_pad,  # group rounded up to a power of two
    block_q,  # query tokens per program: ROWS // group_pad
    num_splits,  # programs sharing one query tile's keys (flash-decoding); 1 = no split
    min_split_tiles,  # a split walks at least this many key tiles: short contexts use fewer
    stride_ps,
    stride_pt,
    stride_ms,
    stride_mt,
    ROWS: tl.constexpr,  # rows of the tile: block_q tokens x group_pad heads
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,  # cache block size
    TILE_N: tl.constexpr,  # keys per loop iteration (power of two, >= 16 for tl.dot on GPU)
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # the interpreter's tl.dot mis-multiplies bfloat16 operands
    SPLIT: tl.constexpr,  # write partials for _combine_splits_kernel instead of the output
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * block_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens cached before this step's first query

    # row m of the tile = (query token m // group_pad, head m % group_pad of this kv group);
    # only the tile's shape is compiled in, so every GQA group shares one kernel
    rows = tl.arange(0, ROWS)
    q_idx = q_tile * block_q + rows // group_pad
    head_in_group = rows % group_pad
    head = kv_head * group + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < group)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    token = (q_start + q_idx).to(tl.int64)
    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx

    # keys this tile can see: up to its last query, back to the window of its first
    last_q = tl.minimum(q_len, (q_tile + 1) * block_q) - 1
    kv_end = context_len + last_q + 1
    kv_start = tl.maximum(context_len + q_tile * block_q - sliding_window + 1, 0)
    tile_start = kv_start // TILE_N
    tile_end = (kv_end + TILE_N - 1) // TILE_N
    if SPLIT:  # this program's share of the key tiles; a split past the end walks none
        per_split = tl.maximum(tl.cdiv(tile_end - tile_start, num_splits), min_split_tiles)
        tile_start = tile_start + split * per_split
        tile_end = tl.minimum(tile_end, tile_start + per_split)

    # finite start for the running max: a tile with every key masked gives p = 0, not NaN;
    # with sinks, the sink is the first logit seen (once: in split 0)
    # (scalars widened to the rows: the interpreter takes no scalar in a mask)
    sink_row = row_valid & ((rows * 0 + split) == 0) & ((rows * 0 + has_sinks) != 0)
    m_i = tl.load(sinks_ptr + head, mask=sink_row, other=-1.0e30).to(tl.float32)
    m_i = tl.where(sink_row, m_i * 1.4426950408889634, -1.0e30)
    l_i = tl.where(sink_row, 1.0, 0.0)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    head_base = kv_head.to(tl.int64) * stride_ch

    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        k_pos = tile * TILE_N + offs_n
        # keys of the first tile before the window are not loaded: a windowed layer never
        # reads a block outside its window
        k_valid = (k_pos < kv_end) & (k_pos >= kv_start)
        page = tl.load(table_row + k_pos // PAGE, mask=k_valid, other=0).to(tl.int64)
        token_base = page * stride_cb + (k_pos % PAGE) * stride_cs + head_base  # [TILE_N]
        k = tl.load(
            k_cache_ptr + token_base[None, :] + dims[:, None],
            mask=dim_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_D, TILE_N]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if softcap_log2 > 0.0:  # cap * tanh(s / cap), in base 2 like the scores
            doubled = tl.exp2(scores * (2.0 / softcap_log2) * 1.4426950408889634)
            scores = softcap_log2 * (1.0 - 2.0 / (doubled + 1.0))
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + token_base[:, None] + dims[None, :],
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [TILE_N, BLOCK_D]
        if DOT_IN_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        stat_offsets = split * stride_ms + token * stride_mt + head
        tl.store(max_ptr + stat_offsets, m_i, mask=row_valid)
        tl.store(sum_ptr + stat_offsets, l_i, mask=row_valid)
        p_offsets = split * stride_ps + token[:, None] * stride_pt + head[:, None] * HEAD_DIM \
            + dims[None, :]
        tl.store(partial_ptr + p_offsets, acc, mask=q_mask)
    else:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_i[:, None]
        o_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_splits_kernel(
    partial_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ms,
    stride_mt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """Flash-decoding's reduction, one program per (token, head): rescale every split's
    partial output to the common max and divide by the rescaled sum of denominators."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, MAX_SPLITS)
    split_valid = splits < num_splits
    stat_offsets = splits * stride_ms + token * stride_mt + head
    m = tl.load(max_ptr + stat_offsets, mask=split_valid, other=-1.0e30)
    l_s = tl.load(sum_ptr + stat_offsets, mask=split_valid, other=0.0)
    weight = tl.where(l_s > 0.0, tl.exp2(m - tl.max(m, 0)), 0.0)  # an empty split counts 0
    total = tl.sum(l_s * weight, 0)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    partial = tl.load(partial_ptr + splits[:, None] * stride_ps + token * stride_pt
                      + head * HEAD_DIM + dims[None, :],
                      mask=split_valid[:, None] & dim_valid[None, :], other=0.0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_valid)


NO_WINDOW = 1 << 30  # the window of a model without one: longer than any context


@dataclass(frozen=True)
class AttentionTile:
    """The launcher's choice for a batch: the compiled tile (``constexprs``) and the runtime
    values that fit the batch's GQA group into it."""

    group: int  # query heads per kv head
    group_pad: int  # padded to a power of two
    rows: int  # query rows per program: block_q tokens x group_pad heads
    block_d: int
    tile_n: int  # keys per loop iteration
    num_warps: int = 4

    @property
    def block_q(self) -> int:  # query tokens per program
        return self.rows // self.group_pad

    def constexprs(self, head_dim: int, block_size: int, dtype: torch.dtype,
                   device_type: str) -> dict:
        return dict(
            ROWS=self.rows,
            HEAD_DIM=head_dim,
            BLOCK_D=self.block_d,
            PAGE=block_size,
            TILE_N=self.tile_n,
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
            DOT_IN_FP32=device_type == "cpu" and dtype == torch.bfloat16,
        )


def choose_tile(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype,
                device_type: str, key_tile: int | None = None) -> AttentionTile:
    """Rows per program: 16 (tl.dot's minimum on GPU) for decode, 64 for prefill tiles.
    Keys per iteration: 64 on GPU for 16-bit K/V, where wider tiles keep more bytes in flight;
    float32 tiles (no tensor cores: the product lives in registers) take 32, or 16 for 256-wide
    heads, and run on 8 warps, as does a 16-bit prefill tile of 256-wide heads: each the widest
    that compiles for sm_90a with at most ~100 bytes spilled (make gpu-check).
    Under the interpreter: 16."""
    group_pad = triton.next_power_of_2(group)
    rows = max(16 if max_query_len * group_pad <= 16 else 64, group_pad)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    wide = dtype == torch.float32 or block_d >= 256
    if key_tile is None:
        if device_type != "cuda":
            key_tile = 16
        elif dtype != torch.float32:
            key_tile = 64
        else:
            key_tile = 16 if block_d >= 256 else 32
    if key_tile < 16 or key_tile & (key_tile - 1):
        raise ValueError(f"key_tile must be a power of two >= 16, got {key_tile}")
    return AttentionTile(group=group, group_pad=group_pad, rows=rows, block_d=block_d,
                         tile_n=key_tile,
                         num_warps=8 if dtype == torch.float32 or (rows >= 64 and wide) else 4)


MAX_SPLITS = 16
MIN_SPLIT_KEYS = 256  # keys a split walks at least: below that the reduction costs more
SPLIT_TARGET_WAVES = 2  # aim for this many programs per SM in a decode launch


def choose_splits(max_query_len: int, num_reqs: int, num_kv_heads: int, sm_count: int) -> int:
    """Flash-decoding: a decode batch of ``num_reqs * num_kv_heads`` programs leaves most of
    a GPU idle at small batch (1 x 8 on 132 SMs), so each program's keys are split over more
    programs and their partial softmaxes combined by a second kernel. Chosen from the batch
    shape alone (never the context lengths, which are on the device), so a captured CUDA graph
    stays valid for any context; splits with fewer than MIN_SPLIT_KEYS keys to walk get none,
    so short contexts use few of them."""
    if max_query_len != 1 or sm_count <= 0:
        return 1
    programs = num_reqs * num_kv_heads
    return max(1, min(MAX_SPLITS, SPLIT_TARGET_WAVES * sm_count // max(programs, 1)))


def combine_constexprs(head_dim: int) -> dict:
    return dict(HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
                MAX_SPLITS=MAX_SPLITS)


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (no splitting)."""
    if device.type != "cuda":
        return 0
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [B+1]
    seq_lens: torch.Tensor,  # int32 [B]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    key_tile: int | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every request's query rows over its paged context; see module doc.

    ``key_tile``: keys per loop iteration, a power of two >= 16 (default: ``choose_tile``'s).
    ``num_splits``: programs per query tile splitting its keys, 1..MAX_SPLITS, decode only
    (default: ``choose_splits``'s). ``softcap``: scores become ``softcap * tanh(s / softcap)``.
    ``sinks``: float32 ``[num_heads]``, one logit per query head joining its softmax's
    denominator (gpt-oss).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not fit queries {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be float32 [{num_heads}], got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_tables.shape[0] != num_reqs:
        raise ValueError("query_start_loc must be [B+1] and block_tables [B, max_blocks]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides and be contiguous in head_dim")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_reqs == 0:
        return out
    check_launchable(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    group = num_heads // num_kv_heads
    tile = choose_tile(max_query_len, group, head_dim, q.dtype, q.device.type, key_tile)
    if num_splits is None:
        num_splits = choose_splits(max_query_len, num_reqs, num_kv_heads, _sm_count(q.device))
    if not 1 <= num_splits <= MAX_SPLITS or (num_splits > 1 and max_query_len != 1):
        raise ValueError(f"num_splits must be 1..{MAX_SPLITS}, and 1 unless every query is "
                         f"one decode token; got {num_splits} at max_query_len {max_query_len}")
    split = num_splits > 1
    # the partials: allocated per launch (inside a CUDA graph, from the graph's pool)
    partial = torch.empty((num_splits, num_tokens, num_heads, head_dim) if split else (1,),
                          dtype=torch.float32, device=q.device)
    maxes = torch.empty((num_splits, num_tokens, num_heads) if split else (1,),
                        dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    sinks_arg = maxes if sinks is None else sinks  # any fp32 tensor: not read without sinks
    grid = (num_reqs, triton.cdiv(max(max_query_len, 1), tile.block_q) * num_splits,
            num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        out,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        partial,
        maxes,
        sums,
        scale * LOG2_E,
        sliding_window or NO_WINDOW,
        (softcap or 0.0) * LOG2_E,
        sinks_arg,
        int(sinks is not None),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        tile.group,
        tile.group_pad,
        tile.block_q,
        num_splits,
        MIN_SPLIT_KEYS // tile.tile_n,
        partial.stride(0) if split else 0,
        partial.stride(1) if split else 0,
        maxes.stride(0) if split else 0,
        maxes.stride(1) if split else 0,
        **tile.constexprs(head_dim, block_size, q.dtype, q.device.type),
        SPLIT=split,
        num_warps=tile.num_warps,
    )
    if split:
        _combine_splits_kernel[(num_tokens, num_heads)](
            partial, maxes, sums, out, num_splits, partial.stride(0), partial.stride(1),
            maxes.stride(0), maxes.stride(1), out.stride(0), out.stride(1),
            **combine_constexprs(head_dim))
    return out


PREFILL_QUERY_LEN = 512  # any chunk long enough for the prefill tile


def gpu_variants() -> list:
    """Every kernel the launcher picks on a GPU: decode (split over the keys or not, as
    ``choose_splits`` decides for batch sizes 1-512 on an H200) and prefill tiles over head
    dims, GQA groups and K/V dtypes, and the split reduction (``make gpu-check``). The sliding
    window, the group and the cache strides are runtime values, so window on and off share
    each kernel."""
    from shoal.kernels.gpu_check import variants as v

    decode_splits = {choose_splits(1, batch, kv_heads, v.TARGET_SM_COUNT) > 1
                     for batch in v.BATCH_SIZES for kv_heads in (1, 2, 4, 8)}
    out = []
    for head_dim in v.HEAD_DIMS:
        for dtype in v.KV_DTYPES:
            kv = v.triton_type(dtype)
            pointers = dict(q_ptr=kv, out_ptr=kv, k_cache_ptr=kv, v_cache_ptr=kv,
                            block_tables_ptr="i32", query_start_loc_ptr="i32",
                            seq_lens_ptr="i32", partial_ptr="fp32", max_ptr="fp32",
                            sum_ptr="fp32", sinks_ptr="fp32")
            for group in v.GQA_GROUPS:
                for block_size in v.BLOCK_SIZES:
                    for mode, query_len in (("decode", 1), ("prefill", PREFILL_QUERY_LEN)):
                        tile = choose_tile(query_len, group, head_dim, dtype, "cuda")
                        for split in sorted(decode_splits) if mode == "decode" else [False]:
                            constexprs = dict(tile.constexprs(head_dim, block_size, dtype, "cuda"),
                                              SPLIT=split)
                            sig = v.signature(_paged_attention_kernel, constexprs, pointers,
                                              floats=("qk_scale", "softcap_log2"))
                            out.append(v.KernelVariant(
                                f"paged_attention {mode}{' split' if split else ''} {kv} "
                                f"d{head_dim} rows{tile.rows}",
                                _paged_attention_kernel, sig, constexprs,
                                num_warps=tile.num_warps, unaligned=("stride_bt",),
                                tags=dict(wgmma_expected=mode == "prefill"
                                          and dtype != torch.float32)))
            if True in decode_splits:
                constexprs = combine_constexprs(head_dim)
                sig = v.signature(_combine_splits_kernel, constexprs,
                                  dict(partial_ptr="fp32", max_ptr="fp32", sum_ptr="fp32",
                                       out_ptr=kv))
                out.append(v.KernelVariant(f"paged_attention combine_splits {kv} d{head_dim}",
                                           _combine_splits_kernel, sig, constexprs))
    return v.unique(out)
