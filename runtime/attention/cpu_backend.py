"""CPU attention: decode rows and prefill chunks through the native kernels, K/V in place
(the step's new K/V rows written into their slots by ``cpu_ops.write_kv``).

On a CPU, decode attention is bound by memory traffic over the KV cache. The torch reference
backend gathers each request's pages into a dense buffer and reads it again; the native
kernel (``shoal.kernels.paged_decode_cpu``) reads every K/V row once, in place. Prefill
chunks are compute-bound: torch's SDPA computes a causal prompt at the cost of a full one
and needs a chunk's cached prefix gathered and masked, so ``shoal.kernels.paged_prefill_cpu``
computes only the tiles at or below the diagonal, reading the pages in place (head sizes
that are multiples of 16; others go through the torch backend's SDPA path). Its tiles keep
16 keys' scores of 16 rows in 16-float vectors: 16 registers with AVX-512, 32 with AVX2,
which has 16, so on AVX2 it spills on every FMA (6.5 GFLOP/s on one Zen 3 core for a
2,048-token causal prompt; the bench llama's whole 2,048-token prefill on one thread took
about 7 CPU-seconds through it against 2.4-2.5 through SDPA, chunked by 256 or not): without
AVX-512 prefill chunks take the SDPA path, decode rows still the native kernel. The model runs
in float32 or bfloat16: the caches are in the model's dtype and the kernels widen each K/V
row to float32 as they read it; a bfloat16 model's q goes in widened (a few KB per step)
and the float32 output is rounded back. ``auto`` picks this backend on CPU when the kernels
build here, else the torch backend.

A float8 cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``): the step's rows are quantized by
``kv_cache_dtype.write_fp8_kv`` (the torch backend's write: one rounding for both), and the
kernels read the bytes in place, each widened through a table times the layer's K or V scale.
Prefill chunks the native kernel cannot take attend over K/V rounded as the cache holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from shoal.runtime.attention.backend import AttentionMetadata
from shoal.runtime.attention.kv_cache_dtype import is_fp8, round_trip, unit_scales, write_fp8_kv
from shoal.runtime.attention.torch_backend import (
    PrefillSpan,
    attend_prefills,
    prefill_spans,
    step_plan,
)

from shoal.kernels import cpu_ops, native_cpu, paged_decode_cpu, paged_prefill_cpu

_NO_SPANS = paged_prefill_cpu.prefill_spans_tensor([])


# the native prefill kernel's tiles fit the registers only with AVX-512 (docstring above)
PREFILL_KERNEL_HERE = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@dataclass
class CpuAttentionPlan:
    q_rows: torch.Tensor  # int64 [Bd]: the decode rows of the flat batch
    table_rows: torch.Tensor  # int64 [Bd]: their requests' rows of the block table
    seq_lens: torch.Tensor  # int32 [Bd]
    prefills: list[PrefillSpan]
    prefill_spans: torch.Tensor  # int64 [P, 4]: the same chunks, for the native kernel


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the cpu attention backend runs float32 and bfloat16 models, "
                             f"not {dtype}; use --attention-backend torch")
        native_cpu.load()  # builds the library once per machine; KernelUnavailable if not

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        starts = meta.query_start_loc_cpu
        num_reqs = meta.num_reqs
        if meta.is_pure_decode:
            rows = torch.arange(num_reqs, dtype=torch.long)
            meta.extra = CpuAttentionPlan(rows, rows, meta.seq_lens.to(torch.int32), [],
                                          _NO_SPANS)
            return meta
        decode = [i for i in range(num_reqs) if starts[i + 1] - starts[i] == 1]
        prefills = prefill_spans(meta)
        meta.extra = CpuAttentionPlan(
            q_rows=torch.tensor([starts[i] for i in decode], dtype=torch.long),
            table_rows=torch.tensor(decode, dtype=torch.long),
            seq_lens=torch.tensor([meta.seq_lens_cpu[i] for i in decode], dtype=torch.int32),
            prefills=prefills,
            prefill_spans=paged_prefill_cpu.prefill_spans_tensor(
                [(p.start, p.end - p.start, p.row, p.seq_len) for p in prefills]))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        plan = step_plan(self, meta, CpuAttentionPlan)
        fp8 = is_fp8(k_cache.dtype)
        if fp8:
            kv_scales = unit_scales(k_cache.device) if kv_scales is None else kv_scales
            write_fp8_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        else:
            kv_scales = None  # the cache holds the model's dtype: nothing to scale
            cpu_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        native_prefill = bool(plan.prefills) and PREFILL_KERNEL_HERE \
            and paged_prefill_cpu.supports_head_dim(q.shape[2])
        # the kernels take float32 queries and write float32 rows (q may be a view into the
        # qkv rows: float32 q is passed as it is)
        q32 = q if q.dtype == torch.float32 else q.float()
        out = torch.empty(q.shape, dtype=torch.float32)
        paged_decode_cpu.paged_decode_attention(
            q32, out, k_cache, v_cache, meta.block_tables, plan.q_rows, plan.table_rows,
            plan.seq_lens, scale, sliding_window, softcap, sinks, kv_scales)
        if native_prefill:
            paged_prefill_cpu.paged_prefill_attention(
                q32, out, k_cache, v_cache, meta.block_tables, plan.prefill_spans, scale,
                sliding_window, softcap, sinks, kv_scales)
        if q.dtype != torch.float32:
            out = out.to(q.dtype)
        if not native_prefill:  # no prefill rows (a no-op), or a head size the kernel lacks
            if plan.prefills and kv_scales is not None:  # attend over what the cache holds
                k = round_trip(k, kv_scales[0], k_cache.dtype)
                v = round_trip(v, kv_scales[1], v_cache.dtype)
            attend_prefills(out, q, k, v, k_cache, v_cache, meta, plan.prefills, scale,
                            sliding_window, softcap, sinks, kv_scales)
        return out
