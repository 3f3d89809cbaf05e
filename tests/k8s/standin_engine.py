"""A stand-in engine that honours exactly the runtime's HTTP contract, nothing else.

Used by the operator integration test for what the real `shoal serve` cannot be made to do on
demand: report a chosen KV-cache usage / queue depth, and a slow, observable startup (so the
test can see the readiness gate stay False while /ready says "loading").

    python standin_engine.py --host 127.0.0.2 --port 18000 --load-seconds 2 --kv 0.25
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--kv", type=float, default=0.0)
    parser.add_argument("--running", type=int, default=0)
    parser.add_argument("--waiting", type=int, default=0)
    parser.add_argument("--prefix-queries", type=int, default=0)
    parser.add_argument("--prefix-hits", type=int, default=0)
    parser.add_argument("--metrics-file",
                        help="JSON object read on every scrape, overriding kv/running/waiting")
    args = parser.parse_args()
    started = time.monotonic()
    draining = threading.Event()

    def ready_body() -> tuple[int, dict[str, object]]:
        elapsed = time.monotonic() - started
        if draining.is_set():
            return 503, {"status": "draining", "phase": "draining"}
        if elapsed < args.load_seconds:
            return 503, {"status": "starting", "phase": "loading",
                         "phases": {"loading": round(elapsed, 3)}, "model": args.model}
        return 200, {"status": "ready", "phase": "ready",
                     "phases": {"loading": args.load_seconds, "profiling": 0.0,
                                "capturing": 0.0}, "model": args.model}

    label = f'model_name="{args.model}"'
    adapters: dict[str, str] = {}  # LoRA adapters loaded through the endpoints
    loads: list[str] = []  # every load, in order (a restart would start it empty)

    def current(name: str) -> float:
        if args.metrics_file:
            try:
                with open(args.metrics_file) as handle:
                    overrides = json.load(handle)
                if name in overrides:
                    return float(overrides[name])
            except (OSError, ValueError):
                pass
        return float(getattr(args, name))

    def metrics() -> bytes:
        return "\n".join([
            "# TYPE shoal:num_requests_running gauge",
            f"shoal:num_requests_running{{{label}}} {current('running')}",
            "# TYPE shoal:num_requests_waiting gauge",
            f"shoal:num_requests_waiting{{{label}}} {current('waiting')}",
            "# TYPE shoal:kv_cache_usage_perc gauge",
            f"shoal:kv_cache_usage_perc{{{label}}} {current('kv')}",
            "# TYPE shoal:prefix_cache_queries_total counter",
            f"shoal:prefix_cache_queries_total{{{label}}} {args.prefix_queries}",
            "# TYPE shoal:prefix_cache_hits_total counter",
            f"shoal:prefix_cache_hits_total{{{label}}} {args.prefix_hits}",
            "# TYPE shoal:num_preemptions_total counter",
            f"shoal:num_preemptions_total{{{label}}} 0",
            "",
        ]).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            """The LoRA endpoints (vLLM's bodies): a path containing "bad" is refused."""
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            name = body.get("lora_name", "")
            if self.path == "/v1/load_lora_adapter":
                path = body.get("lora_path", "")
                if "bad" in path or name in adapters:
                    error = {"error": {"message": f"cannot load {name} from {path}"}}
                    self._send(400, json.dumps(error).encode(), "application/json")
                    return
                adapters[name] = path
                loads.append(name)
                self._send(200, b"Success", "text/plain")
            elif self.path == "/v1/unload_lora_adapter":
                if adapters.pop(name, None) is None:
                    self._send(404, b'{"error": {"message": "not found"}}', "application/json")
                    return
                self._send(200, b"Success", "text/plain")
            else:
                self._send(404, b"{}", "application/json")

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/v1/models":
                cards = [{"id": args.model, "parent": None}] + [
                    {"id": n, "root": p, "parent": args.model} for n, p in adapters.items()]
                self._send(200, json.dumps({"data": cards, "loads": loads}).encode(),
                           "application/json")
            elif self.path == "/health":
                self._send(200, b'{"status":"ok"}', "application/json")
            elif self.path == "/ready":
                code, body = ready_body()
                self._send(code, json.dumps(body).encode(), "application/json")
            elif self.path == "/metrics":
                self._send(200, metrics(), "text/plain; version=0.0.4")
            else:
                self._send(404, b"{}", "application/json")

    server = ThreadingHTTPServer((args.host, args.port), Handler)

    def drain(*_: object) -> None:
        draining.set()
        threading.Timer(0.2, server.shutdown).start()

    signal.signal(signal.SIGTERM, drain)
    print(f"standin engine on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    sys.exit(0)


if __name__ == "__main__":
    main()
