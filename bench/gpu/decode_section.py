"""Section ``decode``: one decode step's time at batch 1/16/64/256, eager vs CUDA graphs.

A Worker runs the Qwen3-0.6B-shaped model (bf16) directly from step plans (no scheduler),
every request holding ``context_len`` tokens. The step time is the wall time of
``Worker.execute`` (model, sampler, host work, result copy), median over timed steps. The
floor is the bytes a step must read — all weights once plus every request's KV — over the
measured device copy bandwidth.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch
from checkpoint import count_weight_bytes, ensure_checkpoint
from common import copy_bandwidth_gbps, log, read_result, time_ms


def _make_worker(model_dir, device: str, enforce_eager: bool, num_blocks: int, max_num_seqs: int,
                 max_len: int, token_budget: int, backend: str, load_format: str = "auto"):
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.worker.worker import Worker

    config = EngineConfig(
        model=str(model_dir), device=device, dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget, max_model_len=max_len,
        num_kv_blocks=num_blocks, enforce_eager=enforce_eager,
        attention_backend=backend, load_format=load_format,
    )
    worker = Worker(config)
    worker.load_model()
    worker.init_kv_cache(num_blocks)
    worker.warmup()
    return worker


def _time_batch(worker, batch_size: int, context_len: int, steps: int, warmup: int,
                block_size: int, token_budget: int, vocab: int, tag: str,
                finished: list[str]) -> tuple[float, float | None, list[str], list[list[int]]]:
    from plans import DirectBatch

    gen = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(3, vocab, (batch_size, context_len), generator=gen).tolist()
    req_ids = [f"{tag}-b{batch_size}-{i}" for i in range(batch_size)]
    batch = DirectBatch(req_ids, prompts, context_len + warmup + steps + 1, block_size)
    for plan in batch.prefill_plans(token_budget, finished):  # also drops the last batch
        worker.execute(plan)
    samples = []
    tokens: list[list[int]] = [[] for _ in range(batch_size)]
    for i in range(warmup + steps):
        plan = batch.decode_plan()
        start = time.perf_counter()
        result = worker.execute(plan)
        elapsed = time.perf_counter() - start
        batch.record(result.sampled_token_ids)
        for row, token in enumerate(result.sampled_token_ids.tolist()):
            tokens[row].append(int(token))
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples) * 1e3, _replay_ms(worker, batch_size), req_ids, tokens


def _replay_ms(worker, batch_size: int) -> float | None:
    """GPU time of the model forward alone: the last step's graph replayed on its own inputs
    (it rewrites the same K/V into the same slots). Step time minus this is host work,
    logits and sampling."""
    graphs = getattr(worker.runner, "decode_graphs", None)
    if graphs is None:
        return None
    b = batch_size
    inputs = [t[:b].clone() for t in (graphs.input_ids, graphs.positions, graphs.seq_lens,
                                      graphs.block_tables, graphs.slot_mapping)]
    return time_ms(lambda: graphs.run(*inputs), "cuda", warmup=2, iters=10)


def run(smoke: bool, model_dir=None, load_format: str = "auto", batches: list[int] | None = None,
        label: str | None = None) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = model_dir or ensure_checkpoint(smoke)
    from shoal.runtime.model.config import load_model_config

    cfg = load_model_config(model_dir)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batches = batches or ([1, 2] if smoke else [1, 16, 64, 256])
    context_len, steps, warmup = (8, 2, 1) if smoke else (512, 10, 3)
    block_size, token_budget = 16, (64 if smoke else 8192)
    max_len = context_len + steps + warmup + 1
    blocks = max(batches) * -(-max_len // block_size) + 1
    env = read_result("env") or {}
    bandwidth = env.get("copy_bandwidth_gbps") or copy_bandwidth_gbps(device, 64 * 2**20)
    elem = torch.empty((), dtype=dtype).element_size()
    weight_bytes = count_weight_bytes(model_dir / "config.json", elem)
    kv_per_token = cfg.kv_bytes_per_token(dtype)

    times: dict[str, dict[int, float]] = {}
    replays: dict[int, float] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {"eager": {}, "graphs": {}}
    capture: dict[str, float | None] = {}
    backends: dict[str, str] = {}
    # graphs need triton; SHOAL_BENCH_ATTENTION overrides (e.g. to compare backends)
    gpu_backend = os.environ.get("SHOAL_BENCH_ATTENTION") or ("triton" if device == "cuda" else "auto")
    runs = [("eager", gpu_backend), ("graphs", gpu_backend)]
    for mode, backend in runs:
        times[mode] = {}
        backends[mode] = backend
        try:
            started = time.perf_counter()
            worker = _make_worker(model_dir, device, mode == "eager", blocks, max(batches), max_len,
                                  token_budget, backend, load_format)
            capture[mode] = getattr(worker, "graph_capture_seconds", None)
            log(f"{mode}: worker ready in {time.perf_counter() - started:.1f} s "
                f"(graph capture {capture[mode]})")
            finished: list[str] = []
            for b in batches:
                ms, replay, finished, tokens[mode][b] = _time_batch(worker, b, context_len, steps, warmup, block_size,
                                           token_budget, cfg.vocab_size, mode, finished)
                times[mode][b] = ms
                if replay is not None:
                    replays[b] = replay
                log(f"{mode} batch {b}: {ms:.2f} ms per decode step (graph replay {replay} ms)")
            del worker
        except Exception as exc:  # noqa: BLE001 - eager results survive a graphs failure
            log(f"{mode} ({backend}) failed: {type(exc).__name__}: {exc}")
            capture[f"{mode}_{backend}_error"] = f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
            if mode == "eager" and backend == "triton" and not times[mode]:
                runs.append(("eager", "torch"))  # the triton path broke: still measure eager
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    rows = []
    for b in batches:
        floor_bytes = weight_bytes + b * context_len * kv_per_token
        rows.append({
            "batch": b,
            "eager_ms": times["eager"].get(b),
            "graphs_ms": times["graphs"].get(b),
            "replay_ms": replays.get(b),
            # greedy decodes of the same prompts: requests whose tokens are identical in both
            # modes (random weights have near-tied logits, so a rare flip is not a bug)
            "same_tokens": _agreement(tokens["eager"].get(b), tokens["graphs"].get(b)),
            "floor_ms": floor_bytes / (bandwidth * 1e9) * 1e3,
            "bytes_read": floor_bytes,
        })
    default_label = "Qwen3-0.6B-shaped bf16" if not smoke else "tiny qwen3"
    return {"model": label or default_label, "device": device,
            "context_len": context_len, "bandwidth_gbps": bandwidth, "weight_bytes": weight_bytes,
            "capture": capture, "backends": backends, "rows": rows}


def _agreement(eager: list[list[int]] | None, graphs: list[list[int]] | None) -> str | None:
    if not eager or not graphs:
        return None
    same = sum(a == b for a, b in zip(eager, graphs, strict=True))
    return f"{same}/{len(eager)}"
