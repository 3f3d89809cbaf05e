"""Through a real `shoal serve --tensor-parallel-size 2`: a rank killed with SIGKILL or
stopped with SIGSTOP mid-generation takes the whole server down the way Kubernetes needs:
/health answers 503 within 5 s, live streams end with an error event, the server exits
non-zero, and no rank process is left behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


class Stream(threading.Thread):
    """A streaming completion read in the background, line by line."""

    def __init__(self, base_url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url = base_url + "/v1/completions"
        self.body = {"model": "tp-test", "prompt": prompt, "max_tokens": 3000,
                     "ignore_eos": True, "stream": True, "temperature": 0.0}
        self.events: list[str] = []
        self.first_token = threading.Event()
        self.transport_error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60.0) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first_token.set()
        except httpx.HTTPError as exc:  # a dropped connection is recorded, not raised
            self.transport_error = exc
        finally:
            self.first_token.set()

    def ended_with_error(self) -> bool:
        """The last JSON event is an error (a closing [DONE] may follow it) and no choice
        ever finished normally."""
        payloads = [json.loads(e) for e in self.events if e != "[DONE]"]
        finished = any(c.get("finish_reason") for p in payloads for c in p.get("choices", []))
        return bool(payloads) and "error" in payloads[-1] and not finished


def hurt_a_rank_mid_generation(server, sig: int) -> tuple[list[Stream], list[int], float]:
    streams = [Stream(server.base_url, f"tensor parallel stream {i}") for i in range(2)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(30), "no token streamed before the fault"
    ranks = server.rank_pids()
    assert len(ranks) == 2, f"expected 2 rank processes, found {ranks}"
    everything = [p.pid for p in server.descendants()]
    os.kill(ranks[1], sig)
    return streams, everything, time.monotonic()


def assert_engine_went_down(server, streams, pids, hurt_at, alive_after,
                            health_within_s: float) -> None:
    saw_503_at = None
    while time.monotonic() - hurt_at < health_within_s:
        if server.health() == 503:
            saw_503_at = time.monotonic()
            break
        time.sleep(0.05)
    assert saw_503_at is not None, f"/health not 503 within {health_within_s} s:\n{server.log()}"
    assert server.proc.wait(timeout=30) != 0, "the server must exit non-zero"
    for stream in streams:
        stream.join(timeout=10)
        assert not stream.is_alive()
        assert stream.ended_with_error(), f"stream ended without an error event: " \
                                          f"{stream.events[-3:]} {stream.transport_error}"
        assert len(stream.events) > 1  # it was really mid-generation
    assert alive_after(pids, 5) == [], "processes outlived the server"


def test_sigkill_of_a_rank_brings_the_server_down(tp_server, alive_after):
    server = tp_server()
    streams, pids, hurt_at = hurt_a_rank_mid_generation(server, signal.SIGKILL)
    assert_engine_went_down(server, streams, pids, hurt_at, alive_after, health_within_s=5)
    assert "rank 1" in server.log()  # the cause is named in the server's log


def test_sigstop_of_a_rank_brings_the_server_down_after_the_rank_timeout(tp_server,
                                                                          alive_after):
    server = tp_server("--rank-timeout", "2")
    streams, pids, hurt_at = hurt_a_rank_mid_generation(server, signal.SIGSTOP)
    assert_engine_went_down(server, streams, pids, hurt_at, alive_after, health_within_s=5)
    # the executor names the stopped rank; the API's heartbeat watchdog (step running past
    # the same rank_timeout) is the backstop that may fire first on a loaded machine
    log = server.log()
    assert "rank 1: made no progress for 2 s" in log or "stuck in one step" in log, log


def test_a_rank_that_cannot_load_its_shard_fails_the_server_startup(tp_server):
    import subprocess

    from tests.plugins import FAULTS

    server = tp_server(env={"SHOAL_DEBUG_PLUGINS": FAULTS, "SHOAL_TEST_RANK_FAULT": "1:load"},
                       wait=False)
    try:
        code = server.proc.wait(timeout=60)  # fails fast: no waiting for a timeout
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still running with a failed rank:\n{server.log()}") \
            from None
    assert code != 0
    log = server.log()
    assert "rank 1" in log and "failed to load its shard" in log
    assert "injected load fault on rank 1" in log
    assert server.health() is None  # the port is closed: nothing left serving


def hurt_an_idle_rank(server, sig: int) -> tuple[list[int], float]:
    """One request completes (the engine really served), then nothing runs: the rank is
    hurt while the engine core is idle, so only the idle liveness probe can notice."""
    r = httpx.post(server.base_url + "/v1/completions", timeout=60.0,
                   json={"model": "tp-test", "prompt": "idle ranks", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert server.health() == 200
    ranks = server.rank_pids()
    assert len(ranks) == 2, f"expected 2 rank processes, found {ranks}"
    everything = [p.pid for p in server.descendants()]
    os.kill(ranks[1], sig)
    return everything, time.monotonic()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_an_idle_rank_that_dies_or_stops_brings_the_server_down(tp_server, alive_after, sig):
    server = tp_server()  # default --rank-timeout (30 s): the idle probe must not wait for it
    pids, hurt_at = hurt_an_idle_rank(server, sig)
    assert_engine_went_down(server, [], pids, hurt_at, alive_after, health_within_s=5)
    log = server.log()
    assert "rank 1" in log, log
    if sig == signal.SIGSTOP:
        assert "is stopped" in log, log
