"""P/D interference on CPU: one engine on both cores against a prefill engine on one core and
a decode engine on the other, behind ``shoal route`` in P/D mode (issue 34's benchmark).

Modes, every server a real ``shoal serve`` (a mode's servers are started for its run and
stopped after it, so an idle router's scrapes cost no other mode's run; each run waits until
its servers are quiet):

- ``unified``: one engine, ``OMP_NUM_THREADS=2``, ``taskset -c 0,1``;
- ``pd``: a prefill engine (``kv_producer``, 1 thread, ``taskset -c 0``) and a decode engine
  (``kv_consumer``, 1 thread, ``taskset -c 1``) behind ``shoal route --prefill-backend`` with
  ``--pd-threshold`` below the long prompt and above the short ones (the router and this
  client are not pinned).

Workload, the same requests on both modes (fixed seeds; each round draws its own prompts so no
round finds another's in a cache): ``--streams`` decoding clients in a closed loop, each a
short prompt (``--stream-prompt`` tokens) and a long output (``--stream-tokens``), plus one
long prompt (``--long-prompt`` tokens, ``--long-tokens`` out) every ``--long-period`` seconds,
for ``--duration`` seconds (requests under way then finish). Greedy, ``ignore_eos``, token-id
prompts, streamed (``serve_load.one_request``: ITL is the gap between chunks that carry text).

Per mode and round: the decode streams' ITL p50/p99/max, TTFT p50/p99 of the short and of the
long requests, output tok/s (all requests' tokens over the run's wall time) and, for P/D, the
KV transfer's share of the long requests' TTFT (the decode engine's ``kv_transfer_seconds``
over the run against the long requests' summed TTFT). Then the ratios against the issue's
target: stream ITL p99 at least 2x better with P/D, tok/s within 15%.

    .venv/bin/python bench/pd_interference.py [--rounds 2] [--duration 60] [--json out.json]
    .venv/bin/python bench/pd_interference.py --smoke   # tiny model, seconds: it runs, no figures
    .venv/bin/python bench/pd_interference.py --against main   # + mode pd@<main>: before/after
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)
from serve_load import SERVED_NAME, Request, RequestResult, one_request, percentile  # noqa: E402


@dataclass(frozen=True)
class Interference:
    streams: int
    stream_prompt: int
    stream_tokens: int
    long_prompt: int
    long_tokens: int
    long_period: float
    duration: float


@dataclass
class ModeResult:
    mode: str
    round: int
    tokens_per_s: float
    stream_itl_p50: float
    stream_itl_p99: float
    stream_itl_max: float
    short_ttft_p50: float
    short_ttft_p99: float
    long_ttft_p50: float
    long_ttft_p99: float
    short_requests: int
    long_requests: int
    errors: int
    load_average: str
    transfers: int = 0  # P/D: the decode engine's pulls in the run
    transfer_failures: int = 0
    transfer_share: float = float("nan")  # pull seconds over the long requests' TTFT
    # CPU seconds each of the mode's servers (process tree) and this client spent in the run
    cpu_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Mode:
    name: str
    front: peers.ServerProcess  # where the client sends its requests
    decode: peers.ServerProcess | None = None  # P/D: whose transfer metrics are read
    servers: list[peers.ServerProcess] = field(default_factory=list)  # whose CPU is counted


def start_engine(name: str, model_dir: Path, cores: str, threads: int,
                 args: argparse.Namespace, kv_role: str = "",
                 base_env: dict[str, str] | None = None) -> peers.ServerProcess:
    port = peers.free_port()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "shoal.cli", "serve", "--model",
           str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
           SERVED_NAME, "--log-level", "warning", "--shutdown-timeout", "1", "--dtype",
           "float32", "--max-num-seqs", "64", "--max-num-batched-tokens",
           str(args.max_num_batched_tokens), "--max-model-len",
           str(args.long_prompt + args.long_tokens + 64), "--kv-cache-memory", str(1 << 30)]
    if kv_role:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "TcpConnector", "kv_role": kv_role, "kv_ip": "127.0.0.1",
            "kv_port": 0})]
    env = {**(base_env or os.environ), "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    return peers.ServerProcess(name, cmd, port, env, "/ready")


def start_router(model_dir: Path, decode: peers.ServerProcess, prefill: peers.ServerProcess,
                 threshold: int, name: str = "router",
                 base_env: dict[str, str] | None = None) -> peers.ServerProcess:
    port = peers.free_port()
    cmd = [sys.executable, "-m", "shoal.cli", "route", "--host", "127.0.0.1", "--port",
           str(port), "--backend", decode.url, "--prefill-backend", prefill.url,
           "--pd-threshold", str(threshold), "--tokenizer", str(model_dir),
           "--health-interval", "0.5", "--scrape-interval", "0.5", "--log-level", "warning"]
    env = {**(base_env or os.environ), "OMP_NUM_THREADS": "1"}
    return peers.ServerProcess(name, cmd, port, env, "/ready")


def start_mode(name: str, model_dir: Path, args: argparse.Namespace,
               base_env: dict[str, str] | None = None) -> Mode:
    """A mode's servers, up (``unified``, or P/D: ``pd`` or ``pd@REF`` from ``base_env``)."""
    if name == "unified":
        unified = start_engine("unified", model_dir, "0,1", 2, args)
        servers = [unified]
        mode = Mode("unified", unified, servers=servers)
    else:
        prefill = start_engine(f"prefill[{name}]", model_dir, "0", 1, args, "kv_producer",
                               base_env)
        decode = start_engine(f"decode[{name}]", model_dir, "1", 1, args, "kv_consumer",
                              base_env)
        servers = [prefill, decode]
        mode = Mode(name, decode, decode, servers=servers)
    try:
        for server in servers:
            server.wait_up()
        if name != "unified":
            router = start_router(model_dir, servers[1], servers[0], args.pd_threshold,
                                  f"router[{name}]", base_env)
            servers.append(router)
            mode.front = router
            router.wait_up()
    except BaseException:
        stop_mode(mode)
        raise
    for server in servers:
        print(f"  {server.name}: up after {server.startup_seconds:.0f} s ({server.log.name})",
              flush=True)
    return mode


