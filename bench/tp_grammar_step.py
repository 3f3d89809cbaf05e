"""TP = 2: what a structured request's grammar costs the step that first runs it, with the
grammar shipped per request (serialized on the step, decoded by every rank: the way before
runtime/executor/grammar_shipping.py) and shipped once (serialized by the compile, sent the
first time only), in one run.

A TP=2 EngineCore over a qwen3 checkpoint gets ``--requests`` structured requests sharing
one JSON schema, added one per step beside ``--background`` plain decoding requests, so
that most steps carry one new structured request. Reported per mode: median and mean
executor time of the steps with a new structured request and of the steps without one
(the difference is what the grammar costs the step), and the core-side time spent
attaching grammars to plans.

    .venv/bin/python bench/tp_grammar_step.py [--requests 24] [--size tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.executor import grammar_shipping
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.structured.spec import GrammarSpec
from shoal.runtime.wire.messages import EngineCoreRequest
from shoal.runtime.wire.plan import StepPlan, StepResult

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["alpha", "beta", "gamma"]}}, "required": ["name", "age"]}


class PerRequest(grammar_shipping.ShippedGrammars):
    """The old behaviour: every plan naming a grammar carries it."""

    def must_send(self, spec: GrammarSpec, memory_bytes: int) -> bool:
        return True


def run(model: str, once: bool, requests: int, background: int) -> dict[str, list[float]]:
    config = EngineConfig(model=model, tensor_parallel_size=2, max_num_seqs=background + 8,
                          num_kv_blocks=256, max_num_batched_tokens=256)
    core = EngineCore(config)
    executor = core.executor
    backend = executor.grammar_backend()  # type: ignore[attr-defined]
    if not once:  # serialize on the step, every time, as before
        backend.serialize_on_compile = False
        executor._shipped = PerRequest()  # type: ignore[attr-defined]
        def fresh(spec: GrammarSpec) -> str:
            return str(backend.compiled(spec).serialize_json())

        backend.serialized = fresh  # type: ignore[method-assign]
    times: dict[str, list[float]] = {"with grammar": [], "without": [], "attach": [],
                                     "bytes": []}
    execute = executor.execute
    attach = grammar_shipping.with_compiled_grammars

    def timed_attach(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = attach(*args, **kwargs)
        times["attach"].append((time.perf_counter() - t0) * 1e3)
        times["bytes"] += [len(n.compiled_grammar or "") for n in out.new_requests]
        return out

    def timed(plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        result = execute(plan)
        has = any(n.sampling_params.structured is not None for n in plan.new_requests)
        times["with grammar" if has else "without"].append((time.perf_counter() - t0) * 1e3)
        return result

    executor.execute = timed  # type: ignore[method-assign]
    import shoal.runtime.executor.multiproc as mp

    mp.with_compiled_grammars = timed_attach  # type: ignore[assignment]
    spec = GrammarSpec(kind="json", source=json.dumps(SCHEMA), param="response_format")
    try:
        for i in range(background):
            core.add_request(EngineCoreRequest(
                request_id=f"bg{i}", prompt_token_ids=[5 + i, 6, 7, 8],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=requests * 6,
                                               ignore_eos=True)))
        for _ in range(3):
            core.step()
        for i in range(requests):
            core.add_request(EngineCoreRequest(
                request_id=f"s{i}", prompt_token_ids=[9, 10 + i, 11],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=4,
                                               structured=spec)))
            for _ in range(2):  # admitted once its (cached) grammar is ready, then run
                core.step()
        while core.has_unfinished_requests():
            core.step()
    finally:
        mp.with_compiled_grammars = attach  # type: ignore[assignment]
        core.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--background", type=int, default=4)
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "bench"])
    args = parser.parse_args()
    from shoal.runtime.model.make_model import cached_model

    model = str(cached_model("qwen3", args.size))
    results = {}
    for name, once in (("per request (before)", False), ("once (now)", True),
                       ("per request (before) ", False), ("once (now) ", True)):
        results[name] = run(model, once, args.requests, args.background)
    print(f"\nTP=2, qwen3 {args.size}, {args.requests} JSON-schema requests one per step beside "
          f"{args.background} decoding; executor ms per step")
    print(f"{'grammar shipped':<24}{'steps w/ new':>13}{'median':>8}{'mean':>8}"
          f"{'others median':>15}{'attach ms total':>17}{'JSON KB sent':>14}")
    for name, t in results.items():
        w, o = t["with grammar"], t["without"]
        print(f"{name:<24}{len(w):>13}{statistics.median(w):>8.1f}{statistics.mean(w):>8.1f}"
              f"{statistics.median(o):>15.1f}{sum(t['attach']):>17.1f}"
              f"{sum(t['bytes']) / 1e3:>14.1f}")


if __name__ == "__main__":
    main()
