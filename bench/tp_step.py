"""Tensor parallelism on CPU: how big a step plan is on the wire, and TP=1 vs TP=2 step time.

1. Plan size. 256 requests (prompts 64..512 tokens, half sharing a 128-token system prompt)
   go through the real scheduler until all decode together; every plan is encoded with the
   TP wire codec and, as the peer, pickled whole (what a plain multiprocessing queue would
   send). Reported: bytes per step for steady 256-request decode steps and for the prefill
   steps before them.
2. Step time. The bench model (qwen3 "bench") served by EngineCore at TP=1 in process, TP=1
   in one rank process (same compute: the difference is the process boundary) and TP=2 (two
   gloo ranks); executor time per prefill step and per decode step. Informational: 2 shared
   cores, where TP=2 splits the same cores between ranks and adds all-reduces.

    .venv/bin/python bench/tp_step.py [--decode-batch 16] [--decode-steps 24]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

from engine_overhead import (
    VOCAB,
    NullExecutor,  # bench/ is on sys.path when run as a script
)
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest
from shoal.runtime.wire.plan import StepPlan, StepResult
from shoal.runtime.wire.plan_codec import PlanDecoder, PlanEncoder


class MeasuringExecutor(NullExecutor):
    """No model: encodes every plan like the TP executor does and records the sizes."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.encoder = PlanEncoder(block_size)
        self.decoder = PlanDecoder(block_size)  # what every rank runs
        # (reqs, tokens, wire, wire from a fresh codec = no deltas, no interned ids, pickle)
        self.sizes: list[tuple[int, int, int, int, int]] = []
        self.codec_us: list[tuple[int, int, float, float]] = []  # (reqs, tokens, enc, dec)

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        data = self.encoder.encode(plan)
        t1 = time.perf_counter()
        self.decoder.decode(data)
        t2 = time.perf_counter()
        self.codec_us.append((plan.num_reqs, plan.num_tokens, (t1 - t0) * 1e6, (t2 - t1) * 1e6))
        wire = len(data)
        fresh = len(PlanEncoder(self.encoder.block_size).encode(plan))
        self.sizes.append((plan.num_reqs, plan.num_tokens, wire, fresh,
                           len(pickle.dumps(plan))))
        return super().execute(plan)


def plan_sizes(num_reqs: int = 256, decode_steps: int = 64) -> None:
    rng = random.Random(0)
    system = [rng.randrange(1, VOCAB) for _ in range(128)]
    config = EngineConfig(model="(none)", max_num_seqs=num_reqs, num_kv_blocks=16_384,
                          max_num_batched_tokens=8192)
    executor = MeasuringExecutor(config.block_size)
    core = EngineCore(config, executor)
    for i in range(num_reqs):
        length = rng.randint(64, 512)
        prompt = (system if i % 2 else [])[:length]
        prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(length - len(prompt))]
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 64, ignore_eos=True)
        core.add_request(EngineCoreRequest(request_id=f"cmpl-{rng.getrandbits(128):032x}-0",
                                           prompt_token_ids=prompt, sampling_params=params))
    while True:
        core.step()
        reqs, tokens, *_ = executor.sizes[-1]
        if reqs == num_reqs and tokens == num_reqs:
            break
    for _ in range(decode_steps):
        core.step()
    decode = [s for s in executor.sizes if s[0] == s[1] == num_reqs]
    prefill = [s for s in executor.sizes if s[1] > s[0]]
    print(f"\nStep plan on the wire ({num_reqs} requests, block size {config.block_size})")
    print(f"{'steps':<30}{'n':>4}{'wire B':>10}{'no-delta B':>12}{'pickle B':>11}"
          f"{'pickle/wire':>13}")
    for name, rows in (("decode, 256 requests", decode), ("prefill (new requests)", prefill)):
        wire, fresh, pick = (statistics.mean(r[i] for r in rows) for i in (2, 3, 4))
        print(f"{name:<30}{len(rows):>4}{wire:>10,.0f}{fresh:>12,.0f}{pick:>11,.0f}"
              f"{pick / wire:>13.1f}")
    steady_max = max(r[2] for r in decode)
    codec = [c for c in executor.codec_us if c[0] == c[1] == num_reqs]
    print(f"decode max {steady_max:,} B/step; codec per decode step (median): encode "
          f"{statistics.median(c[2] for c in codec):.0f} us, decode "
          f"{statistics.median(c[3] for c in codec):.0f} us")


