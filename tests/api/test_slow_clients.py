"""Clients that hold connections without finishing them, against a real ``shoal serve``:
slowloris (headers trickled a byte at a time), idle keep-alive connections and slow
readers of streams. Bounded loops; while they hold on, probes and completions answer and
the API process's memory stays flat. (Mass disconnects: ``test_cancellation.py``.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import psutil
import pytest

from .test_cancellation import wait_idle_within

SLOWLORIS = 100
IDLE_KEEPALIVES = 300
SLOW_READERS = 16
MEMORY_SLACK = 64 * 1024 * 1024  # bytes the API process may grow by meanwhile


def rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def still_serving(server) -> None:
    """A probe and a completion, each within a generous bound (the machine is shared)."""
    started = time.monotonic()
    assert server.get("/health", timeout=10).status_code == 200
    response = httpx.post(server.v1 + "/completions", headers=server.headers(), timeout=60,
                          json={"model": server.model, "prompt": "still there?",
                                "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 30


def open_socket(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def test_slowloris_connections_do_not_stop_the_server(server):
    before = rss(server)
    sockets = []
    try:
        for _ in range(SLOWLORIS):
            s = open_socket(server)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            sockets.append(s)
        for i in range(10):  # ~1 s of trickling, one header byte per connection per round
            for s in sockets:
                with contextlib.suppress(OSError):  # the server may close a slow one
                    s.sendall(b"X-a"[i % 3:i % 3 + 1])
            time.sleep(0.1)
        still_serving(server)
    finally:
        for s in sockets:
            s.close()
    assert rss(server) - before < MEMORY_SLACK
    still_serving(server)


def test_idle_keep_alive_connections_do_not_stop_the_server(server):
    before = rss(server)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    sockets = []
    try:
        for _ in range(IDLE_KEEPALIVES):
            s = open_socket(server)
            s.sendall(request)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            sockets.append(s)  # kept open and idle
        still_serving(server)
    finally:
        for s in sockets:
            s.close()
    assert rss(server) - before < MEMORY_SLACK
    still_serving(server)


@pytest.mark.slow
async def test_slow_readers_keep_memory_flat_and_the_server_answering(server):
    before = rss(server)
    body = {"model": server.model, "prompt": "slow reader", "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    peak = before

    async def slow_reader(http: httpx.AsyncClient) -> int:
        completion_tokens = 0
        async with http.stream("POST", "/v1/completions", json=body,
                               headers=server.headers()) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        completion_tokens = usage["completion_tokens"]
                    await asyncio.sleep(0.02)  # reads far slower than the engine writes
        return completion_tokens

    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        readers = [asyncio.create_task(slow_reader(http)) for _ in range(SLOW_READERS)]
        while not all(r.done() for r in readers):
            peak = max(peak, rss(server))
            probe = await http.get("/health", timeout=10)
            assert probe.status_code == 200
            await asyncio.sleep(0.2)
        counts = [r.result() for r in readers]
    assert counts == [200] * SLOW_READERS  # every token arrived
    assert peak - before < MEMORY_SLACK, f"grew by {(peak - before) / 2**20:.0f} MiB"
    await asyncio.to_thread(wait_idle_within, server, 10)
    await asyncio.to_thread(still_serving, server)
