"""Issue 36 at TP = 2, through a real `shoal serve --tensor-parallel-size 2` on loopback: a
hostile request gets a clear 400 and nothing else changes. No rank dies or restarts (the
same rank processes before and after), /health stays 200, a request streaming beside the
poison finishes normally, and the KV cache returns to idle.

The poisons:
- a request whose content makes every rank's step raise (the fault plugin's stand-in for any
  input that trips the model or the sampler; before, the raising rank exited and took the
  replica down, where one rank in process isolated the request);
- a grammar within the size bounds but over the compile budget (8,000 alternatives);
- a grammar that does not compile (an unclosed regex).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.plugins import FAULTS

from .test_serve_rank_failures import Stream

pytestmark = pytest.mark.slow

MARKER = "poison-4e1b"
BUDGET_S = 0.25


@pytest.fixture(scope="module")
def poisoned_server(tiny_qwen3, tmp_path_factory):
    from .conftest import TPServer

    server = TPServer(tiny_qwen3, tmp_path_factory.mktemp("tp-poison") / "serve.log",
                      "--grammar-compile-timeout", str(BUDGET_S),
                      env={"SHOAL_DEBUG_PLUGINS": FAULTS, "SHOAL_TEST_RANK_POISON_STOP": MARKER})
    try:
        server.wait_ready(timeout_s=300.0)  # three processes starting on a loaded machine
        yield server
    finally:
        server.stop()


def metric(server, name: str) -> float:
    import re

    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"metric {name} not exported"
    return float(match.group(1))


def wait_idle(server, within_s: float = 30.0) -> None:
    names = ("shoal:num_requests_running", "shoal:num_requests_waiting",
             "shoal:kv_cache_usage_perc")
    deadline = time.monotonic() + within_s
    while True:
        values = {n: metric(server, n) for n in names}
        if not any(values.values()):
            return
        assert time.monotonic() < deadline, f"not idle after {within_s} s: {values}"
        time.sleep(0.1)


def complete(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=120,
                      json={"model": "tp-test", "prompt": "pick one", "max_tokens": 4, **body})


def poisoned_beside_a_stream(server, poison: dict) -> httpx.Response:
    """Send the poison while a long greedy stream runs; the stream must finish normally."""
    ranks = server.rank_pids()
    assert len(ranks) == 2
    stream = Stream(server.base_url, "a neighbour streams on")
    stream.body["max_tokens"] = 48
    stream.start()
    assert stream.first_token.wait(60), "the neighbour never streamed"
    response = complete(server, **poison)
    stream.join(120)
    assert not stream.is_alive() and stream.transport_error is None
    assert not stream.ended_with_error(), stream.events[-3:]
    text = "".join(__import__("json").loads(e)["choices"][0]["text"]
                   for e in stream.events if e != "[DONE]")
    assert len(stream.events) >= 2 and text, stream.events[-3:]
    assert server.health() == 200
    assert server.rank_pids() == ranks, "a rank died or was replaced"
    wait_idle(server)
    return response


def test_a_request_that_fails_every_rank_gets_a_400_and_the_replica_serves_on(
        poisoned_server):
    r = poisoned_beside_a_stream(poisoned_server, {"stop": [MARKER], "max_tokens": 8})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "request" and "failed in the engine" in error["message"], error
    assert "injected content fault" in poisoned_server.log()  # the cause is in the log
    # and the same poison again, streamed: an error event, not a dead replica
    with httpx.stream("POST", poisoned_server.base_url + "/v1/completions", timeout=120,
                      json={"model": "tp-test", "prompt": "again", "max_tokens": 8,
                            "stream": True, "stop": [MARKER]}) as response:
        body = response.read().decode()
    assert response.status_code == 400 or '"error"' in body, body
    assert complete(poisoned_server).status_code == 200


def test_a_grammar_over_the_compile_budget_gets_a_400_and_no_rank_dies(poisoned_server):
    from shoal.runtime.structured.spec import MAX_GRAMMAR_BYTES, choice_ebnf

    grammar = choice_ebnf([f"item {i:05d} of many" for i in range(8000)])
    assert len(grammar) < MAX_GRAMMAR_BYTES  # within the bounds: only the budget stops it
    r = poisoned_beside_a_stream(poisoned_server, {"structured_outputs": {"grammar": grammar}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs.grammar" and "compile" in error["message"]


def test_a_grammar_that_does_not_compile_gets_a_400_and_constrained_requests_still_work(
        poisoned_server):
    r = poisoned_beside_a_stream(poisoned_server,
                                 {"structured_outputs": {"regex": "(unclosed"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs.regex"
    # the ranks still take a grammar the core compiled (serialized in the plan)
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(complete(
        poisoned_server, max_tokens=5, structured_outputs={"choice": ["yes", "no"]})))
        for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    assert all(r.json()["choices"][0]["text"] in ("yes", "no") for r in results)
    wait_idle(poisoned_server)
