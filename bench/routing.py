"""Routing benchmark: round-robin vs cache affinity, each router started with exactly the
flags the operator renders (``operator/render/router.py``), on one loopback fleet.

N engines (`shoal serve`, small model, KV events on as the operator deploys them) and two
routers over the same engines: round-robin and cache-affinity (the operator's default
routing: precise mode, the tokenizer fetched from an engine, KV events followed). The
machine is shared and noisy, so the policies run interleaved, round by round (RR, affinity,
RR, affinity, ...), each run with fresh system prompts (nothing cached by an earlier run
helps a later one); the load average is printed before each run.

Workload per run: P long system prompts, U users (conversations) each on a random one of
them, T turns per conversation (each turn carries the conversation so far); C closed-loop
clients each send the next turn of a random open conversation, O open conversations at a
time (users mid-conversation: the turns of many users interleave, as in a chat service),
so exactly C requests are in flight. Random picks matter: a client that ran one
conversation turn after turn would make round-robin sticky by accident (C a multiple of N:
every turn of a client's conversation lands on the same replica).

Reported per policy, over all its rounds: the fleet's prefix-cache hit rate (token counters
from the engines' /metrics, delta over its runs), TTFT p50/p99, throughput, in-flight
balance (time-averaged in-flight per replica from the router's /metrics: max/mean); where
the prompt tokens missed, per request class (cold system prompt, first turn of a system
prompt sent before, follow-up turn: the engines' usage.cached_tokens), the router's spills
by reason (placements away from the replica believed to hold most of the prefix) and each
engine's share of the prompt tokens, hit rate and preemptions; then the router's overhead:
p50 latency of tiny requests via router minus direct. ``--trace`` writes every request.

What bounds the hit rates, on paper (B = 16-token blocks; s = a system prompt's full
blocks; L_t = the prompt of turn t; C_kv = KV blocks per engine):
- cache affinity, at best (every request where its prefix is, nothing evicted): each
  system prompt misses once, every turn misses what is new since the last one (the last
  answer, the new question, the partial last block):
  ceiling = 1 - (P s B + U sum_t new_t) / (U sum_t L_t);
- round-robin: a follow-up finds its own conversation with probability 1/N; otherwise,
  like a first turn, only the system prompt, which each engine holds with probability
  r = C_kv / (P s) (every engine cycles through all P prompts):
  RR ~ (sum_first r s B + sum_follow [L_{t-1} / N + (1 - 1/N) r s B]) / sum_t L_t.
The defaults are chosen from the cache size: with 300-word system prompts (~920 tokens,
s = 57) and 24 of them on 6 engines of 320 blocks, each engine's share of the prompts
(4 x 57 = 228 blocks) and its open conversations (24 / 6 = 4, up to ~17 blocks each past
the system prompt by the last turn) fit (~296 blocks), while the prompt set (1368 blocks)
is 4.3 caches: r = 0.23. Measured token counts (turn prompts ~977, 1043, 1109, 1175
tokens, 96 users) give a ceiling of 0.88 and RR ~ 0.28: the ratio can reach ~3.1. Why 6
replicas: when each engine's share fits, r >= (1 + room) / N, and RR's own-conversation
term is 1/N of every follow-up: with 3 replicas r >= 1/3 and RR stays near 0.4-0.5 on a
chat workload dominated by its system prompts, the ratio near 2 (the earlier default, 3
engines x 320 blocks, 24 prompts of ~470 tokens: 1.59-1.71x measured with the earlier
policy, 1.63x with this one: affinity 0.805 of a ~0.83 ceiling, round-robin 0.493).

    .venv/bin/python bench/routing.py [--replicas 6] [--systems 24] [--users 96] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from shoal.operator.names import Owner
from shoal.operator.render.router import router_args
from shoal.operator.spec.service import parse_spec
from shoal.runtime.router.local.fleet import (
    FleetConfig,
    LocalFleet,
    engine_host,
    loopback_router_args,
)

from shoal.contract.metrics import parse_engine_metrics, parse_samples

WORDS = ("ship harbor cargo tide anchor route crane berth manifest pilot ledger customs "
         "freight vessel dock weather schedule container invoice captain").split()


@dataclass(frozen=True)
class TraceRecord:
    """One chat request, for --trace (seconds from the run's start)."""
    run: int
    system: int
    user: int
    turn: int
    kind: str
    sent: float
    done: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Conversation:
    system: int
    user: int
    messages: list[dict]
    turn: int = 0  # turns sent so far


@dataclass
class RunResult:
    name: str
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    wall: float = 0.0
    queries: float = 0.0  # prefix-cache token counters of the fleet, summed over runs
    hits: float = 0.0
    in_flight: dict[str, float] = field(default_factory=dict)  # summed samples per replica
    affinity_hits: float = 0.0
    spills: float = 0.0  # router counters: placements away from the best-believed replica
    spilled_blocks: float = 0.0
    spills_by_reason: dict[str, tuple[float, float]] = field(default_factory=dict)  # n, blocks
    # per request class: [requests, prompt tokens, cached tokens] from the engines' usage
    classes: dict[str, list[int]] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)  # 1-min load average before each run
    # per engine: [queried tokens, hit tokens, preemptions]
    per_engine: dict[str, list[float]] = field(default_factory=dict)
    trace: list[TraceRecord] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def balance(self) -> float:
        values = list(self.in_flight.values())
        return max(values) / statistics.mean(values) if values and sum(values) else 1.0


