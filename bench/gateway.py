"""Gateway-facing costs: one engine's /metrics per scrape, and `shoal route --epp` pick latency.

1. /metrics: one `shoal serve --metrics-compat vllm` (tiny model), scraped --scrapes times at
   --rate per second (inference-gateway pickers scrape every 50 ms: 20/s); the API process's
   CPU time (user + system, psutil, the engine-core child excluded) over the scrapes, minus
   the same process's CPU over an equally long idle window, divided by the scrapes.
2. EPP: two such engines behind `shoal route --epp`; --picks ext_proc streams in BUFFERED
   mode (headers, then the whole chat body), each timed from sending the body to receiving
   the pick; 8 system prompts rotate so affinity has something to do. Reports p50/p99.

    .venv/bin/python bench/gateway.py [--scrapes 400] [--rate 20] [--picks 500]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.router.epp_client import (  # noqa: E402 (the Envoy-like client the tests use)
    EnvoyStream,
    Mode,
    body_message,
    headers_message,
)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_ok(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        p.wait(30)


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


class Load:
    """``n`` threads sending completions back to back (the engine busy, its numbers moving)."""

    def __init__(self, url: str, n: int) -> None:
        import threading

        self.url, self.stopping = url, threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stopping.is_set():
                http.post(f"{self.url}/v1/completions", json={
                    "model": "shoal-test", "prompt": "load " * 20, "max_tokens": 16,
                    "ignore_eos": True})

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(60)


def bench_metrics(url: str, pid: int, scrapes: int, rate: float, load: int) -> None:
    proc = psutil.Process(pid)
    duration = scrapes / rate
    traffic = Load(url, load) if load else None
    time.sleep(1.0 if load else 0.0)
    idle0 = cpu_seconds(proc)
    time.sleep(duration)
    idle = cpu_seconds(proc) - idle0
    sizes, walls = [], []
    with httpx.Client() as http:
        busy0 = cpu_seconds(proc)
        t0 = time.monotonic()
        for i in range(scrapes):
            target = t0 + i / rate
            if (lag := target - time.monotonic()) > 0:
                time.sleep(lag)
            s = time.perf_counter()
            sizes.append(len(http.get(f"{url}/metrics").content))
            walls.append(time.perf_counter() - s)
        busy = cpu_seconds(proc) - busy0
    if traffic is not None:
        traffic.stop()
    per = (busy - idle) / scrapes
    state = f"under load ({load} clients)" if load else "idle engine"
    print(f"/metrics, {state}: {scrapes} scrapes at {rate:g}/s, "
          f"{statistics.mean(sizes):.0f} bytes each; "
          f"API process CPU {busy:.3f} s vs {idle:.3f} s unscraped over {duration:.1f} s -> "
          f"{per * 1e3:.2f} ms CPU per scrape ({per * rate * 100:.1f}% of a core at "
          f"{rate:g}/s); scrape wall p50 {statistics.median(walls) * 1e3:.2f} ms")


def bench_epp(address: str, picks: int) -> None:
    channel = grpc.insecure_channel(address)
    times = []
    for i in range(picks):
        body = json.dumps({"model": "shoal-test", "max_tokens": 1, "messages": [
            {"role": "system", "content": f"System prompt {i % 8}. " * 20},
            {"role": "user", "content": f"question {i}"}]}).encode()
        stream = EnvoyStream(channel)
        stream.send(headers_message("/v1/chat/completions", False, mode=Mode.BUFFERED))
        stream.recv()
        start_at = time.perf_counter()
        stream.send(body_message(body, True))
        answer = stream.recv()
        times.append(time.perf_counter() - start_at)
        assert answer.HasField("request_body"), answer
        stream.close()
    times.sort()
    warm = times  # every pick counts; the first few include connection setup
    print(f"EPP pick (BUFFERED, body -> answer, client-observed over loopback gRPC): "
          f"{picks} picks, p50 {warm[len(warm) // 2] * 1e3:.2f} ms, "
          f"p99 {warm[int(len(warm) * 0.99) - 1] * 1e3:.2f} ms, max {warm[-1] * 1e3:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--picks", type=int, default=500)
    parser.add_argument("--load", type=int, default=2,
                        help="clients keeping the engine busy for the loaded /metrics run")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    from shoal.runtime.model.make_model import cached_model

    model = args.model or str(cached_model("qwen3", "tiny", seed=0))
    logs = Path(tempfile.mkdtemp(prefix="shoal-bench-gateway-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for i in range(2):
            host = f"127.0.0.{i + 2}"
            port = free_port(host)
            procs.append(start([sys.executable, "-m", "shoal.cli", "serve", "--host", host,
                                "--port", str(port), "--model", model,
                                "--served-model-name", "shoal-test",
                                "--metrics-compat", "vllm"], logs / f"engine{i}.log"))
            urls.append(f"http://{host}:{port}")
        for url in urls:
            wait_ok(f"{url}/ready")
        bench_metrics(urls[0], procs[0].pid, args.scrapes, args.rate, 0)
        if args.load:
            bench_metrics(urls[0], procs[0].pid, args.scrapes, args.rate, args.load)
        port = free_port("127.0.0.1")
        epp = [sys.executable, "-m", "shoal.runtime.router.cli", "--epp", "--host", "127.0.0.1",
               "--port", str(port)]
        for url in urls:
            epp += ["--backend", url]
        procs.append(start(epp, logs / "epp.log"))
        time.sleep(3)
        bench_epp(f"127.0.0.1:{port}", args.picks)
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