def stop_mode(mode: Mode) -> None:
    for server in reversed(mode.servers):
        server.stop()


def random_ids(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


async def drive(url: str, work: Interference, vocab: int, seed: int,
                ) -> tuple[list[RequestResult], list[RequestResult], float]:
    """The streams' and the long requests' results, and the run's wall seconds."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        stop_at = start + work.duration

        async def stream(index: int) -> list[RequestResult]:
            rng, results = random.Random(seed * 1000 + index), []
            while time.perf_counter() < stop_at:
                request = Request(random_ids(rng, vocab, work.stream_prompt), work.stream_tokens)
                results.append(await one_request(http, url, request))
            return results

        async def longs() -> list[RequestResult]:
            rng, tasks = random.Random(seed * 1000 + 999), []
            # the first after half a period: the streams are decoding when it lands
            at = start + work.long_period / 2
            while at < stop_at:
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                request = Request(random_ids(rng, vocab, work.long_prompt), work.long_tokens)
                tasks.append(asyncio.create_task(one_request(http, url, request)))
                at += work.long_period
            return list(await asyncio.gather(*tasks))

        per_stream, long_results = await asyncio.gather(
            asyncio.gather(*(stream(i) for i in range(work.streams))), longs())
        streams = [r for results in per_stream for r in results]
        every = streams + long_results
        return streams, long_results, max(r.end for r in every) - start


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on a server's /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in values)


def run_mode(mode: Mode, work: Interference, vocab: int, seed: int, round_: int) -> ModeResult:
    load = peers.load_average()
    names = ("shoal:kv_transfer_seconds_total", "shoal:kv_transfers_total",
             "shoal:kv_transfer_failures_total")
    before = [metric(mode.decode.url, n) for n in names] if mode.decode else []
    cpu_before = {s.name: s.cpu_seconds() for s in mode.servers}
    client_before = sum(os.times()[:2])
    streams, longs, wall = asyncio.run(drive(mode.front.url, work, vocab, seed))
    cpu = {s.name: s.cpu_seconds() - cpu_before[s.name] for s in mode.servers}
    cpu["client"] = sum(os.times()[:2]) - client_before
    ok_streams = [r for r in streams if r.error is None]
    ok_longs = [r for r in longs if r.error is None]
    gaps = [g for r in ok_streams for g in r.gaps]
    short_ttfts = [r.ttft for r in ok_streams if r.ttft is not None]
    long_ttfts = [r.ttft for r in ok_longs if r.ttft is not None]
    tokens = sum(r.output_tokens for r in ok_streams + ok_longs)
    result = ModeResult(
        mode.name, round_, tokens / wall, percentile(gaps, 50), percentile(gaps, 99),
        max(gaps, default=float("nan")), percentile(short_ttfts, 50),
        percentile(short_ttfts, 99), percentile(long_ttfts, 50), percentile(long_ttfts, 99),
        len(ok_streams), len(ok_longs), len(streams) + len(longs) - len(ok_streams) - len(ok_longs),
        load, cpu_seconds=cpu)
    if mode.decode:
        seconds, pulls, failures = (metric(mode.decode.url, n) - b
                                    for n, b in zip(names, before, strict=True))
        result.transfers, result.transfer_failures = int(pulls), int(failures)
        if long_ttfts:
            result.transfer_share = seconds / sum(long_ttfts)
    errors = [r.error for r in streams + longs if r.error]
    print(f"  round {round_} {mode.name:<8} {result.tokens_per_s:7.1f} tok/s  stream ITL "
          f"p50/p99/max {result.stream_itl_p50:.3f}/{result.stream_itl_p99:.3f}/"
          f"{result.stream_itl_max:.3f} s  TTFT short p50/p99 {result.short_ttft_p50:.3f}/"
          f"{result.short_ttft_p99:.3f} s  long p50/p99 {result.long_ttft_p50:.3f}/"
          f"{result.long_ttft_p99:.3f} s  ({result.short_requests} short, "
          f"{result.long_requests} long)  load {load}"
          + (f"  transfers {result.transfers} (failed {result.transfer_failures}), "
             f"{100 * result.transfer_share:.1f}% of long TTFT" if mode.decode else "")
          + (f"  errors: {errors[:2]}" if errors else "")
          + "\n    CPU s over " + f"{wall:.0f} s wall: "
          + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items()), flush=True)
    return result


def print_summary(results: list[ModeResult]) -> None:
    print(f"\n{'mode':<9}{'round':>6}{'tok/s':>8}{'ITL p50':>9}{'ITL p99':>9}{'ITL max':>9}"
          f"{'short TTFT p50/p99':>20}{'long TTFT p50/p99':>19}{'xfer % TTFT':>12}{'err':>4}"
          f"  load 1/5/15")
    for r in results:
        share = "-" if r.transfer_share != r.transfer_share else f"{100 * r.transfer_share:.1f}"
        print(f"{r.mode:<9}{r.round:>6}{r.tokens_per_s:>8.1f}{r.stream_itl_p50:>9.3f}"
              f"{r.stream_itl_p99:>9.3f}{r.stream_itl_max:>9.3f}"
              f"{r.short_ttft_p50:>11.3f}/{r.short_ttft_p99:<8.3f}"
              f"{r.long_ttft_p50:>10.3f}/{r.long_ttft_p99:<8.3f}{share:>12}{r.errors:>4}"
              f"  {r.load_average}")
    for round_ in sorted({r.round for r in results}):
        pair = {r.mode: r for r in results if r.round == round_}
        unified = pair.get("unified")
        for name, pd in pair.items():
            if unified is None or name == "unified":
                continue
            print(f"round {round_} {name}: stream ITL p99 unified/P/D "
                  f"{unified.stream_itl_p99 / pd.stream_itl_p99:.2f}x (target >= 2x), "
                  f"tok/s P/D/unified {pd.tokens_per_s / unified.tokens_per_s:.2f} "
                  f"(target >= 0.85), long TTFT p99 P/D/unified "
                  f"{pd.long_ttft_p99 / unified.long_ttft_p99:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the cached llama bench model")
    parser.add_argument("--modes", default="unified,pd")
    parser.add_argument("--against", default=None, metavar="REF",
                        help="also run P/D on another commit's code (mode pd@REF: its "
                        "engines and router), in the same rounds: before and after a change")
    parser.add_argument("--rounds", type=int, default=1, help="each round runs every mode, "
                        "the order alternating from one round to the next")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-prompt", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=2048)
    parser.add_argument("--long-tokens", type=int, default=16)
    parser.add_argument("--long-period", type=float, default=4.0, help="seconds between long "
                        "prompts")
    parser.add_argument("--pd-threshold", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="every engine's (the engine default: a 2,048-token prompt is one "
                        "step; smaller chunks it)")
    parser.add_argument("--smoke", action="store_true", help="the tiny llama and a few "
                        "seconds: checks the script runs, measures nothing")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    # SIGTERM unwinds through the finally below: the servers run in sessions of their own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.smoke:
        args.duration, args.streams, args.stream_tokens = 3.0, 2, 8
        args.long_prompt, args.long_tokens, args.long_period = 200, 4, 1.0
        args.pd_threshold, args.rounds = 64, 1
    from shoal.runtime.model.make_model import cached_model

    model_dir = (Path(args.model) if args.model
                 else cached_model("llama", "tiny" if args.smoke else "bench"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = Interference(args.streams, args.stream_prompt, args.stream_tokens, args.long_prompt,
                        args.long_tokens, args.long_period, args.duration)
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    envs: dict[str, dict[str, str] | None] = {name: None for name in wanted}
    if args.against:
        import other_commit

        ref = subprocess.run(["git", "-C", str(other_commit.REPO), "rev-parse", "--short",
                              args.against], check=True, capture_output=True,
                             text=True).stdout.strip()
        envs[f"pd@{ref}"] = other_commit.env(other_commit.checkout(args.against))
    results: list[ModeResult] = []
    warm = Interference(2, args.stream_prompt, 8, args.long_prompt, 2, 0.5, 1.0)
    print(f"model {model_dir.name}; {work}; max_num_batched_tokens "
          f"{args.max_num_batched_tokens}; load average {peers.load_average()}", flush=True)
    # each mode's servers are up for its own run only: an idle router still scrapes and
    # checks health, which would cost the other modes' runs CPU
    names = list(envs)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            mode = start_mode(name, model_dir, args, envs[name])
            try:
                # first requests are slow (allocator, first long prefill)
                asyncio.run(drive(mode.front.url, warm, vocab, seed=10_000))
                if not peers.wait_until_quiet(mode.servers, timeout_s=20.0):
                    print("  (the servers were still busy after 20 s)", flush=True)
                results.append(run_mode(mode, work, vocab, seed=round_ + 1, round_=round_ + 1))
            finally:
                stop_mode(mode)
    print_summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": model_dir.name, "workload": asdict(work),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "results": [asdict(r) for r in results]}, indent=2))
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
