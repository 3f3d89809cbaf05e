"""Triton attention backend: the kernels of shoal.kernels behind the backend interface.

Per layer: write the step's new K/V through ``slot_mapping`` (``reshape_and_cache``), then
one paged-attention launch over the whole mixed batch (prefill chunks and decodes
together). Nothing is planned per step, and every tensor it reads lives in the metadata,
so a decode step replays under a CUDA graph once the metadata tensors are static buffers.

On CPU it runs only under ``TRITON_INTERPRET=1`` (tests); ``auto`` never picks it there.
"""

from __future__ import annotations

import torch
from shoal.runtime.attention.backend import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"
    cuda_graph_safe = True  # no host work in forward; metadata tensors can be static

    def __init__(self) -> None:
        # imported here so that choosing another backend never imports triton
        from shoal.kernels.paged_attention import paged_attention
        from shoal.kernels.reshape_and_cache import reshape_and_cache

        self._paged_attention = paged_attention
        self._reshape_and_cache = reshape_and_cache

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
