"""flashinfer attention backend (CUDA only; flashinfer is imported when the backend is built).

flashinfer wants the page table in CSR form rather than as padded block tables:
``kv_indptr[B+1]`` (where each request's pages start in ``kv_indices``), ``kv_indices``
(the pages, in order) and ``kv_last_page_len[B]`` (1..page_size tokens used in the last
page). ``build_metadata`` converts once per step; the wrapper is planned once per step, by
the first layer that runs (planning needs the head counts, dtype and scale, which the
model's layers know and the metadata does not), and every later layer only calls ``run``.

A pure-decode step uses the decode wrapper; any step with a prefill chunk uses the prefill
wrapper with ``causal=True`` (its default is False), whose causal mask aligns each
request's queries with the end of its KV, so decodes in a mixed step are still correct.
Not CUDA-graph safe here (flashinfer needs one wrapper with fixed buffers per captured
size): with this backend, decode runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from shoal.runtime.attention.backend import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class PagedKVCSR:
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [total pages]
    kv_last_page_len: torch.Tensor  # int32 [B], each in 1..block_size


def paged_kv_csr(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PagedKVCSR:
    """Padded block tables + context lengths -> flashinfer's CSR page table (same device)."""
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("every request in a step has at least one token of context")
    seq_lens = seq_lens.to(torch.int32)
    pages = (seq_lens + block_size - 1) // block_size
    if pages.numel() and int(pages.max()) > block_tables.shape[1]:
        raise ValueError(f"block tables have {block_tables.shape[1]} columns, a request needs {int(pages.max())}")
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns.unsqueeze(0) < pages.unsqueeze(1)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(pages, dim=0)
    return PagedKVCSR(
        kv_indptr=indptr,
        kv_indices=block_tables[used].to(torch.int32),
        kv_last_page_len=(seq_lens - (pages - 1) * block_size).to(torch.int32),
    )


@dataclass
class _StepPlans:
    """Per-step state in ``meta.extra``: the CSR table and the wrappers planned so far."""

    csr: PagedKVCSR
    planned: dict[tuple, Any] = field(default_factory=dict)


class FlashInferBackend:
    name = "flashinfer"
    cuda_graph_safe = False

    def __init__(self) -> None:
        import flashinfer  # noqa: F401  (fails here, clearly, when it is not installed)

        self._flashinfer = flashinfer
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple, Any] = {}

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        meta.extra = _StepPlans(paged_kv_csr(meta.block_tables, meta.seq_lens, meta.block_size))
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
        kv_scales: torch.Tensor | None = None,  # float8 caches are refused by the selector
    ) -> torch.Tensor:
        if sinks is not None:  # the backend choice routes models with sinks elsewhere
            raise ValueError("the flashinfer attention backend does not implement attention "
                             "sinks")
        step = meta.extra
        if not isinstance(step, _StepPlans):
            raise RuntimeError("FlashInferBackend.forward called without build_metadata for the step")
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        key = (meta.is_pure_decode, q.shape[1], num_kv_heads, head_dim, q.dtype, k_cache.dtype,
               float(scale), sliding_window, softcap)
        wrapper = step.planned.get(key)
        if wrapper is None:
            wrapper = self._plan(key, step.csr, meta, q, k_cache)
            step.planned[key] = wrapper
        return wrapper.run(q, (k_cache, v_cache))

    def _plan(self, key: tuple, csr: PagedKVCSR, meta: AttentionMetadata, q: torch.Tensor,
              k_cache: torch.Tensor) -> Any:
        pure_decode, num_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale, window, cap = key
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            if pure_decode:
                # tensor cores: flashinfer's CUDA-core decode kernels exist for GQA groups 1, 2,
                # 3, 4 and 8 only, so a group of 5 or 7 (Qwen3-14B, Qwen2.5-7B) would fail there
                wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=True)
            else:
                wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._wrappers[key] = wrapper
        window_left = -1 if window is None else window - 1  # flashinfer counts keys before the query
        common = dict(sm_scale=scale, window_left=window_left, q_data_type=q_dtype,
                      kv_data_type=kv_dtype, logits_soft_cap=cap or 0.0)
        if pure_decode:
            wrapper.plan(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, num_heads,
                         num_kv_heads, head_dim, meta.block_size, **common)
        else:
            wrapper.plan(meta.query_start_loc, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len,
                         num_heads, num_kv_heads, head_dim, meta.block_size, causal=True, **common)
        return wrapper
