"""Section ``throughput``: nano-vllm's offline workload through the engine core.

256 requests, prompt and output lengths uniform in 100..1024, random token ids,
temperature 0.6, ignore_eos (nano-vllm's published bench shape), all submitted at once
to an in-process EngineCore; output tokens per second of wall time, eager vs CUDA graphs.
"""

from __future__ import annotations

import gc
import os
import random
import time

import torch
from checkpoint import EOS_TOKEN_ID, ensure_checkpoint
from common import log

MODE_SECONDS, MODE_SECONDS_SMOKE = 25.0, 20.0  # generation time allowed per mode


def workload(smoke: bool, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    count, low, high = (4, 4, 12) if smoke else (256, 100, 1024)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(low, high))], rng.randint(low, high))
            for _ in range(count)]


def run_engine(model_dir, device: str, enforce_eager: bool, requests, smoke: bool, tag: str,
               backend: str) -> dict:
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore
    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.wire.messages import EngineCoreRequest

    config = EngineConfig(
        model=str(model_dir), device=device, dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=256, max_num_batched_tokens=64 if smoke else 8192,
        max_model_len=64 if smoke else 2048 + 64, enforce_eager=enforce_eager,
        num_kv_blocks=64 if smoke else None,  # GPU: sized by profiling (gpu_memory_utilization)
        attention_backend=backend,
    )
    started = time.perf_counter()
    core = EngineCore(config)
    setup = time.perf_counter() - started
    log(f"{tag}: engine ready in {setup:.1f} s")
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=out_len, seed=i)
        core.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt,
                                           sampling_params=params, eos_token_ids=[EOS_TOKEN_ID]))
    output_tokens = steps = 0
    deadline = start + (MODE_SECONDS_SMOKE if smoke else MODE_SECONDS)
    partial = False
    while core.has_unfinished_requests():
        for output in core.step():
            output_tokens += len(output.new_token_ids)
        steps += 1
        if time.perf_counter() > deadline:  # keep the section inside its limit: rate so far
            partial = True
            break
    elapsed = time.perf_counter() - start
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    expected = sum(out for _, out in requests)
    if not partial and output_tokens != expected:
        raise RuntimeError(f"generated {output_tokens} tokens, the workload asks for {expected}")
    return {"requests": len(requests), "output_tokens": output_tokens,
            "prompt_tokens": sum(len(p) for p, _ in requests), "steps": steps,
            "seconds": elapsed, "setup_seconds": setup, "output_tok_s": output_tokens / elapsed,
            "partial": partial, "kv_blocks": core.scheduler.kv.num_blocks,
            "graph_capture_seconds": getattr(getattr(core.executor, "worker", None),
                                             "graph_capture_seconds", None)}


def run(smoke: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = ensure_checkpoint(smoke)
    from shoal.runtime.model.config import load_model_config

    requests = workload(smoke, load_model_config(model_dir).vocab_size)
    rows: dict[str, dict] = {}
    backend = os.environ.get("SHOAL_BENCH_ATTENTION") or ("triton" if device == "cuda" else "auto")
    runs = [("eager", backend), ("graphs", backend)]
    for mode, mode_backend in runs:
        try:
            rows[mode] = run_engine(model_dir, device, mode.startswith("eager"), requests, smoke,
                                    mode, mode_backend)
            rows[mode]["attention_backend"] = mode_backend
            log(f"{mode}: {rows[mode]}")
        except Exception as exc:  # noqa: BLE001 - the other mode still runs
            rows[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{mode} failed: {exc!r}")
            if mode == "eager" and mode_backend == "triton":
                runs.append(("eager-torch", "torch"))  # the triton path broke: still measure
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"workload": f"{len(requests)} requests, in/out uniform "
                        f"{'4-12' if smoke else '100-1024'}, ignore_eos, temperature 0.6",
            "device": device, "rows": rows}
