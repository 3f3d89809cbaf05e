"""Section ``kernels``: the device's ceilings and the Triton attention kernel against them.

Ceilings: device copy bandwidth (bytes read + written per second) and a bf16 GEMM's TFLOP/s
(8192^3 through torch.matmul). Decode attention (Llama-3-8B / Qwen3-8B heads: 32 query, 8
kv, head dim 128, bf16, block 16) at batch 1 and 64 x context 512, 8k and 32k: microseconds
per layer against the floor of reading the batch's K and V once at the copy bandwidth, with
the number of key splits the launcher chose (flash-decoding at small batch). An 8k-token
prefill's attention (one request, causal): TFLOP/s. Every row is written as soon as it is
measured, so a timeout keeps the rows before it.
"""

from __future__ import annotations

import functools

import torch
from common import copy_bandwidth_gbps, log, time_ms, write_result

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def _decode_case(batch: int, context: int, dtype: torch.dtype, device: str, heads: int,
                 kv_heads: int, head_dim: int):
    blocks_per_req = -(-(context + 1) // BLOCK)
    k_cache = torch.randn(batch * blocks_per_req + 1, BLOCK, kv_heads, head_dim, dtype=dtype,
                          device=device)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.arange(batch * blocks_per_req, device=device, dtype=torch.int32)
              .view(batch, blocks_per_req) + 1)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, starts, seq_lens, tables


def run(smoke: bool) -> dict:
    from shoal.kernels import paged_attention as pa
    from shoal.kernels.reference import paged_attention_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, kv_heads, head_dim = (HEADS, KV_HEADS, HEAD_DIM) if not smoke else (4, 2, 16)
    result: dict = {"rows": [], "shape": f"{heads}q/{kv_heads}kv x {head_dim}, {dtype}"}
    bandwidth = copy_bandwidth_gbps(device, (64 if smoke else 2048) * 2**20)
    result["copy_bandwidth_gbps"] = round(bandwidth, 1)
    n = 512 if smoke else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    ms = time_ms(lambda: a @ a, device, warmup=2, iters=5)
    result["gemm_tflops"] = round(2 * n**3 / (ms / 1e3) / 1e12, 2)
    log(f"ceilings: copy {bandwidth:.0f} GB/s, {dtype} GEMM {result['gemm_tflops']} TFLOP/s")
    write_result("kernels", result)

    contexts = (32, 64) if smoke else (512, 8192, 32768)
    for batch in ((1, 2) if smoke else (1, 64)):
        for context in contexts:
            case = _decode_case(batch, context, dtype, device, heads, kv_heads, head_dim)
            q, k_cache, v_cache, starts, seq_lens, tables = case
            splits = pa.choose_splits(1, batch, kv_heads, pa._sm_count(q.device))
            step = functools.partial(pa.paged_attention, *case, 1, head_dim ** -0.5)
            row: dict = {"batch": batch, "context": context, "splits": splits}
            ms = time_ms(step, device, warmup=2 if smoke else 5, iters=3 if smoke else 20)
            kv_bytes = 2 * batch * (context + 1) * kv_heads * head_dim * k_cache.element_size()
            floor_us = kv_bytes / (bandwidth / 2 * 1e9) * 1e6  # reads only: half the copy rate
            row.update(us=round(ms * 1e3, 1), floor_us=round(floor_us, 1),
                       x_floor=round(ms * 1e3 / floor_us, 2))
            if batch * context <= 1 << 19:  # the float32 reference's gather stays a few GB
                expected = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(),
                                               starts, seq_lens, tables, head_dim ** -0.5)
                row["max_abs_err"] = float((step().float() - expected).abs().max())
            if splits > 1:  # the same batch without splitting, for the gain
                row["no_split_us"] = round(time_ms(
                    functools.partial(step, num_splits=1),
                    device, warmup=2, iters=3 if smoke else 20) * 1e3, 1)
            result["rows"].append(row)
            log(f"decode attention {row}")
            write_result("kernels", result)
            del q, k_cache, v_cache, case, step

    tokens = 64 if smoke else 8192  # one prefill of `tokens` over itself, causal
    q, k_cache, v_cache, _, _, _ = _decode_case(1, tokens - 1, dtype, device, heads, kv_heads,
                                                head_dim)
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    tables = torch.arange(1, k_cache.shape[0], dtype=torch.int32, device=device)[None]
    ms = time_ms(lambda: pa.paged_attention(q, k_cache, v_cache, starts, seq_lens, tables,
                                            tokens, head_dim ** -0.5),
                 device, warmup=1 if smoke else 3, iters=2 if smoke else 10)
    flops = 4 * heads * head_dim * tokens * tokens / 2  # QK^T and PV, causal half
    result["prefill"] = {"tokens": tokens, "ms": round(ms, 3),
                         "tflops": round(flops / (ms / 1e3) / 1e12, 2)}
    log(f"prefill attention {result['prefill']}")
    write_result("kernels", result)
    return result
