"""Blast radius of one bad client, on a real fleet (two `shoal serve` engines behind
`shoal route`, loopback): edge auth, timeouts, stalled readers, the connection cap, and an
engine killed mid-request that takes down only its own replica (issue 19).

The destructive test (an engine core killed) runs last in this module."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from tests.router.conftest import _free_port

KEY, OTHER_KEY = "sk-router-edge-1", "sk-router-edge-2"


@pytest.fixture(scope="module")
def fleet(engine_fleet_factory, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# tenants\n{OTHER_KEY}\n")
    metrics_port = _free_port("127.0.0.2")
    fleet = engine_fleet_factory(2, ["--max-model-len", "4096", "--num-kv-blocks", "512",
                                     "--stream-stall-timeout", "2",
                                     "--metrics-port", str(metrics_port)])
    fleet.metrics_port = metrics_port
    return fleet, key_file


def router_with(fleet, free_port, *flags: str, backends: list[str] | None = None) -> str:
    fleet_, _ = fleet
    return fleet_.add_router(free_port("127.0.0.1"),
                             ["--health-interval", "0.2", "--scrape-interval", "0.2", *flags],
                             backends=backends)


def metric(base: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain ``label``)."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    found = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(value) for labels, value in found if label in labels)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_router_authenticates_at_the_edge_in_front_of_keyless_engines(fleet, free_port):
    router = router_with(fleet, free_port, "--api-key", KEY, "--api-key-file", str(fleet[1]))
    body = {"prompt": "hello", "max_tokens": 2}
    url = f"{router}/v1/completions"
    for headers in ({}, bearer("sk-wrong"), {"Authorization": KEY}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{router}/v1/models", timeout=10).status_code == 401
    for key in (KEY, OTHER_KEY):
        assert httpx.post(url, json=body, headers=bearer(key), timeout=60).status_code == 200
    # the block view confirms prompts offline: off unless --enable-debug, even with a key
    assert httpx.get(f"{router}/debug/blocks", headers=bearer(KEY), timeout=5).status_code == 404
    assert httpx.get(f"{router}/health", timeout=5).status_code == 200  # probes stay open


def test_debug_endpoint_when_enabled_is_behind_the_key(fleet, free_port):
    router = router_with(fleet, free_port, "--api-key", KEY, "--enable-debug")
    assert httpx.get(f"{router}/debug/blocks", timeout=5).status_code == 401
    r = httpx.get(f"{router}/debug/blocks", headers=bearer(KEY), timeout=5)
    assert r.status_code == 200 and "replicas" in r.json()


def test_engine_metrics_port_serves_metrics_and_probes_only(fleet):
    fleet_, _ = fleet
    host = fleet_.config.engine_urls()[0].removeprefix("http://").split(":")[0]
    side = f"http://{host}:{fleet_.metrics_port}"
    assert "shoal:num_requests_running" in httpx.get(f"{side}/metrics", timeout=5).text
    assert httpx.get(f"{side}/health", timeout=5).status_code == 200
    assert httpx.post(f"{side}/v1/completions", json={"prompt": "x"}, timeout=5).status_code \
        == 404


def open_stalled_stream(url: str, body: dict) -> socket.socket:
    """A streaming request from a client that never reads its answer (tiny receive window)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_stalled_reader_is_aborted_after_the_stall_window_and_its_blocks_freed(fleet, wait_for):
    engine = fleet[0].config.engine_urls()[0]
    aborted = metric(engine, "shoal:request_success_total", 'finished_reason="abort"')
    # long and wide (5 logprobs per token: ~500 bytes per event) so the socket buffers fill long
    # before the request could finish by itself
    sock = open_stalled_stream(engine, {"prompt": "stall", "max_tokens": 4000, "stream": True,
                                        "ignore_eos": True, "logprobs": 5})
    try:
        wait_for(lambda: metric(engine, "shoal:num_requests_running") >= 1, timeout=30,
                 what="the stalled request running")
        assert metric(engine, "shoal:kv_cache_usage_perc") > 0
        wait_for(lambda: metric(engine, "shoal:num_requests_running") == 0
                 and metric(engine, "shoal:kv_cache_usage_perc") == 0, timeout=90,
                 what="the stalled request aborted and its blocks freed")
        assert metric(engine, "shoal:request_success_total", 'finished_reason="abort"') \
            == aborted + 1
        # a good client is served meanwhile
        assert httpx.post(f"{engine}/v1/completions", json={"prompt": "ok", "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        sock.close()


def test_stopped_upstream_times_out_at_the_router(fleet, free_port):
    fleet_, _ = fleet
    engine = fleet_.config.engine_urls()[1]
    router = router_with(fleet, free_port, "--first-byte-timeout", "1.5",
                         backends=[engine])
    serve = psutil.Process(fleet_.engines[1].pid)
    serve.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=30)
        took = time.monotonic() - t0
    finally:
        serve.send_signal(signal.SIGCONT)
    assert r.status_code == 504, r.text
    assert 1.0 < took < 15, took
    assert r.json()["error"]["message"]


def test_head_and_body_limits_are_enforced_while_reading(fleet, free_port):
    router = router_with(fleet, free_port, "--max-header-bytes", "16384",
                         "--max-request-body-bytes", "100000")
    big_header = httpx.post(f"{router}/v1/completions", headers={"x-big": "a" * 50_000},
                            json={"prompt": "x", "max_tokens": 1}, timeout=10)
    assert big_header.status_code == 431
    big_body = httpx.post(f"{router}/v1/completions", timeout=10,
                          json={"prompt": "x" * 200_000, "max_tokens": 1})
    assert big_body.status_code == 413
    assert big_body.json()["error"]["code"] == "request_too_large"
    assert httpx.post(f"{router}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      timeout=60).status_code == 200


def test_connection_cap_answers_503_past_it_while_health_answers(fleet, free_port, wait_for):
    router = router_with(fleet, free_port, "--max-connections", "4")
    host, port = router.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(5)]
    try:
        def refused() -> httpx.Response | None:
            with httpx.Client(timeout=5) as c:
                r = c.get(f"{router}/v1/models")
            return r if r.status_code == 503 else None

        r = wait_for(refused, timeout=10, what="a 503 past the cap")
        assert r.json()["error"]["code"] == "too_many_connections"
        assert r.headers["connection"] == "close"
        for probe in ("/health", "/ready"):
            with httpx.Client(timeout=5) as c:
                assert c.get(f"{router}{probe}").status_code == 200
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: httpx.get(f"{router}/v1/models", timeout=10).status_code == 200,
             timeout=10, what="served again under the cap")


