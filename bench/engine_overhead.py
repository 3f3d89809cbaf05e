"""Engine-core CPU cost per step with a null model: scheduler + KV manager + plan building +
output processing, no forward pass.

256 running requests decode together (prompt lengths 64..512, prefix caching on, half of
them sharing a 128-token system prompt), at block size 16 and 256. Reports the mean and p90
wall time per steady-state decode step, split into schedule (incl. plan arrays) and update,
and the ratio to the 0.5 ms target. Times are CPU time of the engine thread (so other jobs
on a shared machine inflate them less than wall time), still noisy.

``--churn`` adds a second workload: output lengths 1..512, and every finished request is
replaced by a new one before the next step, so most steps also admit and prefill (the
prefill's token copying and block hashing count; ``add_request`` itself does not).

``--against REF`` measures the engine of another commit too, in the same run: ``--runs``
runs of each, alternating (REF's own copy of this script in a subprocess, then this one),
and reports the median over runs of each one's per-step median and the ratio.

    .venv/bin/python bench/engine_overhead.py [--steps 400] [--churn] [--json out.json]
        [--against REF --runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore, freeze_gc_after_startup
from shoal.runtime.executor.base import Executor
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest
from shoal.runtime.wire.plan import StepPlan, StepResult

TARGET_MS = 0.5
VOCAB = 32000


class NullExecutor(Executor):
    """Answers every sampled row with a fixed token: the step costs only the engine core."""

    def __init__(self) -> None:
        self._config = ModelConfig(architecture="Null", vocab_size=VOCAB, hidden_size=8,
                                   num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                                   intermediate_size=8, max_position_embeddings=1 << 16,
                                   eos_token_ids=[0])

    @property
    def model_config(self) -> ModelConfig:
        return self._config

    def kv_bytes_per_block(self) -> int:
        return 1

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        rows = [rid for rid, s in zip(plan.req_ids, plan.sample_rows.tolist(), strict=True) if s]
        return StepResult(plan.step_id, rows, np.full(len(rows), 7, dtype=np.int64))

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def measure(block_size: int, num_reqs: int, steps: int, churn: bool = False) -> dict:
    rng = random.Random(0)
    config = EngineConfig(model="null", block_size=block_size, max_num_seqs=num_reqs,
                          max_num_batched_tokens=8192, max_model_len=4096,
                          num_kv_blocks=num_reqs * 4096 // block_size,
                          enable_prefix_caching=True)
    core = EngineCore(config, executor=NullExecutor())
    freeze_gc_after_startup()
    system = [rng.randrange(3, VOCAB) for _ in range(128)]
    arrivals = 0

    def add_requests(count: int) -> None:
        nonlocal arrivals
        for _ in range(count):
            body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(64, 512))]
            max_tokens = rng.randint(1, 2 * num_reqs) if churn else steps + 1000
            core.add_request(EngineCoreRequest(
                request_id=str(arrivals), prompt_token_ids=(system if arrivals % 2 else []) + body,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True)))
            arrivals += 1

    scheduler, executor = core.scheduler, core.executor
    add_requests(num_reqs)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.requests.values()):
        core.step()  # prefill everyone
    for _ in range(2 * num_reqs if churn else 0):  # until finishes and arrivals are mixed
        core.step()
        add_requests(num_reqs - len(scheduler.requests))
    total, schedule, update, wall = [], [], [], []
    clock = time.thread_time  # CPU time of this thread: what other jobs on the machine steal
    for _ in range(steps):
        if churn:
            add_requests(num_reqs - len(scheduler.requests))
        w0 = time.perf_counter()
        t0 = clock()
        step = scheduler.schedule()
        t1 = clock()
        assert step is not None and (churn or step.plan.num_reqs == num_reqs)
        result = executor.execute(step.plan)
        t2 = clock()
        outputs = scheduler.update(step, result)
        t3 = clock()
        wall.append(time.perf_counter() - w0)
        assert churn or len(outputs) == num_reqs
        schedule.append(t1 - t0)
        update.append(t3 - t2)
        total.append((t1 - t0) + (t3 - t2))
    core.check_invariants()
    ms = 1e3
    return {
        "workload": "churn" if churn else "steady",
        "block_size": block_size, "num_reqs": num_reqs, "steps": steps,
        "mean_ms": statistics.fmean(total) * ms,
        "median_ms": statistics.median(total) * ms,
        "p90_ms": float(np.percentile(total, 90)) * ms,
        "wall_median_ms": statistics.median(wall) * ms,
        "schedule_ms": statistics.fmean(schedule) * ms,
        "update_ms": statistics.fmean(update) * ms,
        "ratio_to_target": statistics.fmean(total) * ms / TARGET_MS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--churn", action="store_true",
                        help="also measure with requests finishing and arriving every step")
    parser.add_argument("--json", default="")
    parser.add_argument("--against", default="",
                        help="a git commit to measure as well, interleaved run by run")
    parser.add_argument("--runs", type=int, default=3, help="runs of each with --against")
    args = parser.parse_args(argv)
    if args.against:
        return compare(args)
    rows = [measure(bs, args.num_reqs, args.steps, churn)
            for churn in ((False, True) if args.churn else (False,)) for bs in (16, 256)]
    print(f"engine-core CPU per decode step, {args.num_reqs} running requests, null model "
          f"(target <= {TARGET_MS} ms at block 16; shared machine: noisy)")
    print("CPU ms of the engine-core thread per step (wall median includes the null executor)")
    print(f"{'workload':>8} {'block':>6} {'mean':>7} {'median':>7} {'p90':>7} {'schedule':>9} "
          f"{'update':>7} {'wall med':>9} {'mean/target':>12}")
    for r in rows:
        print(f"{r['workload']:>8} {r['block_size']:>6} {r['mean_ms']:>7.3f} {r['median_ms']:>7.3f} "
              f"{r['p90_ms']:>7.3f} {r['schedule_ms']:>9.3f} {r['update_ms']:>7.3f} "
              f"{r['wall_median_ms']:>9.3f} {r['ratio_to_target']:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_ms": TARGET_MS, "results": rows}, f, indent=2)
    return 0


def compare(args: argparse.Namespace) -> int:
    """This checkout against ``args.against``, ``args.runs`` runs each, alternating."""
    import subprocess
    import tempfile
    from pathlib import Path

    import other_commit

    with tempfile.TemporaryDirectory(prefix="engine-overhead-") as tmp:
        ref = other_commit.checkout(args.against, Path(tmp) / "ref")
        flags = ["--steps", str(args.steps), "--num-reqs", str(args.num_reqs)]
        flags += ["--churn"] if args.churn else []
        sides = {args.against: (other_commit.script(ref, "bench/engine_overhead.py"),
                                other_commit.env(ref)),
                 "this": (Path(__file__), dict(os.environ))}
        runs: dict[str, list[list[dict]]] = {side: [] for side in sides}
        loads = [os.getloadavg()[0]]
        for run in range(args.runs):
            for side, (path, environ) in sides.items():
                out = Path(tmp) / f"{run}-{len(runs[side])}-{side[:12]}.json"
                subprocess.run([sys.executable, str(path), *flags, "--json", str(out)],
                               env=environ, check=True, stdout=subprocess.DEVNULL)
                runs[side].append(json.loads(out.read_text())["results"])
            loads.append(os.getloadavg()[0])
    before, after = runs[args.against], runs["this"]
    print(f"engine-core CPU ms per step, median over {args.runs} alternating runs of each "
          f"run's median (schedule/update: median of the runs' means); load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(f"{'workload':>8} {'block':>6} {args.against[:12]:>12} {'this':>8} {'ratio':>6} "
          f"{'sched/upd before':>17} {'sched/upd this':>15}")
    summary = []
    for i, row in enumerate(before[0]):
        def med(side: list[list[dict]], key: str, i: int = i) -> float:
            return statistics.median(r[i][key] for r in side)

        b, a = med(before, "median_ms"), med(after, "median_ms")
        summary.append({"workload": row["workload"], "block_size": row["block_size"],
                        "before_ms": b, "after_ms": a, "ratio": a / b,
                        "before_runs": [r[i]["median_ms"] for r in before],
                        "after_runs": [r[i]["median_ms"] for r in after]})
        print(f"{row['workload']:>8} {row['block_size']:>6} {b:>12.3f} {a:>8.3f} {a / b:>6.2f} "
              f"{med(before, 'schedule_ms'):>8.3f}/{med(before, 'update_ms'):.3f} "
              f"{med(after, 'schedule_ms'):>8.3f}/{med(after, 'update_ms'):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"against": args.against, "load": loads, "results": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
