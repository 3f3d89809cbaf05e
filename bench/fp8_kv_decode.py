"""Decode throughput with a float8 KV cache (``--kv-cache-dtype fp8``) against the model's
dtype, on CPU, in one run.

Modes are ``backend/kv-cache-dtype``: ``cpu/auto`` (the CPU default), ``cpu/fp8`` (the native
kernels reading the float8 cache in place), ``torch/fp8`` (the float8 cache on the torch
backend, which gathers and widens the context each step) and ``torch/auto`` (that backend's
own cost).

The model is ``bench/quant_decode.py``'s: Qwen3-0.6B's layer shapes (16 query heads, 8 KV
heads of 128) with ``--layers`` layers, random weights, float32 (the CPU default). Each batch
of ``batch`` prompts of ``--context`` tokens is prefilled (in chunks of 2048 tokens), then the
steps where every row decodes one token are timed one by one (the rows that started first
finish first: up to ``--tokens`` steps); decode tok/s is ``batch`` over the median step
(the median: one step slowed by another process on a loaded machine does not move it), and
each step's CPU time (all threads of the process) is reported beside it: on a shared machine
the CPU time moves less with the load than the wall time.
The modes' engines are built side by side and take turns, ``--rounds`` times per batch, so
a change of the machine's load hits every mode; compare rows of one run.

    .venv/bin/python bench/fp8_kv_decode.py [--layers 4] [--context 448] [--tokens 32]
        [--batches 1,16] [--rounds 3] [--modes cpu/auto,cpu/fp8,torch/fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

DEFAULT_MODES = "cpu/auto,cpu/fp8,torch/fp8"


def engine(mode: str, model_dir: Path, batch: int, context: int, tokens: int):
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore

    backend, kv_cache_dtype = mode.split("/")
    blocks_per_seq = (context + tokens + 1) // 16 + 2
    core = EngineCore(EngineConfig.from_kwargs(
        str(model_dir), dtype="float32", device="cpu", attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype, num_kv_blocks=batch * blocks_per_seq + 8,
        max_num_seqs=batch, max_model_len=context + tokens + 8,
        max_num_batched_tokens=2048, enable_prefix_caching=False))
    assert core.executor.worker.runner.backend.name == backend
    return core


def decode_steps(core, batch: int, context: int, tokens: int,
                 tag: str) -> list[tuple[float, float]]:
    """Prefill ``batch`` prompts, then time each of the ``tokens`` decode steps: (wall, CPU
    seconds of the process, all threads)."""
    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.wire.messages import EngineCoreRequest

    params = SamplingParams(temperature=0.0, max_tokens=1 + tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [3 + (i * 7 + j) % 1000 for j in range(context)]
        core.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt,
                                           sampling_params=params))
    started: set[str] = set()
    while len(started) < batch:  # the prefills, in chunks of max_num_batched_tokens
        started.update(o.request_id for o in core.step() if o.new_token_ids)
    steps = []
    while core.has_unfinished_requests():
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = core.step()
        elapsed = (time.perf_counter() - start, time.process_time() - cpu_start)
        if sum(len(o.new_token_ids) for o in outputs) == batch:  # every row decoding
            steps.append(elapsed)
    return steps


def main(argv: list[str] | None = None) -> int:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quant_decode import dense_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=448)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    model_dir = dense_checkpoint(args.layers)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    cpu_results: dict[str, dict[int, float]] = {mode: {} for mode in modes}  # ms per step
    for batch in batches:
        cores = {mode: engine(mode, model_dir, batch, args.context, args.tokens)
                 for mode in modes}
        for core in cores.values():  # warm-up
            decode_steps(core, 1, 16, 2, "warm")
        steps: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        for r in range(args.rounds):  # modes interleaved: a change of load hits them all
            for mode, core in cores.items():
                steps[mode] += decode_steps(core, batch, args.context, args.tokens, f"{r}")
        for mode in modes:
            wall = sorted(w for w, _ in steps[mode])
            cpu = sorted(c for _, c in steps[mode])
            median, cpu_median = wall[len(wall) // 2], cpu[len(cpu) // 2]
            results[mode][batch] = batch / median
            cpu_results[mode][batch] = cpu_median * 1e3
            print(f"{mode:>10} batch {batch:>3}: {batch / median:8.1f} decode tok/s (median "
                  f"step {median * 1e3:.1f} ms wall of {len(wall)}, fastest "
                  f"{wall[0] * 1e3:.1f} ms; median {cpu_median * 1e3:.1f} CPU ms)", flush=True)
        del cores
    base = modes[0]
    for mode, rows in results.items():
        ratios = ", ".join(f"b{b} {rows[b] / results[base][b]:.2f}x wall, "
                           f"{cpu_results[base][b] / cpu_results[mode][b]:.2f}x CPU"
                           for b in batches)
        print(f"{mode:>10} vs {base}: {ratios}")
    print(json.dumps({"load_average": os.getloadavg(), "tok_s": results,
                      "cpu_ms_per_step": cpu_results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
