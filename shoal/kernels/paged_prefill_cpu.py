"""The CPU prefill-attention kernel (``paged_prefill_cpu.c``, in the native library of
``native_cpu``): argument checks and the call."""

from __future__ import annotations

import torch

from shoal.kernels.native_cpu import load
from shoal.kernels.paged_decode_cpu import (
    check_paged_layout,
    check_tensor,
    kv_kind,
    kv_scales_pointer,
    sinks_pointer,
)

MAX_HEAD_DIM = 256


def supports_head_dim(head_dim: int) -> bool:
    """The kernel keeps a tile's rows in 16-float vectors: head_dim a multiple of 16."""
    return head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def prefill_spans_tensor(spans: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """``[count, 4]`` int64 rows of (first flat row, query tokens, block-table row, seq_len)."""
    return torch.tensor(spans, dtype=torch.int64).reshape(len(spans), 4)


def paged_prefill_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, block_tables: torch.Tensor,
                            spans: torch.Tensor, scale: float,
                            sliding_window: int | None = None,
                            softcap: float | None = None,
                            sinks: torch.Tensor | None = None,
                            kv_scales: torch.Tensor | None = None) -> None:
    """Writes the rows of ``out`` of each span in ``spans`` (see ``prefill_spans_tensor``):
    its query tokens, at positions ``seq_len - query_tokens ...`` of their request, attending
    causally over the request's cached K/V (this chunk's included, already written), read
    through its block-table row; with ``sliding_window``, over the last that many positions;
    ``softcap``, ``sinks`` and ``kv_scales`` as for ``paged_decode_attention``.
    Other rows of ``out`` are left untouched.

    Layouts and types as for ``paged_decode_attention``; head_dim a multiple of 16 up to 256. The
    caller guarantees indices are in range (they come from the engine's own plan)."""
    num_heads, head_dim, block_size, num_kv_heads = check_paged_layout(
        q, out, k_cache, v_cache, block_tables)
    if not supports_head_dim(head_dim):
        raise ValueError(f"head_dim {head_dim} is not a multiple of 16 up to {MAX_HEAD_DIM}")
    check_tensor("spans", spans, torch.int64, 2)
    if spans.shape[1] != 4:
        raise ValueError(f"spans must be [count, 4], got {tuple(spans.shape)}")
    if spans.shape[0] == 0:
        return
    failed = load().shoal_paged_prefill(
        q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), spans.data_ptr(), spans.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
        softcap or 0.0, kv_kind(k_cache.dtype), sinks_pointer(sinks, num_heads),
        kv_scales_pointer(k_cache, kv_scales))
    if failed:
        raise MemoryError("the CPU prefill kernel could not allocate its tile list")
