"""One model step on CPU, decode and prefill, against the CPU floor measured here.

Isolates the model side (Worker: model, attention, sampler) from the scheduler: the KV cache
is filled with random values and plans are written directly, so a decode step over long
contexts costs no prefill first. Prints, per step kind, milliseconds per step, the step's
floor (``bench/floor.py``: its matmul FLOPs at the matmul peak measured in the same run plus
its decode K/V bytes at the streaming read rate) and the floor's share of the step. For a
mixture of experts it also prints the routed experts' share of the step (wall time inside
every MoE block's experts, forward hooks) and their rate (``6 * tokens * k * H * I`` flops),
next to the measured matmul peak. The machine is shared: figures are noisy.

    .venv/bin/python bench/model_step.py [--arch llama] [--size bench] [--model-dir DIR]
        [--dtype float32] [--batch 128] [--context 400] [--prefill 4x512] [--threads 0]
        [--linears auto]

``--linears dense`` keeps the linear layers on the dense path (oneDNN, or linear_bf16_cpu)
where the loader would give them panels (``ops.panel_linears_here``): run both to compare.
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


class ExpertsClock:
    """Wall time spent inside the routed experts of every MoE block (FusedExperts), and the
    (token, expert) pairs they computed."""

    def __init__(self, model: torch.nn.Module) -> None:
        from shoal.runtime.model.moe import FusedExperts

        self.seconds, self.pairs, self._start = 0.0, 0, 0.0
        self.blocks = [m for m in model.modules() if isinstance(m, FusedExperts)]
        for block in self.blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, module, inputs) -> None:
        self._start = time.perf_counter()

    def _leave(self, module, inputs, output) -> None:
        self.seconds += time.perf_counter() - self._start
        self.pairs += inputs[1][1].numel()  # routing = (weights, ids [T, k])

    def reset(self) -> None:
        self.seconds, self.pairs = 0.0, 0


def timed(worker, plans: list[StepPlan], clock: ExpertsClock | None = None) -> float:
    worker.execute(plans[0])
    if clock is not None:
        clock.reset()
    start = time.perf_counter()
    for p in plans[1:]:
        worker.execute(p)
    return (time.perf_counter() - start) / (len(plans) - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--model-dir", default="",
                        help="a checkpoint to run instead of --arch/--size (e.g. "
                             "cached_moe_model('qwen3_moe', 'bench'))")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=128, help="decoding requests")
    parser.add_argument("--context", type=int, default=400, help="their context length")
    parser.add_argument("--prefill", default="4x512", help="REQUESTSxTOKENS in one step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--linears", default="auto", choices=["auto", "dense"])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linears == "dense":
        from shoal.runtime.model import ops

        ops.panel_linears_here = lambda: False  # read when the worker chooses its kernels
    from shoal.runtime.model.make_model import cached_model
    from shoal.runtime.worker.worker import Worker

    n_prefill, prefill_len = (int(x) for x in args.prefill.split("x"))
    model_dir = Path(args.model_dir) if args.model_dir else cached_model(args.arch, args.size)
    needed = max(args.batch * -(-args.context // BLOCK), n_prefill * -(-prefill_len // BLOCK))
    worker = Worker(EngineConfig(model=str(model_dir), device="cpu", dtype=args.dtype,
                                 block_size=BLOCK))
    worker.load_model()
    worker.init_kv_cache(needed)
    for k_cache, v_cache in worker.runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    mc = worker.model_config()
    choice = worker.runner.model.kernels.choice
    print(f"model {model_dir.name} in {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"linears {'panels' if choice.linear_panels else choice.linear}")
    clock = ExpertsClock(worker.runner.model)
    moe = mc.moe if clock.blocks else None

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
    floor = Floor.measure(mc, torch.get_num_threads(), dtype=getattr(torch, args.dtype))
    print(floor.describe())
    print(f"{'step':<24} {'ms/step':>9} {'floor ms':>9} {'matmul ms':>10} {'K/V ms':>7} "
          f"{'share':>7}")
    experts_lines = []
    for name, plans, work in cases:
        seconds = timed(worker, plans, clock)
        compute_s, kv_s = floor.split(work)
        print(f"{name:<24} {seconds * 1e3:>9.1f} {(compute_s + kv_s) * 1e3:>9.1f} "
              f"{compute_s * 1e3:>10.1f} {kv_s * 1e3:>7.1f} "
              f"{100 * (compute_s + kv_s) / seconds:>6.1f}%")
        if moe is not None:
            steps = len(plans) - 1
            flops = 6 * clock.pairs * mc.hidden_size * moe.intermediate_size
            experts_lines.append(
                f"  {name}: routed experts {clock.seconds / steps * 1e3:.1f} ms of "
                f"{seconds * 1e3:.1f} ({100 * clock.seconds / steps / seconds:.0f}% of the "
                f"step) in {len(clock.blocks)} blocks, {flops / clock.seconds / 1e9:.1f} GFLOP/s")
    if experts_lines:
        print(f"routed experts ({clock.blocks[0].impl}; matmul peak above):")
        print("\n".join(experts_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
