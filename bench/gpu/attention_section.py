"""Section ``attention``: every available backend vs the torch reference on real shapes.

Qwen3-0.6B, Llama-3-8B (= Qwen3-8B's) and Qwen2.5-7B (GQA group 7) attention (16, 32 or 28
query heads, 8 or 4 KV heads, head_dim 128,
bf16, block 16) on a decode batch of 64 and on a mixed step (prefill chunks after a
cached prefix plus decodes). For each backend: the largest deviation from ``kernels.reference`` and the time
of one layer's ``forward`` (KV write + attention); flashinfer's ``plan`` runs once per step
in ``build_metadata``/first layer and is left out, as it is amortised over all layers.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
from common import log, time_ms


@dataclass
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


QWEN3_0_6B = Shapes(16, 8, 128, 16, torch.bfloat16)
LLAMA3_8B = Shapes(32, 8, 128, 16, torch.bfloat16)
QWEN25_7B = Shapes(28, 4, 128, 16, torch.bfloat16)  # GQA group 7
TINY = Shapes(4, 2, 16, 16, torch.float32)


def cases(smoke: bool) -> list[tuple[str, Shapes, list[tuple[int, int]], int | None]]:
    """(name, shapes, [(cached context, new query tokens) per request], sliding window)."""
    gen = torch.Generator().manual_seed(0)
    if smoke:
        return [("qwen3-decode", TINY, [(int(c), 1) for c in torch.randint(4, 40, (3,), generator=gen)], None),
                ("qwen3-mixed", TINY, [(4, 9), (17, 1), (30, 1)], None),
                ("window-mixed", TINY, [(4, 9), (17, 1), (30, 1)], 7)]
    decode = [(int(c), 1) for c in torch.randint(512, 1536, (64,), generator=gen)]
    mixed = [(256, 512)] * 4 + [(int(c), 1) for c in torch.randint(512, 1536, (60,), generator=gen)]
    return [("qwen3-decode", QWEN3_0_6B, decode, None), ("qwen3-mixed", QWEN3_0_6B, mixed, None),
            ("llama8b-decode", LLAMA3_8B, decode, None), ("llama8b-mixed", LLAMA3_8B, mixed, None),
            ("group7-decode", QWEN25_7B, decode, None), ("group7-mixed", QWEN25_7B, mixed, None),
            ("window-mixed", QWEN3_0_6B, mixed, 300)]


def build_batch(requests, shapes: Shapes, device: str):
    from shoal.runtime.attention.backend import AttentionMetadata

    bs = shapes.block_size
    blocks_needed = [-(-(ctx + q) // bs) for ctx, q in requests]
    num_blocks = sum(blocks_needed) + 1
    order = torch.randperm(num_blocks)
    tables, slots, starts, cursor = [], [], [0], 0
    width = max(blocks_needed)
    for (ctx, q_len), n in zip(requests, blocks_needed, strict=True):
        table = order[cursor:cursor + n].tolist()
        cursor += n
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q_len)]
        tables.append(table + [0] * (width - n))
        starts.append(starts[-1] + q_len)
    seq_lens = [ctx + q for ctx, q in requests]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q for _, q in requests),
        max_seq_len=max(seq_lens),
        block_size=bs,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    shape = (num_blocks, bs, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(shape, device=device).to(shapes.dtype)
    v_cache = torch.randn(shape, device=device).to(shapes.dtype)
    tokens = starts[-1]
    q = torch.randn(tokens, shapes.num_heads, shapes.head_dim, device=device).to(shapes.dtype)
    k = torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, device=device).to(shapes.dtype)
    v = torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, device=device).to(shapes.dtype)
    return meta, k_cache, v_cache, q, k, v


def available_backends(device: str) -> dict[str, object]:
    backends: dict[str, object] = {}
    candidates = {
        "torch": ("shoal.runtime.attention.torch_backend", "TorchAttentionBackend"),
        "triton": ("shoal.runtime.attention.triton_backend", "TritonAttentionBackend"),
    }
    if device == "cuda":
        candidates["flashinfer"] = ("shoal.runtime.attention.flashinfer_backend", "FlashInferBackend")
    for name, (module, cls) in candidates.items():
        try:
            backends[name] = getattr(importlib.import_module(module), cls)()
        except Exception as exc:  # noqa: BLE001 - a missing backend is a row in the table
            log(f"backend {name} unavailable: {type(exc).__name__}: {exc}")
    return backends


def run(smoke: bool) -> dict:
    from shoal.kernels.reference import paged_attention_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = available_backends(device)
    results: dict[str, dict] = {}
    for case, shapes, requests, window in cases(smoke):
        scale = shapes.head_dim ** -0.5
        torch.manual_seed(1)
        meta, k_cache, v_cache, q, k, v = build_batch(requests, shapes, device)
        reference = None
        for name, backend in backends.items():
            row = f"{case}/{name}"
            try:
                kc, vc = k_cache.clone(), v_cache.clone()
                step_meta = backend.build_metadata(meta)
                out = backend.forward(q, k, v, kc, vc, step_meta, scale, window)
                if reference is None:  # the cache now holds this step's K/V
                    reference = paged_attention_ref(q, kc, vc, meta.query_start_loc, meta.seq_lens,
                                                    meta.block_tables, scale, window)
                error = (out.float() - reference.float()).abs().max().item()
                step = functools.partial(backend.forward, q, k, v, kc, vc, step_meta, scale, window)
                ms = time_ms(step, device, warmup=0 if smoke else 5, iters=1 if smoke else 20)
                results[row] = {"max_abs_error": error, "us_per_layer": ms * 1e3,
                                "tokens": int(q.shape[0]), "requests": len(requests)}
                log(f"{row}: max |err| {error:.3g}, {ms * 1e3:.1f} us per layer")
            except Exception as exc:  # noqa: BLE001 - one backend failing keeps the others
                results[row] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"{row} failed: {exc!r}")
    return {"device": device, "rows": results,
            "shapes": "qwen3 = Qwen3-0.6B (16 q / 8 kv heads, dim 128), llama8b = Llama-3-8B "
                      "(32 q / 8 kv heads, dim 128); bf16, block 16; decode: 64 requests with "
                      "512-1536 cached tokens; mixed: 4 chunks of 512 after 256 cached + 60 decodes"
                      if not smoke else "tiny fp32 (4 q / 2 kv heads, dim 16)"}
