"""Memory soak: ``shoal serve`` at twice its capacity for a long time, RSS of every process.

Starts one ``shoal serve`` (the small qwen3 checkpoint unless ``--model``), then keeps
``--load`` x ``--max-num-seqs`` clients busy (closed loop: each sends its next request when the
last one ends) with the mix that grew the engine core in issue 36:

- plain completions (short prompts, a few dozen tokens);
- ``n`` of 2-4 choices;
- structured outputs: a choice list or a JSON schema, each request its own (random words), so
  the grammar cache keeps filling;
- disconnects: a stream closed by the client after its first chunks;
- long prompts (half of ``--max-model-len`` tokens).

Every ``--interval`` seconds it prints the RSS of every process of the server's tree (the API,
the engine core, any rank), the requests done and their statuses. The first ``--warmup``
seconds fill the caches and pools; their last sample is each process's baseline. After
``--duration`` the load stops, the server idles one interval, and a last sample is taken: the
run fails (exit 1) when any process's RSS then exceeds its baseline by more than
``--max-growth`` (10 %), and also when a request got a 5xx.

    .venv/bin/python bench/soak.py                        # 30 minutes, the issue's soak
    .venv/bin/python bench/soak.py --duration 300 --warmup 60 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

SERVED_NAME = "soak"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    model = args.model
    if model is None:
        from shoal.runtime.model.make_model import cached_model

        model = str(cached_model("qwen3", "small"))
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_NAME,
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--log-level", "warning", *args.serve_arg]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"shoal serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("shoal serve was not ready in time")


def tree_rss(pid: int) -> dict[str, float]:
    """MiB per process of the tree, named by role."""
    root = psutil.Process(pid)
    found: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            line = " ".join(proc.cmdline())
            rss = proc.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
        role = ("api" if proc.pid == pid else "engine_core" if "core_proc" in line
                else "rank" if "worker_proc" in line else "child")
        name = role if role not in found else f"{role}:{proc.pid}"
        found[name] = round(rss, 1)
    return found


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def next_request(rng: random.Random, long_words: int) -> tuple[str, dict]:
    """(kind, body) of one request of the mix."""
    roll = rng.random()
    body: dict = {"model": SERVED_NAME, "prompt": words(rng, rng.randrange(4, 40)),
                  "max_tokens": rng.randrange(8, 48), "temperature": 1.0}
    if roll < 0.35:
        return "plain", body
    if roll < 0.50:
        return "n", {**body, "n": rng.randrange(2, 5)}
    if roll < 0.60:
        choices = [words(rng, 3) + f" {rng.randrange(10**6)}" for _ in range(rng.randrange(4, 40))]
        return "choice", {**body, "structured_outputs": {"choice": choices}}
    if roll < 0.70:
        fields = {f"{rng.choice(WORDS)}_{i}": {"type": rng.choice(["string", "integer"])}
                  for i in range(rng.randrange(1, 6))}
        schema = {"type": "object", "properties": fields, "required": list(fields)}
        return "json", {**body, "max_tokens": 64, "structured_outputs": {"json": schema}}
    if roll < 0.85:
        return "disconnect", {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
    return "long", {**body, "prompt": words(rng, long_words), "max_tokens": 16}


async def client(http: httpx.AsyncClient, base: str, seed: int, stop: asyncio.Event,
                 statuses: Counter, long_words: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        kind, body = next_request(rng, long_words)
        try:
            if kind == "disconnect":
                async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
                    statuses[r.status_code] += 1
                    chunks = 0
                    async for _ in r.aiter_lines():
                        chunks += 1
                        if chunks >= rng.randrange(2, 8):
                            break  # leaving the block closes the connection mid-stream
            else:
                r = await http.post(f"{base}/v1/completions", json=body)
                statuses[r.status_code] += 1
                if r.status_code == 429:
                    await asyncio.sleep(min(2.0, float(r.headers.get("retry-after", "1"))))
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1
            await asyncio.sleep(0.5)


async def drive(args: argparse.Namespace, base: str, pid: int) -> dict:
    stop = asyncio.Event()
    statuses: Counter = Counter()
    samples: list[dict] = []
    clients = max(1, round(args.load * args.max_num_seqs))
    long_words = args.max_model_len // 2 // 2  # ~2 tokens per word here
    limits = httpx.Limits(max_connections=clients + 8)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        tasks = [asyncio.create_task(client(http, base, seed, stop, statuses, long_words))
                 for seed in range(clients)]

        def sample(phase: str) -> dict:
            row = {"t": round(time.monotonic() - started, 1), "phase": phase,
                   "rss_mib": tree_rss(pid), "requests": sum(
                       v for k, v in statuses.items() if isinstance(k, int)),
                   "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)}}
            samples.append(row)
            print(json.dumps(row), flush=True)
            return row

        baseline: dict | None = None
        while (elapsed := time.monotonic() - started) < args.duration:
            await asyncio.sleep(min(args.interval, args.duration - elapsed))
            phase = "warmup" if time.monotonic() - started <= args.warmup else "load"
            row = sample(phase)
            if phase == "warmup" or baseline is None:
                baseline = row
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(args.interval)  # idle: what the server keeps once the load is gone
    final = sample("idle")
    assert baseline is not None
    growth = {name: round(final["rss_mib"].get(name, 0.0) / mib - 1, 4)
              for name, mib in baseline["rss_mib"].items() if mib}
    peak = {name: max(s["rss_mib"].get(name, 0.0) for s in samples)
            for name in baseline["rss_mib"]}
    return {"clients": clients, "baseline": baseline, "final": final, "growth": growth,
            "peak_mib": peak, "statuses": final["statuses"], "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (30 min)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds whose last sample is the baseline (default: a fifth of "
                        "the duration, at least one interval)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--load", type=float, default=2.0, help="clients per batch slot (2x)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-growth", type=float, default=0.10,
                   help="largest allowed RSS growth past the baseline, per process")
    p.add_argument("--model", default=None, help="checkpoint dir (default: small qwen3)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra flag for shoal serve (repeatable), e.g. --serve-arg=--dtype")
    p.add_argument("--json", default=None, help="write every sample and the verdict here")
    p.add_argument("--log", default="soak-serve.log", help="shoal serve's log")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(args.interval, args.duration / 5)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, Path(args.log))
    try:
        wait_ready(base, proc)
        report = asyncio.run(drive(args, base, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    failures = [f"{name} grew {g:.1%} past its warm-up RSS"
                for name, g in report["growth"].items() if g > args.max_growth]
    errors = {k: v for k, v in report["statuses"].items() if k.startswith("5")}
    if errors:
        failures.append(f"5xx answers: {errors}")
    report["failures"] = failures
    report["args"] = {k: v for k, v in vars(args).items()}
    report["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("clients", "growth", "peak_mib", "statuses",
                                             "failures")}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