def step_times(tp: int, batch: int, decode_steps: int, in_process: bool, size: str
               ) -> tuple[float, float, float]:
    from shoal.runtime.executor.multiproc import MultiprocExecutor
    from shoal.runtime.model.make_model import cached_model

    model = cached_model("qwen3", size)
    config = EngineConfig(model=str(model), tensor_parallel_size=tp, max_num_seqs=batch,
                          num_kv_blocks=batch * 16, max_num_batched_tokens=512)
    start = time.perf_counter()
    # TP=1 twice: in process (what it uses) and in one rank process (the IPC cost alone)
    core = EngineCore(config) if in_process else EngineCore(config, MultiprocExecutor(config))
    startup = time.perf_counter() - start
    prefill_ms: list[float] = []
    decode_ms: list[float] = []
    execute = core.executor.execute

    def timed(plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        result = execute(plan)
        (decode_ms if plan.num_tokens == plan.num_reqs else prefill_ms).append(
            (time.perf_counter() - t0) * 1e3)
        return result

    core.executor.execute = timed  # type: ignore[method-assign]
    rng = random.Random(1)
    for i in range(batch):
        vocab = core.model_config.vocab_size
        prompt = [rng.randrange(3, vocab) for _ in range(128)]
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                           sampling_params=params))
    try:
        while core.has_unfinished_requests():
            core.step()
        if not in_process:  # the bare round trip to every rank and back (PING/PONG)
            pings = []
            for _ in range(200):
                t0 = time.perf_counter()
                core.executor.check_health()
                pings.append((time.perf_counter() - t0) * 1e6)
            print(f"TP={tp} rank processes: health-check round trip median "
                  f"{statistics.median(pings):.0f} us, p90 "
                  f"{statistics.quantiles(pings, n=10)[-1]:.0f} us")
    finally:
        core.shutdown()
    steady = decode_ms[2:]  # the first decode steps still warm caches
    return statistics.median(prefill_ms), statistics.median(steady), startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--size", default="bench", choices=["tiny", "small", "bench"],
                        help="qwen3 checkpoint size (tiny: the process-boundary cost shows)")
    parser.add_argument("--skip-model", action="store_true", help="plan sizes only")
    args = parser.parse_args()
    plan_sizes()
    if args.skip_model:
        return
    setups = {"TP=1 in process": (1, True), "TP=1, 1 rank process": (1, False),
              "TP=2, 2 rank processes": (2, False)}
    results = {name: step_times(tp, args.decode_batch, args.decode_steps, in_process, args.size)
               for name, (tp, in_process) in setups.items()}
    print(f"\nStep time, qwen3 {args.size} model on CPU, {args.decode_batch} requests x 128-token "
          f"prompts (median ms; prefill steps of <= 512 tokens)")
    print(f"{'executor':<24}{'prefill ms/step':>17}{'decode ms/step':>16}{'startup s':>11}")
    for name, (prefill, decode, startup) in results.items():
        print(f"{name:<24}{prefill:>17.1f}{decode:>16.1f}{startup:>11.1f}")
    p1, d1, _ = results["TP=1 in process"]
    pp, dp, _ = results["TP=1, 1 rank process"]
    p2, d2, _ = results["TP=2, 2 rank processes"]
    print(f"rank process / in process: decode +{dp - d1:.1f} ms/step (plan out, result back)")
    print(f"TP=2 / TP=1: prefill {p2 / p1:.2f}x, decode {d2 / d1:.2f}x (time; < 1 is faster)")


if __name__ == "__main__":
    main()
