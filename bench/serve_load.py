"""HTTP load on CPU: ``shoal serve`` vs ``transformers serve --continuous-batching``.

One run drives both servers, one after the other (never at once: the machine has 2 cores),
with the same requests: the bench-size model (``shoal make-model --size bench``), text
prompts of 32..256 tokens, max_tokens 32..128 (fixed seed), streaming completions. Each rate
is a Poisson arrival process (requests/s); ``inf`` sends everything at once (saturation).
Both servers are warmed up first (transformers' first request is slow) and run with the same
torch thread count (``--threads``, default 1: on a shared 2-core machine, two OpenMP threads
per process oversubscribe the cores and run ~10x slower than one).

Per server and rate: output tokens/s (from the usage each stream reports), TTFT and
inter-token latency p50/p99 (client side: the gap between content chunks), and the ratio of
shoal's throughput to the peer's. The machine is shared with other work: figures are noisy.

    .venv/bin/python bench/serve_load.py [--rates 2,inf] [--requests 48] [--json out.json]
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Workload:
    prompts: list[str]
    max_tokens: list[int]


@dataclass
class RequestResult:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    end: float = 0.0


@dataclass
class RateResult:
    server: str
    rate: str
    tokens_per_s: float
    requests_per_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    errors: int


def make_workload(model_dir: Path, count: int, seed: int = 0) -> Workload:
    from shoal.runtime.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(32, 256))]
        prompts.append(tokenizer.decode(ids).replace("\ufffd", "?"))
    return Workload(prompts, [rng.randint(32, 128) for _ in range(count)])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- servers -------------------------------------------------------------------------------------

class ServerProcess:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str],
                 health_path: str) -> None:
        self.name, self.port, self.health_path = name, port, health_path
        self.log = open(f"/tmp/serve_load_{name}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see "
                                   f"{self.log.name}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not up after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def start_shoal(model_dir: Path, port: int, threads: int) -> ServerProcess:
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(model_dir), "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--log-level", "warning", "--shutdown-timeout", "1",
           "--kv-cache-memory", str(1 << 30)]  # 1 GiB: room for the whole workload
    return ServerProcess("shoal", cmd, port, thread_env(threads), "/ready")


def start_transformers(model_dir: Path, port: int, threads: int) -> ServerProcess:
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(model_dir), "--continuous-batching", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = {**thread_env(threads), "HF_HUB_OFFLINE": "1"}
    return ServerProcess("transformers", cmd, port, env, "/health")


# -- load ----------------------------------------------------------------------------------------

async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int) -> RequestResult:
    result = RequestResult()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model == "bench":
        body["ignore_eos"] = True  # shoal only; the peer ignores unknown fields anyway
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    result.end = time.perf_counter()
    return result


async def run_rate(url: str, model: str, workload: Workload, rate: float,
                   seed: int = 1) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in zip(workload.prompts, workload.max_tokens, strict=True):
            tasks.append(asyncio.create_task(one_request(http, url, model, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, start


def summarise(server: str, rate_name: str, results: list[RequestResult],
              start: float) -> RateResult:
    ok = [r for r in results if r.error is None]
    elapsed = max(r.end for r in results) - start
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    return RateResult(server, rate_name, tokens / elapsed, len(ok) / elapsed,
                      percentile(ttfts, 50), percentile(ttfts, 99), percentile(gaps, 50),
                      percentile(gaps, 99), len(results) - len(ok))


def bench_server(server: ServerProcess, model: str, workload: Workload,
                 rates: list[str]) -> list[RateResult]:
    server.wait_up()
    warm = Workload(workload.prompts[:4], [8] * 4)
    for _ in range(2):  # the peer's first requests are slow: warm both sides alike
        asyncio.run(run_rate(server.url, model, warm, float("inf")))
    out = []
    for rate_name in rates:
        results, start = asyncio.run(run_rate(server.url, model, workload, float(rate_name)))
        out.append(summarise(server.name, rate_name, results, start))
        print(f"  {server.name} rate={rate_name}: {out[-1].tokens_per_s:.1f} tok/s", flush=True)
    return out


def print_table(results: list[RateResult]) -> None:
    print(f"\n{'server':<13}{'rate':>6}{'tok/s':>9}{'req/s':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}{'errors':>7}{'vs peer':>9}")
    peer = {r.rate: r for r in results if r.server == "transformers"}
    for r in results:
        ratio = (f"{r.tokens_per_s / peer[r.rate].tokens_per_s:.2f}x"
                 if r.server == "shoal" and r.rate in peer and peer[r.rate].tokens_per_s else "")
        print(f"{r.server:<13}{r.rate:>6}{r.tokens_per_s:>9.1f}{r.requests_per_s:>7.2f}"
              f"{r.ttft_p50:>10.3f}{r.ttft_p99:>10.3f}{r.itl_p50:>9.3f}{r.itl_p99:>9.3f}"
              f"{r.errors:>7}{ratio:>9}")
    print("(seconds; target: shoal >= 3x the peer's tok/s at rate=inf and a lower TTFT p99 at "
          "equal load; shared 2-core machine: noisy)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: cached qwen3 bench model")
    parser.add_argument("--rates", default="2,inf", help="comma-separated requests/s; inf = burst")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--servers", default="shoal,transformers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.model is None:
        from shoal.runtime.model.make_model import cached_model

        model_dir = cached_model("qwen3", "bench")
    else:
        model_dir = Path(args.model)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        if not float(rate) > 0:
            parser.error(f"rates must be positive (or inf), got {rate}")
    workload = make_workload(model_dir, args.requests)
    results: list[RateResult] = []
    for name in args.servers.split(","):
        if name == "shoal":
            server, model = start_shoal(model_dir, free_port(), args.threads), "bench"
        elif name == "transformers":
            server, model = start_transformers(model_dir, free_port(), args.threads), \
                str(model_dir)
        else:
            parser.error(f"unknown server {name!r}")
        print(f"{name}: starting ({server.log.name})", flush=True)
        try:
            results += bench_server(server, model, workload, rates)
        finally:
            server.stop()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