def system_prompt(run: str, index: int, words: int, rng: random.Random) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[{run}] You are assistant #{index} of the port authority. Policy: {body}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# why a request may miss: its system prompt never sent before in this run (cold, nothing
# can hit), a first turn whose system prompt was sent before, a follow-up turn (the whole
# conversation so far was sent before)
CLASSES = ("cold system", "first turn", "follow-up")


async def stream_chat(client: httpx.AsyncClient, router: str, messages: list[dict],
                      max_tokens: int, result: RunResult, kind: str) -> tuple[str, int, int]:
    """The answer's text, and the engine's prompt tokens and cached prompt tokens."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    prompt_tokens = cached_tokens = 0
    async with client.stream("POST", f"{router}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread())[:300]
            if not result.errors:
                print(f"  first error: {response.status_code} {detail!r}", flush=True)
            result.errors += 1
            return "", 0, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
                cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0)
                tally = result.classes.setdefault(kind, [0, 0, 0])
                tally[0] += 1
                tally[1] += prompt_tokens
                tally[2] += cached_tokens
            if not chunk.get("choices"):
                continue
            delta = chunk["choices"][0].get("delta", {}).get("content")
            if delta:
                if first is None:
                    first = time.perf_counter() - start
                pieces.append(delta)
                result.output_tokens += 1
    result.ttft.append(first if first is not None else time.perf_counter() - start)
    result.e2e.append(time.perf_counter() - start)
    return "".join(pieces), prompt_tokens, cached_tokens


async def engine_prefix_counters(client: httpx.AsyncClient, engines: list[str]
                                 ) -> dict[str, tuple[float, float, float]]:
    """Per engine: (prefix-cache queried tokens, hit tokens, preemptions), counters since it
    started."""
    counters = {}
    for url in engines:
        text = (await client.get(f"{url}/metrics")).text
        m = parse_engine_metrics(text)
        preemptions = parse_samples(text).get("shoal:num_preemptions_total", 0.0)
        counters[url] = (m.prefix_cache_queries, m.prefix_cache_hits, preemptions)
    return counters


async def sample_in_flight(client: httpx.AsyncClient, router: str, engines: list[str],
                           totals: dict[str, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        text = (await client.get(f"{router}/metrics")).text
        for line in text.splitlines():
            if line.startswith("shoal:router_in_flight{"):
                url = line.split('replica="', 1)[1].split('"', 1)[0]
                totals[url] = totals.get(url, 0.0) + float(line.rsplit(" ", 1)[1])
        await asyncio.sleep(0.05)


def spills_by_reason(router_metrics: str) -> dict[str, tuple[float, float]]:
    """The router's spill counters per reason: (spills, blocks given up); lifetime totals."""
    found: dict[str, list[float]] = {}
    for line in router_metrics.splitlines():
        for slot, name in enumerate(("shoal:router_affinity_spills_total{",
                                     "shoal:router_affinity_spilled_blocks_total{")):
            if line.startswith(name):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                found.setdefault(reason, [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {reason: (n, blocks) for reason, (n, blocks) in found.items()}


def operator_flags(policy: str, block_size: int) -> tuple[list[str], bool]:
    """The router flags the operator renders for this policy, as a loopback fleet's."""
    spec = parse_spec({"model": {"uri": "/opt/model"}, "runtime": {"blockSize": block_size},
                       "routing": {"policy": policy}})
    return loopback_router_args(router_args(Owner("bench", "default", "uid-bench"), spec))


async def run_workload(result: RunResult, router: str, engines: list[str],
                       args: argparse.Namespace, seed: int) -> None:
    rng = random.Random(seed)
    name = f"{result.name} {seed}"
    result.load.append(os.getloadavg()[0])
    systems = [system_prompt(name, i, args.system_words, rng) for i in range(args.systems)]
    users = [(rng.randrange(args.systems), u) for u in range(args.users)]
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        before = await engine_prefix_counters(client, engines)
        totals: dict[str, float] = {}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_in_flight(client, router, engines, totals, stop))

        systems_sent: set[int] = set()
        waiting = list(reversed(users))  # conversations not started yet, next one last
        ready: list[Conversation] = []  # open conversations whose next turn may be sent
        busy = [0]  # open conversations with a turn in flight
        picker = random.Random(seed + 1)

        async def send_turn(chat: Conversation) -> None:
            question = " ".join(rng.choice(WORDS) for _ in range(12))
            chat.messages.append({"role": "user", "content": f"user {chat.user} turn "
                                                             f"{chat.turn}: {question}?"})
            kind = CLASSES[2] if chat.turn else CLASSES[1] if chat.system in systems_sent \
                else CLASSES[0]
            systems_sent.add(chat.system)
            sent = time.perf_counter() - start
            answer, prompt, cached = await stream_chat(
                client, router, chat.messages, args.max_tokens, result, kind)
            result.trace.append(TraceRecord(seed, chat.system, chat.user, chat.turn, kind,
                                            sent, time.perf_counter() - start, prompt, cached))
            chat.messages.append({"role": "assistant", "content": answer})
            chat.turn += 1

        async def chat_client(index: int) -> None:
            """A closed-loop client: sends the next turn of a random open conversation, one
            request at a time, so C requests are in flight once every client has started;
            a finished conversation is replaced by the next user's while users are left."""
            await asyncio.sleep(index * args.arrival_gap)
            while True:
                while waiting and len(ready) + busy[0] < args.open_conversations:
                    system_index, user = waiting.pop()
                    ready.append(Conversation(system_index, user, [
                        {"role": "system", "content": systems[system_index]}]))
                if not ready:
                    if not waiting and not busy[0]:
                        return
                    await asyncio.sleep(0.01)  # every open conversation has a turn in flight
                    continue
                chat = ready.pop(picker.randrange(len(ready)))
                busy[0] += 1
                try:
                    await send_turn(chat)
                finally:
                    busy[0] -= 1
                if chat.turn < args.turns:
                    ready.append(chat)

        start = time.perf_counter()
        await asyncio.gather(*(chat_client(i) for i in range(args.concurrency)))
        result.wall += time.perf_counter() - start
        stop.set()
        await sampler
        await asyncio.sleep(1.5)  # engines' counters are final; let a scrape see them
        after = await engine_prefix_counters(client, engines)
        for url in engines:
            queries, hits, preemptions = (
                a - b for a, b in zip(after[url], before[url], strict=True))
            result.queries += queries
            result.hits += hits
            tally = result.per_engine.setdefault(url, [0.0, 0.0, 0.0])
            tally[0] += queries
            tally[1] += hits
            tally[2] += preemptions
        for url in engines:
            result.in_flight[url] = result.in_flight.get(url, 0.0) + totals.get(url, 0.0)
        samples = parse_samples((await client.get(f"{router}/metrics")).text)
        result.affinity_hits = samples.get("shoal:router_affinity_hits_total", 0.0)
        result.spills = samples.get("shoal:router_affinity_spills_total", 0.0)
        result.spilled_blocks = samples.get("shoal:router_affinity_spilled_blocks_total", 0.0)
        result.spills_by_reason = spills_by_reason((await client.get(f"{router}/metrics")).text)


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
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--model", default=None, help="default: the cached small qwen3")
    parser.add_argument("--systems", type=int, default=24)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--users", type=int, default=96)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--open-conversations", type=int, default=None,
                        help="users mid-conversation at a time (default: 2 x concurrency)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per policy, interleaved (RR, affinity, RR, ...)")
    parser.add_argument("--arrival-gap", type=float, default=0.25,
                        help="seconds between the clients' starts (a ramp, then C in flight)")
    parser.add_argument("--num-kv-blocks", type=int, default=320,
                        help="per engine: room for its share of the system prompts (24 x 57 "
                             "blocks / 6) and its open conversations, not for all the prompts")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--overhead-requests", type=int, default=200)
    parser.add_argument("--base-port", type=int, default=18100)
    parser.add_argument("--engine-args", default="")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write every chat request (JSON lines) to this file")
    args = parser.parse_args()
    if args.open_conversations is None:
        args.open_conversations = 2 * args.concurrency
    if args.open_conversations < args.concurrency:
        parser.error("--open-conversations must be >= --concurrency (one turn of a "
                     "conversation in flight at a time)")
    if args.systems <= args.replicas or args.concurrency < 2 * args.replicas:
        parser.error("the workload needs more system prompts than replicas and "
                     "concurrency >= 2 x replicas")

    from shoal.runtime.model.make_model import cached_model

    model = args.model or str(cached_model("qwen3", "small"))
    logs = Path(tempfile.mkdtemp(prefix="shoal-bench-routing-"))
    engine_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size",
                   str(args.block_size), *args.engine_args.split()]
    affinity_flags, kv_events = operator_flags("cache-affinity", args.block_size)
    rr_flags, _ = operator_flags("round-robin", args.block_size)
    print(f"operator-rendered router flags: cache-affinity {affinity_flags} "
          f"(KV events: {kv_events}); round-robin {rr_flags}", flush=True)
    config = FleetConfig(replicas=args.replicas, model=model, port=args.base_port,
                         engine_port=args.base_port + 1, engine_args=engine_args,
                         kv_events=kv_events, kv_events_port=args.base_port + 2,
                         router_args=affinity_flags, log_dir=logs, ready_timeout=900)
    engines = config.engine_urls()
    print(f"starting {args.replicas} engines ({engines[0]} ...), logs in {logs}", flush=True)
    with LocalFleet(config) as fleet:
        routers = {"cache-affinity": config.router_url,
                   "round-robin": fleet.add_router(args.base_port + 10, rr_flags)}
        results = {name: RunResult(name) for name in ("round-robin", "cache-affinity")}
        for round_ in range(args.rounds):
            for name, result in results.items():
                print(f"round {round_ + 1}: {name} (load average "
                      f"{os.getloadavg()[0]:.1f}) ...", flush=True)
                asyncio.run(run_workload(result, routers[name], engines, args,
                                         seed=1000 * round_ + len(result.load)))
        # a router in front of engine 0 alone: direct and routed hit the same engine
        single = fleet.add_router(args.base_port + 20, affinity_flags, kv_events=kv_events,
                                  backends=engines[:1])
        direct_p50, routed_p50, router_cpu = asyncio.run(
            overhead(single, engines[0], args.overhead_requests, fleet.extra_routers[-1].pid))

    if args.trace is not None:
        with args.trace.open("w") as out:
            for r in results.values():
                for record in r.trace:
                    out.write(json.dumps({"policy": r.name, **dataclasses.asdict(record)}) + "\n")
    base = results["round-robin"]
    n_req = args.users * args.turns
    print(f"\nworkload per run: {args.systems} system prompts (~{args.system_words} words) x "
          f"{args.users} users x {args.turns} turns = {n_req} chat requests, "
          f"max_tokens {args.max_tokens}, concurrency {args.concurrency} (closed-loop "
          f"clients started {args.arrival_gap}s apart), {args.open_conversations} open "
          f"conversations, {args.rounds} runs per policy interleaved, "
          f"{args.replicas} engines x {args.num_kv_blocks} KV blocks ({engine_host(0)}..)")
    header = (f"{'policy':<16}{'hit rate':>9}{'x RR':>6}{'TTFT p50':>10}{'x RR':>6}"
              f"{'TTFT p99':>10}{'req/s':>8}{'max/mean':>10}{'aff.hits':>9}{'errors':>7}"
              f"  load avg per run")
    print(header)
    print("-" * len(header))
    for r in results.values():
        p50 = percentile(r.ttft, 0.5)
        print(f"{r.name:<16}{r.hit_rate:>9.3f}"
              f"{(r.hit_rate / base.hit_rate if base.hit_rate else float('nan')):>6.2f}"
              f"{p50 * 1000:>8.0f}ms{p50 / percentile(base.ttft, 0.5):>6.2f}"
              f"{percentile(r.ttft, 0.99) * 1000:>8.0f}ms{len(r.e2e) / r.wall:>8.2f}"
              f"{r.balance:>10.2f}{r.affinity_hits:>9.0f}{r.errors:>7}  "
              f"{' '.join(f'{x:.1f}' for x in r.load)}")
    print("\nwhere the prompt tokens missed (engines' usage.cached_tokens per request; a "
          "spill is a placement away from the replica the router believed held most of the "
          "prefix, its blocks x block size are the tokens it gave up by the router's view; "
          "the rest of a warm class's misses are evictions, concurrent prefills of one "
          "prefix, and the partial last block)")
    for r in results.values():
        parts = []
        for kind in CLASSES:
            n, prompt, cached = r.classes.get(kind, [0, 0, 0])
            parts.append(f"{kind}: {n} req, {prompt - cached}/{prompt} tok missed")
        reasons = ", ".join(f"{reason} {n:.0f} ({blocks * args.block_size:.0f} tok)"
                            for reason, (n, blocks) in sorted(r.spills_by_reason.items()))
        print(f"  {r.name:<16}{'; '.join(parts)}; spills {r.spills:.0f} "
              f"({r.spilled_blocks * args.block_size:.0f} tok{': ' + reasons if reasons else ''})")
        total = sum(q for q, _, _ in r.per_engine.values()) or 1.0
        print(f"  {'':<16}per engine, share of prompt tokens / hit rate / preemptions: "
              + ", ".join(f"{q / total:.2f} / {h / q if q else 0.0:.2f} / {p:.0f}"
                          for q, h, p in r.per_engine.values()))
    print(f"\nrouter overhead (cache-affinity router over engine 0 vs engine 0 direct, tiny "
          f"completion, sequential, alternating, {args.overhead_requests} each): "
          f"direct p50 {direct_p50 * 1000:.2f} ms, via router p50 {routed_p50 * 1000:.2f} ms, "
          f"overhead {(routed_p50 - direct_p50) * 1000:.2f} ms; router CPU "
          f"{router_cpu * 1000:.2f} ms per request (its idle polling subtracted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
