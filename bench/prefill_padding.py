"""What the oneDNN row rounding (runtime/model/linear.py ``padded_rows``, issue 36's memory
fix) costs a prefill: time to first token of one request, the rounding on and off, in one
run (alternating, so machine load hits both alike).

The rounding pads a step's rows up to one of ~8 sizes per doubling (<= 12.5% extra rows);
a prompt's prefill step is where that padding is paid in full. Each prompt length runs the
two modes in turn, ``--rounds`` times, through an in-process EngineCore on the qwen3 bench
checkpoint (float32, oneDNN-packed linears); reported: median TTFT per mode and the ratio.

    .venv/bin/python bench/prefill_padding.py [--lengths 300 700 1500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.model import linear
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest


@contextmanager
def rounding(on: bool) -> Iterator[None]:
    original = linear.padded_rows
    if not on:
        linear.padded_rows = lambda rows: rows  # type: ignore[assignment]
    try:
        yield
    finally:
        linear.padded_rows = original  # type: ignore[assignment]


def ttft_s(core: EngineCore, prompt: list[int], req_id: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to the first token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core.reset_prefix_cache()  # every round prefills the whole prompt
    started, cpu = time.perf_counter(), time.process_time()
    core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                       sampling_params=params))
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 700, 1500])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="bench", choices=["tiny", "small", "bench"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: CPU time is then a steadier figure than wall "
                             "time on a shared machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from shoal.runtime.model.make_model import cached_model

    model = cached_model("qwen3", args.size)
    longest = max(args.lengths)
    config = EngineConfig(model=str(model), max_num_seqs=4, num_kv_blocks=longest // 16 + 8,
                          max_num_batched_tokens=longest, max_model_len=longest + 16)
    core = EngineCore(config)
    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    print(f"qwen3 {args.size}, {args.threads} thread(s), one request per prefill (max_tokens=1), "
          f"{args.rounds} rounds per mode, alternating; median TTFT, wall and process CPU")
    print(f"{'prompt':>7}{'padded rows':>13}{'rounded ms':>12}{'exact ms':>10}{'ratio':>8}"
          f"{'rounded CPU ms':>16}{'exact CPU ms':>14}{'CPU ratio':>11}")
    try:
        for length in args.lengths:
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            for on in (True, False):  # warm both modes' primitives first
                with rounding(on):
                    ttft_s(core, prompt, f"warm-{length}-{on}")
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for i in range(args.rounds):
                for on in ((True, False) if i % 2 == 0 else (False, True)):
                    with rounding(on):
                        times[on].append(ttft_s(core, prompt, f"r{length}-{i}-{on}"))
            rounded, exact = (statistics.median(w for w, _ in times[m]) * 1e3
                              for m in (True, False))
            rounded_cpu, exact_cpu = (statistics.median(c for _, c in times[m]) * 1e3
                                      for m in (True, False))
            print(f"{length:>7}{linear.padded_rows(length):>13}{rounded:>12.1f}{exact:>10.1f}"
                  f"{rounded / exact:>8.3f}{rounded_cpu:>16.1f}{exact_cpu:>14.1f}"
                  f"{rounded_cpu / exact_cpu:>11.3f}")
    finally:
        core.shutdown()


if __name__ == "__main__":
    main()
