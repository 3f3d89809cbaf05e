"""HTTP serving load on CPU: ``shoal serve`` against ``vllm serve`` (its CPU build), same run.

Every server is started first, on the same model directory (the bench-size llama, ``shoal
make-model --size bench``) and the same limits (max_num_seqs, max_num_batched_tokens,
max_model_len, a 2 GiB KV cache); then each workload runs on every server back to back (the
order alternates from one workload to the next), so a change in the shared machine's load hits
both systems alike. Before each run every server's process tree must be quiet (under 0.1 core
together, ``peers.wait_until_quiet``): vLLM's keeps a core busy for about a second after its
last request, and whoever ran next was measured a core short. Requests are token ids
(``prompt: [ids]``), greedy, ``ignore_eos``, streamed with usage. Workloads (sizes are flags,
so a short run is possible):

- ``burst``: C requests at once for each C in ``--concurrency`` (1 means ``--single-requests``
  one after another), prompts ``--prompt-range`` tokens, for each ``--new-tokens`` value;
- ``poisson``: ``--poisson-requests`` with Poisson arrivals at each ``--rates`` (requests/s);
- ``chat``: ``--chat-users`` users, each a conversation of ``--chat-turns`` turns on one of
  ``--chat-system-prompts`` long system prompts; a turn's prompt is the system prompt, the
  earlier turns (each user message, then a fixed stand-in for the reply: the reply's own tokens
  are not returned as ids by both servers) and the new user message, so prefix caching decides
  TTFT.

Per server and workload: output tokens/s (from each stream's usage), TTFT and inter-token
latency p50/p99 (client side: gaps between chunks that carry tokens; ``return_token_ids``
asks both servers for a chunk per step, text or not), the CPU time the server's
process tree spent per output token (steadier than wall time on a shared machine), for bursts
the share of the workload's CPU floor measured before the servers start (``bench/floor.py``)
and the load average when it ran; per server, once warm, the resident memory of each of its
processes and the largest one's bytes per checkpoint parameter. vLLM runs with each thread binding in ``--vllm-bind`` and
Shoal at each OMP thread count in ``--threads`` (one server each, all up at once); the better
of each is its figure (by tok/s) and the ratios compare those two. The machine is shared: figures are noisy.

    .venv/bin/python bench/serve_load.py --peer vllm [--dtype bfloat16] [--workloads burst,poisson,chat]
        [--concurrency 1,16,48,128,256] [--new-tokens 64,128] [--rates 1,2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch
from shoal.runtime.model.config import load_model_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)
from floor import Floor, Work  # noqa: E402

SERVED_NAME = "bench"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    name: str
    requests: list[Request]
    concurrency: int = 0  # >0: a closed loop of this many in flight; 0: arrivals below
    rate: float = float("inf")  # Poisson arrivals (requests/s); inf: all at once
    chats: list[list[Request]] = field(default_factory=list)  # each list: one user's turns
    floor_tokens_per_s: float = float("nan")  # bench/floor.py; set for bursts only

    def work(self) -> Work:
        return Work.of_requests([len(r.prompt) for r in self.requests],
                                [r.max_tokens for r in self.requests])

QUIET_TIMEOUT_S = 20.0  # the longest a run waits for the servers to go quiet


@dataclass
class RequestResult:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    sent: float = 0.0  # perf_counter when the request was sent
    end: float = 0.0


@dataclass
class Result:
    server: str
    workload: str
    tokens_per_s: float
    requests_per_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    errors: int
    load_average: str
    seconds: float = float("nan")  # first request sent to last one done (tok/s's divisor)
    e2e_p50: float = float("nan")  # a request's own latency, sent to done
    e2e_p99: float = float("nan")
    tpot_p50: float = float("nan")  # a request's time per output token after its first
    # each request in workload order: [sent (s after the first), TTFT, end, output tokens]
    timeline: list[list[float]] = field(default_factory=list)
    cpu_ms_per_token: float = float("nan")  # the server's process tree, all its processes
    floor_share: float = float("nan")  # measured tok/s over the workload's floor tok/s


def random_ids(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


def burst_workload(vocab: int, concurrency: int, new_tokens: int, prompt_range: tuple[int, int],
                   single_requests: int, seed: int) -> Workload:
    rng = random.Random(seed)
    count = single_requests if concurrency == 1 else concurrency
    requests = [Request(random_ids(rng, vocab, rng.randint(*prompt_range)), new_tokens)
                for _ in range(count)]
    return Workload(f"burst c={concurrency} n={new_tokens}", requests, concurrency=concurrency)


def poisson_workload(vocab: int, rate: float, count: int, prompt_range: tuple[int, int],
                     new_range: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    requests = [Request(random_ids(rng, vocab, rng.randint(*prompt_range)),
                        rng.randint(*new_range)) for _ in range(count)]
    return Workload(f"poisson {rate:g}/s x{count}", requests, rate=rate)


def chat_workload(vocab: int, users: int, turns: int, system_prompts: int, system_len: int,
                  user_len: int, reply_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    systems = [random_ids(rng, vocab, system_len) for _ in range(system_prompts)]
    chats = []
    for user in range(users):
        history = list(systems[user % system_prompts])
        conversation = []
        for _ in range(turns):
            history += random_ids(rng, vocab, user_len)
            conversation.append(Request(list(history), reply_len))
            history += random_ids(rng, vocab, reply_len)  # the reply's stand-in
        chats.append(conversation)
    name = f"chat {users}u x{turns}t sys {system_prompts}x{system_len}"
    return Workload(name, [r for c in chats for r in c], chats=chats)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# -- load ----------------------------------------------------------------------------------------

async def one_request(http: httpx.AsyncClient, url: str, request: Request) -> RequestResult:
    result = RequestResult()
    body = {"model": SERVED_NAME, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            # each token when it is made, text or not (ids past a test tokenizer's vocabulary
            # make none): both servers then send a chunk per step
            "return_token_ids": True}
    start = last = result.sent = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    if result.error is None and result.output_tokens != request.max_tokens:
        # a server whose engine died mid-stream may end the stream cleanly, without usage
        result.error = f"{result.output_tokens} of {request.max_tokens} tokens reported"
    result.end = time.perf_counter()
    return result


async def drive(url: str, workload: Workload, seed: int = 1) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as http:
        start = time.perf_counter()
        if workload.chats:
            async def converse(turns: list[Request]) -> list[RequestResult]:
                return [await one_request(http, url, turn) for turn in turns]

            per_user = await asyncio.gather(*(converse(c) for c in workload.chats))
            return [r for user in per_user for r in user], start
        if workload.concurrency:
            slots = asyncio.Semaphore(workload.concurrency)

            async def limited(request: Request) -> RequestResult:
                async with slots:
                    return await one_request(http, url, request)

            return list(await asyncio.gather(*(limited(r) for r in workload.requests))), start
        rng = random.Random(seed)
        tasks = []
        for request in workload.requests:
            tasks.append(asyncio.create_task(one_request(http, url, request)))
            if workload.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(workload.rate))
        return list(await asyncio.gather(*tasks)), start


def summarise(server: str, workload: Workload, results: list[RequestResult], start: float,
              load: str) -> Result:
    # Throughput as vLLM's own serving benchmark counts it (output tokens over the time from
    # the first request sent to the last one done), the same clock for every server. Under
    # open-loop (Poisson) arrivals that a server keeps up with it is close to the offered
    # load whoever serves, so the latencies below are what tell servers apart there.
    ok = [r for r in results if r.error is None]
    elapsed = max(r.end for r in results) - start
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    e2es = [r.end - r.sent for r in ok]
    tpots = [(r.end - r.sent - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.ttft is not None and r.output_tokens > 1]
    return Result(server, workload.name, sum(r.output_tokens for r in ok) / elapsed,
                  len(ok) / elapsed, percentile(ttfts, 50), percentile(ttfts, 99),
                  percentile(gaps, 50), percentile(gaps, 99), len(results) - len(ok), load,
                  seconds=elapsed, e2e_p50=percentile(e2es, 50), e2e_p99=percentile(e2es, 99),
                  tpot_p50=percentile(tpots, 50),
                  timeline=[[round(r.sent - start, 3), round(r.ttft or math.nan, 3),
                             round(r.end - start, 3), r.output_tokens] for r in results])


def run_one(server: peers.ServerProcess, workload: Workload) -> Result:
    load = peers.load_average()
    cpu_before = server.cpu_seconds()
    results, start = asyncio.run(drive(server.url, workload))
    result = summarise(server.name, workload, results, start, load)
    tokens = sum(r.output_tokens for r in results if r.error is None)
    if tokens:
        result.cpu_ms_per_token = 1000 * (server.cpu_seconds() - cpu_before) / tokens
    result.floor_share = result.tokens_per_s / workload.floor_tokens_per_s
    errors = [r.error for r in results if r.error]
    print(f"  {workload.name:<34} {server.name:<16} {result.tokens_per_s:8.1f} tok/s "
          f"({result.seconds:.1f} s)  TTFT p50/p99 "
          f"{result.ttft_p50:.3f}/{result.ttft_p99:.3f} s  ITL p50/p99 {result.itl_p50:.3f}/"
          f"{result.itl_p99:.3f} s  E2E p50/p99 {result.e2e_p50:.2f}/{result.e2e_p99:.2f} s  "
          f"TPOT p50 {result.tpot_p50:.3f} s  CPU {result.cpu_ms_per_token:.1f} ms/token  floor "
          f"{percent(result.floor_share)}  load {load}"
          + (f"  errors: {errors[:2]}" if errors else ""),
          flush=True)
    return result


# -- report --------------------------------------------------------------------------------------

def percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.1f}%"  # NaN: no floor for this workload


def print_table(results: list[Result]) -> None:
    print(f"\n{'workload':<34}{'server':<17}{'tok/s':>8}{'req/s':>7}{'TTFT p50':>9}"
          f"{'TTFT p99':>9}{'ITL p50':>8}{'ITL p99':>8}{'err':>4}{'CPU ms/tok':>11}"
          f"{'% floor':>8}  {'load 1/5/15':<14}")
    for r in results:
        print(f"{r.workload:<34}{r.server:<17}{r.tokens_per_s:>8.1f}{r.requests_per_s:>7.2f}"
              f"{r.ttft_p50:>9.3f}{r.ttft_p99:>9.3f}{r.itl_p50:>8.3f}{r.itl_p99:>8.3f}"
              f"{r.errors:>4}{r.cpu_ms_per_token:>11.2f}{percent(r.floor_share):>8}  "
              f"{r.load_average:<14}")
    workloads = list(dict.fromkeys(r.workload for r in results))
    print(f"\n{'workload':<34}{'shoal (best)':<17}{'peer (best)':<17}{'tok/s ratio':>12}"
          f"{'TTFT p99 ratio':>16}{'CPU/token ratio':>17}")
    for name in workloads:
        mine = [r for r in results if r.workload == name and r.server.startswith("shoal")]
        theirs = [r for r in results if r.workload == name and r.server.startswith("vllm")]
        if not mine or not theirs:
            continue
        ours = max(mine, key=lambda r: r.tokens_per_s)
        best = max(theirs, key=lambda r: r.tokens_per_s)
        print(f"{name:<34}{ours.server:<17}{best.server:<17}"
              f"{ours.tokens_per_s / best.tokens_per_s:>11.2f}x"
              f"{ours.ttft_p99 / best.ttft_p99:>15.2f}x"
              f"{ours.cpu_ms_per_token / best.cpu_ms_per_token:>16.2f}x")
    print("(seconds; ratios are shoal / peer: targets tok/s >= 1.2x, TTFT p99 <= 1.0x; "
          "shared 2-core machine: noisy)")


def print_memory(memory: dict[str, list[tuple[int, str, int]]], parameters: int) -> None:
    """Each server's processes by resident memory once warm; the largest holds the weights
    (and the KV cache, where its pages were touched: the same --kv-cache-gib for every server),
    so its bytes per parameter are an upper bound on what the weights cost."""
    print(f"resident memory once warm ({parameters / 1e6:.1f} M checkpoint parameters):")
    for name, rows in memory.items():
        if not rows:
            continue
        print(f"  {name}: largest {rows[0][2] / 2**20:.0f} MiB = "
              f"{rows[0][2] / parameters:.2f} bytes/parameter ({rows[0][1]}); all: "
              + ", ".join(f"{rss / 2**20:.0f}" for _, _, rss in rows) + " MiB", flush=True)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split("-"))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the cached llama bench model")
    parser.add_argument("--peer", default="vllm", choices=["vllm", "none"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both servers' --dtype (and the floor's weight and K/V size)")
    parser.add_argument("--vllm-venv", default=peers.DEFAULT_VLLM_VENV)
    parser.add_argument("--vllm-bind", default="auto,0-1",
                        help="VLLM_CPU_OMP_THREADS_BIND values to measure (comma-separated)")
    parser.add_argument("--workloads", default="burst,poisson,chat")
    parser.add_argument("--concurrency", default="1,16,48,128,256")
    parser.add_argument("--new-tokens", default="64,128")
    parser.add_argument("--prompt-range", default="64-320")
    parser.add_argument("--single-requests", type=int, default=4,
                        help="requests one after another at concurrency 1")
    parser.add_argument("--rates", default="1,2,4", help="Poisson requests/s")
    parser.add_argument("--poisson-requests", type=int, default=64)
    parser.add_argument("--poisson-new-tokens", default="64-128")
    parser.add_argument("--chat-users", type=int, default=32)
    parser.add_argument("--chat-turns", type=int, default=3)
    parser.add_argument("--chat-system-prompts", type=int, default=4)
    parser.add_argument("--chat-system-len", type=int, default=768)
    parser.add_argument("--chat-user-len", type=int, default=48)
    parser.add_argument("--chat-reply-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", default="1,2",
                        help="OMP thread counts to run shoal at, one server each (the better "
                        "is our figure, like the peer's bindings); N@CORES also pins the "
                        "engine's threads to CORES (1@0: like vLLM's auto binding)")
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="KV cache per server (ours and VLLM_CPU_KVCACHE_SPACE); 2 holds "
                        "256 requests at once")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.model is None:
        from shoal.runtime.model.make_model import cached_model

        model_dir = cached_model("llama", "bench")
    else:
        model_dir = Path(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = parse_range(args.prompt_range)

    # Every workload draws its own prompts (seeds differ): one never finds another's prompts in
    # a server's prefix cache; the same workload is the same requests on every server.
    workloads: list[Workload] = []
    kinds = set(args.workloads.split(","))
    if "burst" in kinds:
        workloads += [burst_workload(vocab, c, n, prompts, args.single_requests,
                                     seed=100_000 * n + c)
                      for n in parse_ints(args.new_tokens) for c in parse_ints(args.concurrency)]
    if "poisson" in kinds:
        workloads += [poisson_workload(vocab, float(rate), args.poisson_requests, prompts,
                                       parse_range(args.poisson_new_tokens), seed=7 + i)
                      for i, rate in enumerate(r for r in args.rates.split(",") if r.strip())]
    if "chat" in kinds:
        workloads.append(chat_workload(vocab, args.chat_users, args.chat_turns,
                                       args.chat_system_prompts, args.chat_system_len,
                                       args.chat_user_len, args.chat_reply_len, seed=11))

    # Measured before any server starts, with every core. Bursts only: Poisson runs are
    # paced by their arrivals and chat prompts hit the prefix cache (less work than the floor's).
    floor = Floor.measure(load_model_config(model_dir), threads=len(os.sched_getaffinity(0)),
                          dtype=getattr(torch, args.dtype))
    print(f"{floor.describe()}; floors (bench/floor.py):", flush=True)
    for workload in workloads:
        if workload.concurrency:
            work = workload.work()
            workload.floor_tokens_per_s = work.sampled / floor.seconds(work)
            print(f"  {workload.name}: {workload.floor_tokens_per_s:.0f} tok/s", flush=True)

    limits = (args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len)
    servers: list[peers.ServerProcess] = []
    try:
        for setting in args.threads.split(","):
            threads, _, cores = setting.strip().partition("@")
            servers.append(peers.start_shoal_server(model_dir, SERVED_NAME, *limits,
                                                    int(threads), cores, args.kv_cache_gib,
                                                    args.dtype))
        if args.peer == "vllm":
            for peer in peers.vllm_peers(args.vllm_venv, args.vllm_bind, args.kv_cache_gib):
                servers.append(peers.start_vllm_server(peer, model_dir, SERVED_NAME, *limits,
                                                       args.dtype))
        for server in servers:
            print(f"{server.name}: starting ({server.log.name})", flush=True)
        for server in servers:
            server.wait_up()
            print(f"{server.name}: up after {server.startup_seconds:.0f} s", flush=True)
        # its own prompts: the first workload's would be in both prefix caches when it runs
        warm = burst_workload(vocab, 4, 16, prompts, 4, seed=1)
        for server in servers:  # the first requests are slow on both (compile, allocator)
            for _ in range(2):
                asyncio.run(drive(server.url, warm))
        memory = {server.name: server.resident_bytes() for server in servers}
        print_memory(memory, peers.checkpoint_parameters(model_dir))
        print(f"model {model_dir.name} in {args.dtype}; load average {peers.load_average()}",
              flush=True)
        results: list[Result] = []
        for index, workload in enumerate(workloads):
            order = servers if index % 2 == 0 else servers[::-1]
            for server in order:
                if not peers.wait_until_quiet(servers, timeout_s=QUIET_TIMEOUT_S):
                    print(f"  (the servers were still busy after {QUIET_TIMEOUT_S:.0f} s)",
                          flush=True)
                results.append(run_one(server, workload))
    finally:
        for server in servers:
            server.stop()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": model_dir.name, "dtype": args.dtype,
            "parameters": peers.checkpoint_parameters(model_dir),
            "resident_bytes": memory, "startup_seconds": {s.name: s.startup_seconds
                                                         for s in servers},
            "matmul_flops_per_s": {str(k): v for k, v in floor.matmul_flops_per_s.items()},
            "read_bytes_per_s": floor.read_bytes_per_s,
            "floor_tokens_per_s": {w.name: w.floor_tokens_per_s for w in workloads
                                   if w.concurrency},
            "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
