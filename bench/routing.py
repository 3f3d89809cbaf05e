"""Routing benchmark: one loopback fleet, four routers side by side, one shared-prefix workload.

4 engines (`shoal serve`, small model, KV events on) and four routers over the same engines:
round-robin, least-load, cache-affinity approximate (text prefixes) and cache-affinity
precise (engine tokenizer + KV events). Each router gets the same workload shape with its
own fresh system prompts (so nothing cached by an earlier run helps a later one):
S long system prompts x U users, T turns each (each turn carries the conversation so far),
C requests in flight. Per router it reports the fleet's prefix-cache hit rate (token
counters from the engines' /metrics, delta over the run), TTFT p50/p99, throughput, and
in-flight balance (time-averaged in-flight per replica from the router's /metrics:
max/mean), then the router's overhead: p50 latency of tiny requests via router minus direct.

Numbers on a 2-core machine with 4 engines sharing it are noisy: compare within one run.

    .venv/bin/python bench/routing.py [--replicas 4] [--systems 8] [--users 24] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from shoal.runtime.router.engine_metrics import parse_engine_metrics, parse_samples
from shoal.runtime.router.local_fleet import FleetConfig, LocalFleet, engine_host

WORDS = ("ship harbor cargo tide anchor route crane berth manifest pilot ledger customs "
         "freight vessel dock weather schedule container invoice captain").split()


@dataclass
class RunResult:
    name: str
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    wall: float = 0.0
    hit_rate: float = 0.0
    balance: float = 0.0
    affinity_hits: float = 0.0


def system_prompt(run: str, index: int, words: int, rng: random.Random) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[{run}] You are assistant #{index} of the port authority. Policy: {body}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def stream_chat(client: httpx.AsyncClient, router: str, messages: list[dict],
                      max_tokens: int, result: RunResult) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    async with client.stream("POST", f"{router}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread())[:300]
            if not result.errors:
                print(f"  first error: {response.status_code} {detail!r}", flush=True)
            result.errors += 1
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
            if delta:
                if first is None:
                    first = time.perf_counter() - start
                pieces.append(delta)
                result.output_tokens += 1
    result.ttft.append(first if first is not None else time.perf_counter() - start)
    result.e2e.append(time.perf_counter() - start)
    return "".join(pieces)


async def fleet_prefix_counters(client: httpx.AsyncClient, engines: list[str]) -> tuple[float,
                                                                                     float]:
    queries = hits = 0.0
    for url in engines:
        m = parse_engine_metrics((await client.get(f"{url}/metrics")).text)
        queries += m.prefix_cache_queries
        hits += m.prefix_cache_hits
    return queries, hits


async def sample_in_flight(client: httpx.AsyncClient, router: str, engines: list[str],
                           totals: dict[str, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        text = (await client.get(f"{router}/metrics")).text
        for line in text.splitlines():
            if line.startswith("shoal:router_in_flight{"):
                url = line.split('replica="', 1)[1].split('"', 1)[0]
                totals[url] = totals.get(url, 0.0) + float(line.rsplit(" ", 1)[1])
        await asyncio.sleep(0.05)


async def run_workload(name: str, router: str, engines: list[str], args: argparse.Namespace,
                       seed: int) -> RunResult:
    rng = random.Random(seed)
    result = RunResult(name)
    systems = [system_prompt(name, i, args.system_words, rng) for i in range(args.systems)]
    users = [(rng.randrange(args.systems), u) for u in range(args.users)]
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        q0, h0 = await fleet_prefix_counters(client, engines)
        gate = asyncio.Semaphore(args.concurrency)
        totals: dict[str, float] = {}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_in_flight(client, router, engines, totals, stop))

        async def conversation(system_index: int, user: int) -> None:
            await asyncio.sleep(user * args.arrival_gap)  # users arrive over time
            messages = [{"role": "system", "content": systems[system_index]}]
            for turn in range(args.turns):
                question = " ".join(rng.choice(WORDS) for _ in range(12))
                messages.append({"role": "user", "content": f"user {user} turn {turn}: "
                                                            f"{question}?"})
                async with gate:
                    answer = await stream_chat(client, router, messages, args.max_tokens, result)
                messages.append({"role": "assistant", "content": answer})

        start = time.perf_counter()
        await asyncio.gather(*(conversation(s, u) for s, u in users))
        result.wall = time.perf_counter() - start
        stop.set()
        await sampler
        await asyncio.sleep(1.5)  # engines' counters are final; let a scrape see them
        q1, h1 = await fleet_prefix_counters(client, engines)
        result.hit_rate = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        averages = [totals.get(url, 0.0) for url in engines]
        result.balance = max(averages) / statistics.mean(averages) if sum(averages) else 1.0
        samples = parse_samples((await client.get(f"{router}/metrics")).text)
        result.affinity_hits = samples.get("shoal:router_affinity_hits_total", 0.0)
    return result


async def overhead(router: str, engine: str, n: int, router_pid: int) -> tuple[float, float,
                                                                              float]:
    """p50 latency direct and via the router, and the router's CPU seconds per request."""
    import psutil

    process = psutil.Process(router_pid)
    body = {"prompt": "hello", "max_tokens": 1, "temperature": 0.0}
    direct: list[float] = []
    routed: list[float] = []
    async with httpx.AsyncClient(timeout=60.0) as client:
        for _ in range(3):  # warm connections on both paths
            await client.post(f"{engine}/v1/completions", json=body)
            await client.post(f"{router}/v1/completions", json=body)
        cpu_before, start = sum(process.cpu_times()[:2]), time.perf_counter()
        for _ in range(n):
            for url, into in ((engine, direct), (router, routed)):
                start = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                into.append(time.perf_counter() - start)
                r.raise_for_status()
        busy_cpu, busy_s = sum(process.cpu_times()[:2]) - cpu_before, time.perf_counter() - start
        idle_before = sum(process.cpu_times()[:2])  # background work (polls, scrapes) alone
        await asyncio.sleep(busy_s)
        idle_cpu = sum(process.cpu_times()[:2]) - idle_before
        cpu = max(busy_cpu - idle_cpu, 0.0) / n
    return statistics.median(direct), statistics.median(routed), cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--model", default=None, help="default: the cached small qwen3")
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--arrival-gap", type=float, default=0.25,
                        help="seconds between users' first requests")
    parser.add_argument("--num-kv-blocks", type=int, default=96,
                        help="per engine: room for a share of the system prompts, not all")
    parser.add_argument("--approx-capacity", type=int, default=0,
                        help="the approximate router's --approx-capacity (0: its default)")
    parser.add_argument("--overhead-requests", type=int, default=200)
    parser.add_argument("--base-port", type=int, default=18100)
    parser.add_argument("--engine-args", default="")
    parser.add_argument("--only", action="append", default=[],
                        help="run only this policy row (repeatable; the first is the baseline)")
    args = parser.parse_args()

    from shoal.runtime.model.make_model import cached_model

    model = args.model or str(cached_model("qwen3", "small"))
    logs = Path(tempfile.mkdtemp(prefix="shoal-bench-routing-"))
    engine_args = ["--num-kv-blocks", str(args.num_kv_blocks), *args.engine_args.split()]
    config = FleetConfig(replicas=args.replicas, model=model, port=args.base_port,
                         engine_port=args.base_port + 1, engine_args=engine_args,
                         kv_events=True, kv_events_port=args.base_port + 2,
                         router_args=["--policy", "cache-affinity", "--tokenizer", model,
                                      "--scrape-interval", "0.5"],
                         log_dir=logs, ready_timeout=900)
    engines = config.engine_urls()
    print(f"starting {args.replicas} engines ({engines[0]} ...), logs in {logs}", flush=True)
    with LocalFleet(config) as fleet:
        routers = {"cache-affinity precise": config.router_url}
        approx_flags = (["--approx-capacity", str(args.approx_capacity)]
                        if args.approx_capacity else [])
        for offset, (name, flags) in enumerate([
                ("round-robin", ["--policy", "round-robin"]),
                ("least-load", ["--policy", "least-load"]),
                ("cache-affinity approx", ["--policy", "cache-affinity", *approx_flags])]):
            routers[name] = fleet.add_router(args.base_port + 10 + offset,
                                             [*flags, "--scrape-interval", "0.5"])
        order = [n for n in ("round-robin", "least-load", "cache-affinity approx",
                             "cache-affinity precise") if not args.only or n in args.only]
        results = []
        for i, name in enumerate(order):
            print(f"running {name} ...", flush=True)
            results.append(asyncio.run(run_workload(name, routers[name], engines, args, i)))
        # a router in front of engine 0 alone: direct and routed hit the same engine
        single = fleet.add_router(args.base_port + 20, ["--policy", "cache-affinity"],
                                  backends=engines[:1])
        direct_p50, routed_p50, router_cpu = asyncio.run(
            overhead(single, engines[0], args.overhead_requests, fleet.extra_routers[-1].pid))

    base = results[0]
    n_req = args.users * args.turns
    print(f"\nworkload: {args.systems} system prompts (~{args.system_words} words) x "
          f"{args.users} users x {args.turns} turns = {n_req} chat requests, "
          f"max_tokens {args.max_tokens}, concurrency {args.concurrency}, "
          f"a user every {args.arrival_gap}s, "
          f"{args.replicas} engines x {args.num_kv_blocks} KV blocks ({engine_host(0)}..)")
    header = (f"{'policy':<24}{'hit rate':>9}{'x RR':>6}{'TTFT p50':>10}{'x RR':>6}"
              f"{'TTFT p99':>10}{'req/s':>8}{'max/mean':>10}{'aff.hits':>9}{'errors':>7}")
    print(header)
    print("-" * len(header))
    for r in results:
        p50 = percentile(r.ttft, 0.5)
        print(f"{r.name:<24}{r.hit_rate:>9.3f}"
              f"{(r.hit_rate / base.hit_rate if base.hit_rate else float('nan')):>6.2f}"
              f"{p50 * 1000:>8.0f}ms{p50 / percentile(base.ttft, 0.5):>6.2f}"
              f"{percentile(r.ttft, 0.99) * 1000:>8.0f}ms{len(r.e2e) / r.wall:>8.2f}"
              f"{r.balance:>10.2f}{r.affinity_hits:>9.0f}{r.errors:>7}")
    print(f"\nrouter overhead (cache-affinity router over engine 0 vs engine 0 direct, tiny "
          f"completion, sequential, alternating, {args.overhead_requests} each): "
          f"direct p50 {direct_p50 * 1000:.2f} ms, via router p50 {routed_p50 * 1000:.2f} ms, "
          f"overhead {(routed_p50 - direct_p50) * 1000:.2f} ms; router CPU "
          f"{router_cpu * 1000:.2f} ms per request (its idle polling subtracted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