def test_engine_killed_by_one_request_costs_only_its_replica(fleet, free_port, wait_for):
    fleet_, _ = fleet
    engines = fleet_.config.engine_urls()
    router = router_with(fleet, free_port)
    served_before = {e: metric(e, "shoal:request_success_total") for e in engines}
    body = {"prompt": "the poison request", "max_tokens": 3000, "ignore_eos": True}
    outcome: dict = {}

    def send() -> None:
        outcome["response"] = httpx.post(f"{router}/v1/completions", json=body, timeout=120)

    sender = threading.Thread(target=send)
    sender.start()
    def running_on() -> int | None:
        busy = [i for i, e in enumerate(engines) if metric(e, "shoal:num_requests_running")]
        return busy[0] if busy else None

    wait_for(lambda: running_on() is not None, timeout=30, what="the request on one engine")
    victim = running_on()
    assert victim is not None
    survivor = engines[1 - victim]
    core = [c for c in psutil.Process(fleet_.engines[victim].pid).children()
            if "core_proc" in " ".join(c.cmdline())]
    assert len(core) == 1
    core[0].kill()  # kill -9: the engine core dies while serving this request
    sender.join(60)
    r = outcome["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_died", r.text
    assert metric(router, "shoal:router_retries_total") == 0
    # the same request again (what an SDK's retry sends), and variants that differ only in
    # what cannot change execution (issue 36: a new user walked the fleet): never to the
    # other replica
    variants = [body, {**body, "user": "someone-else"},
                {"user": "x", "metadata": {"run": "2"}, **dict(reversed(body.items()))}]
    for variant in variants:
        again = httpx.post(f"{router}/v1/completions", json=variant, timeout=60)
        assert again.status_code == 503, (variant, again.text)
    assert metric(survivor, "shoal:num_requests_running") == 0
    assert metric(survivor, "shoal:request_success_total") == served_before[survivor]
    # the other replica keeps serving everyone else
    for k in range(3):
        ok = httpx.post(f"{router}/v1/completions", timeout=60,
                        json={"prompt": f"a healthy request {k}", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert metric(survivor, "shoal:request_success_total") == served_before[survivor] + 3
    assert fleet_.engines[victim].wait(30) != 0  # the hit replica exits (and restarts)
