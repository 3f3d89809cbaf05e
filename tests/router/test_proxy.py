"""The router as a reverse proxy, against fake engines on 127.0.0.x (real HTTP, real
processes): affinity end to end, streaming pass-through, cancellation, retry, ejection."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

LONG_PREFIX = "You are a helpful assistant for the shipping company. " * 6


def prompts_seen(fleet) -> dict[str, int]:
    return {e: len(fleet.admin(e)["prompts"]) for e in fleet.engines}


def test_same_prefix_lands_on_one_replica_and_others_spread(fake_fleet):
    fleet = fake_fleet(3)
    for user in range(6):
        r = httpx.post(f"{fleet.router}/v1/completions", timeout=10,
                       json={"prompt": LONG_PREFIX + f"user {user} asks", "max_tokens": 1})
        assert r.status_code == 200
    seen = prompts_seen(fleet)
    assert sorted(seen.values()) == [0, 0, 6]
    for k in range(12):
        httpx.post(f"{fleet.router}/v1/completions", timeout=10,
                   json={"prompt": f"{k} another system prompt entirely " * 8, "max_tokens": 1})
    assert sum(1 for n in prompts_seen(fleet).values() if n) >= 2


def test_new_system_prompts_with_a_shared_opening_spread_evenly(fake_fleet):
    """Six system prompts that open with the same line (one block in common) are six new
    prefixes: each goes to the replica whose cache has been asked for the least lately, so
    three replicas get two each, rather than all six following the first one's opening."""
    fleet = fake_fleet(3)
    opening = "Harbor services assistant, version 7. " * 2
    for k in range(6):
        r = httpx.post(f"{fleet.router}/v1/completions", timeout=10, json={
            "prompt": opening + f"You handle berth {k} and nothing else. " * 10,
            "max_tokens": 1})
        assert r.status_code == 200
    assert sorted(prompts_seen(fleet).values()) == [2, 2, 2]


