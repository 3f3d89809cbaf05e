"""One model step on CPU, decode and prefill, against the CPU floor measured here.

Isolates the model side (Worker: model, attention, sampler) from the scheduler: the KV cache
is filled with random values and plans are written directly, so a decode step over long
contexts costs no prefill first. Prints, per step kind, milliseconds per step, the step's
floor (``bench/floor.py``: its matmul FLOPs at the matmul peak measured in the same run plus
its decode K/V bytes at the streaming read rate) and the floor's share of the step. The
machine is shared: figures are noisy.

    .venv/bin/python bench/model_step.py [--arch llama] [--size bench] [--batch 128]
        [--context 400] [--prefill 4x512] [--threads 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.plan import NewRequestData, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import Floor, Work  # noqa: E402  (bench/ is not a package)

BLOCK = 16


def plan(step: int, lengths: list[int], query_lens: list[int], vocab: int,
         announce: bool) -> StepPlan:
    """Request i owns consecutive-by-row blocks; its query is its last query_lens[i] tokens."""
    rng = np.random.default_rng(step)
    nb = -(-max(lengths) // BLOCK)
    tables = np.arange(len(lengths) * nb, dtype=np.int32).reshape(len(lengths), nb)
    positions = np.concatenate([np.arange(n - q, n) for n, q in zip(lengths, query_lens,
                                                                      strict=True)])
    rows = np.repeat(np.arange(len(lengths)), query_lens)
    slots = tables[rows, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    ids = [f"r{i}" for i in range(len(lengths))]
    new = [NewRequestData(r, [1], [], SamplingParams(temperature=0.0)) for r in ids] \
        if announce else []
    return StepPlan(step, ids, rng.integers(3, vocab, len(positions)).astype(np.int64),
                    positions.astype(np.int64),
                    np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
                    np.array(lengths, np.int32), tables, slots,
                    np.ones(len(lengths), bool), new_requests=new,
                    finished_req_ids=ids if announce else [])


def timed(worker, plans: list[StepPlan]) -> float:
    worker.execute(plans[0])
    start = time.perf_counter()
    for p in plans[1:]:
        worker.execute(p)
    return (time.perf_counter() - start) / (len(plans) - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--batch", type=int, default=128, help="decoding requests")
    parser.add_argument("--context", type=int, default=400, help="their context length")
    parser.add_argument("--prefill", default="4x512", help="REQUESTSxTOKENS in one step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from shoal.runtime.model.make_model import cached_model
    from shoal.runtime.worker.worker import Worker

    n_prefill, prefill_len = (int(x) for x in args.prefill.split("x"))
    model_dir = cached_model(args.arch, args.size)
    needed = max(args.batch * -(-args.context // BLOCK), n_prefill * -(-prefill_len // BLOCK))
    worker = Worker(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 block_size=BLOCK))
    worker.load_model()
    worker.init_kv_cache(needed)
    for k_cache, v_cache in worker.runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    mc = worker.model_config()
    print(f"model {model_dir.name}, torch threads {torch.get_num_threads()}")

    decode_lens = [args.context] * args.batch
    decode_plans = [plan(s, decode_lens, [1] * args.batch, mc.vocab_size, s == 0)
                    for s in range(6)]
    prefill_plans = [plan(100 + s, [prefill_len] * n_prefill, [prefill_len] * n_prefill,
                          mc.vocab_size, True) for s in range(4)]
    cases = [
        (f"decode {args.batch} x ctx {args.context}", decode_plans,
         Work(tokens=args.batch, sampled=args.batch, decode_contexts=args.batch * args.context)),
        (f"prefill {n_prefill} x {prefill_len}", prefill_plans,
         Work(tokens=n_prefill * prefill_len, sampled=n_prefill,
              prompt_pairs=n_prefill * prefill_len * (prefill_len + 1) // 2)),
    ]
    floor = Floor.measure(mc, torch.get_num_threads())
    print(floor.describe())
    print(f"{'step':<24} {'ms/step':>9} {'floor ms':>9} {'matmul ms':>10} {'K/V ms':>7} "
          f"{'share':>7}")
    for name, plans, work in cases:
        seconds = timed(worker, plans)
        compute_s, kv_s = floor.split(work)
        print(f"{name:<24} {seconds * 1e3:>9.1f} {(compute_s + kv_s) * 1e3:>9.1f} "
              f"{compute_s * 1e3:>10.1f} {kv_s * 1e3:>7.1f} "
              f"{100 * (compute_s + kv_s) / seconds:>6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