def test_streaming_passes_through_byte_for_byte(fake_fleet):
    fleet = fake_fleet(1)
    body = {"prompt": "hello", "stream": True, "max_tokens": 6, "delay": 0.01}
    direct = httpx.post(f"{fleet.engines[0]}/v1/completions", json=body, timeout=10)
    with httpx.stream("POST", f"{fleet.router}/v1/completions", json=body, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = list(r.iter_raw())
    assert b"".join(chunks) == direct.content
    assert len(chunks) > 1  # relayed as it came, not buffered into one body


def test_first_chunk_arrives_before_the_stream_ends(fake_fleet):
    fleet = fake_fleet(1)
    body = {"prompt": "slow", "stream": True, "max_tokens": 4, "delay": 0.5}
    start = time.monotonic()
    with httpx.stream("POST", f"{fleet.router}/v1/completions", json=body, timeout=10) as r:
        chunks = r.iter_raw()
        first = next(chunks)
        first_at = time.monotonic() - start
        rest = b"".join(chunks)
    total = time.monotonic() - start
    assert first.startswith(b"data: ") and rest.endswith(b"[DONE]\n\n")
    assert first_at < total - 1.0


def test_client_disconnect_cancels_the_upstream_request(fake_fleet, wait_for):
    fleet = fake_fleet(1)
    engine = fleet.engines[0]
    body = {"prompt": "long stream", "stream": True, "max_tokens": 200, "delay": 0.05}
    with httpx.stream("POST", f"{fleet.router}/v1/completions", json=body, timeout=10) as r:
        chunks = r.iter_raw()  # keep the iterator: dropping it closes the connection
        next(chunks)
        assert fleet.admin(engine)["open"] == 1
    # leaving the block closed the connection to the router mid-stream
    wait_for(lambda: fleet.admin(engine)["aborted"] == 1, timeout=10, what="upstream abort")
    assert fleet.admin(engine)["open"] == 0


def test_client_disconnect_before_first_byte_cancels_upstream(fake_fleet, wait_for):
    """A non-streaming request: nothing is sent until the engine finishes, so the router
    must notice the disconnect on its own and drop the upstream connection."""
    fleet = fake_fleet(1)
    engine = fleet.engines[0]
    body = {"prompt": "wait", "max_tokens": 1, "delay": 3.0}
    try:
        httpx.post(f"{fleet.router}/v1/completions", json=body, timeout=0.5)
    except httpx.ReadTimeout:
        pass
    wait_for(lambda: fleet.admin(engine)["aborted"] == 1, timeout=10, what="upstream abort")
    metrics = httpx.get(f"{fleet.router}/metrics").text
    assert "shoal:router_client_disconnects_total 1.0" in metrics


def test_retry_on_another_replica_before_first_byte(fake_fleet):
    fleet = fake_fleet(2)
    body = {"prompt": LONG_PREFIX, "max_tokens": 1}
    first = httpx.post(f"{fleet.router}/v1/completions", json=body, timeout=10).json()
    home = next(e for e in fleet.engines if e.endswith(first["replica"]))
    # its home refuses before doing any work (marked retry-safe): the router tries the other
    fleet.admin(home, fail=503, fail_retry_safe=True)
    again = httpx.post(f"{fleet.router}/v1/completions", json=body, timeout=10)
    assert again.status_code == 200 and not home.endswith(again.json()["replica"])
    assert "shoal:router_retries_total 1.0" in httpx.get(f"{fleet.router}/metrics").text


@pytest.mark.parametrize("status", [500, 503])
def test_a_failure_not_marked_retry_safe_is_not_replayed_and_stays_on_its_replica(
        fake_fleet, status):
    fleet = fake_fleet(2, "--policy", "round-robin")
    a, b = fleet.engines
    for engine in fleet.engines:  # the request may have killed it: only its client hears
        fleet.admin(engine, fail=status)
    body = {"prompt": "poison", "max_tokens": 1}
    first = httpx.post(f"{fleet.router}/v1/completions", json=body, timeout=10)
    assert first.status_code == status
    failed = {e: fleet.admin(e).get("failed", 0) for e in fleet.engines}
    assert sorted(failed.values()) == [0, 1]  # one replica saw it, not both
    fleet.admin(a, fail=0)
    fleet.admin(b, fail=0)
    # the client's retries go to the replica it failed on only (round robin would alternate)
    for _ in range(3):
        httpx.post(f"{fleet.router}/v1/completions", json=body, timeout=10)
    home = next(e for e, n in failed.items() if n)
    other = next(e for e in fleet.engines if e != home)
    assert fleet.admin(other)["served"] == 0 and fleet.admin(home)["served"] == 3
    metrics = httpx.get(f"{fleet.router}/metrics").text
    assert "shoal:router_retries_total 0.0" in metrics
    # anything else still goes to both
    for k in range(2):
        assert httpx.post(f"{fleet.router}/v1/completions", timeout=10,
                          json={"prompt": f"fine {k}", "max_tokens": 1}).status_code == 200
    assert fleet.admin(other)["served"] >= 1


def test_unready_replica_is_ejected_and_returns(fake_fleet, wait_for):
    fleet = fake_fleet(2)
    a, b = fleet.engines
    fleet.admin(a, ready=False)
    wait_for(lambda: f'shoal:router_replica_ready{{replica="{a}"}} 0.0'
             in httpx.get(f"{fleet.router}/metrics").text, timeout=10, what="ejection")
    for k in range(6):
        r = httpx.post(f"{fleet.router}/v1/completions", timeout=10,
                       json={"prompt": f"prompt {k} " * 20, "max_tokens": 1})
        assert b.endswith(r.json()["replica"])
    fleet.admin(a, ready=True)
    wait_for(lambda: f'shoal:router_replica_ready{{replica="{a}"}} 1.0'
             in httpx.get(f"{fleet.router}/metrics").text, timeout=10, what="re-admission")


def test_killed_replica_is_ejected_and_requests_keep_succeeding(fake_fleet):
    fleet = fake_fleet(3)
    victim = fleet.engines[0]
    os.killpg(fleet.procs[victim].pid, signal.SIGKILL)
    fleet.procs[victim].wait()
    for k in range(12):  # no waiting for the health poll: failed connects retry at once
        r = httpx.post(f"{fleet.router}/v1/completions", timeout=10,
                       json={"prompt": f"{k} distinct prompt text " * 10, "max_tokens": 1})
        assert r.status_code == 200
        assert not victim.endswith(r.json()["replica"])


def test_router_endpoints_and_errors(fake_fleet):
    fleet = fake_fleet(1)
    assert httpx.get(f"{fleet.router}/health").status_code == 200
    assert httpx.get(f"{fleet.router}/ready").status_code == 200
    assert httpx.get(f"{fleet.router}/nope").status_code == 404
    fleet.admin(fleet.engines[0], ready=False)
    time.sleep(0.6)
    assert httpx.get(f"{fleet.router}/ready").status_code == 503
    r = httpx.post(f"{fleet.router}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503 and "no replica" in r.json()["error"]["message"]


def test_anthropic_messages_and_count_tokens_are_forwarded_with_their_headers(fake_fleet):
    """The router forwards /v1/messages (streamed too) and /v1/messages/count_tokens; without
    router keys the client's x-api-key and anthropic-version pass through."""
    fleet = fake_fleet(1)
    headers = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(f"{fleet.router}{path}", json=body, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"replica": fleet.engines[0].removeprefix("http://"), "path": path,
                            **headers}
    with httpx.stream("POST", f"{fleet.router}/v1/messages", json={**body, "stream": True},
                      headers=headers, timeout=10) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and len(events) == 3
