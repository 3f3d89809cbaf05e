"""Issue 36, a real ``shoal serve`` with a key: /metrics on the serving port takes the key
(prefix-cache counters tell one tenant about another's prompts) while ``--metrics-port``
stays open for Prometheus; a SIGTERM to the whole process group (systemd, ``kill --
-PGID``) drains like a SIGTERM to the API process alone. The signal test ends the server,
so it runs last."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import openai
import pytest

from .conftest import API_KEY, free_port


@pytest.fixture(scope="module")
def keyed_server(start_server):
    metrics_port = free_port()
    server = start_server("--metrics-port", str(metrics_port), "--shutdown-timeout", "60",
                          api_key=API_KEY, new_session=True)
    server.metrics_port = metrics_port  # type: ignore[attr-defined]
    return server


def test_metrics_on_the_serving_port_need_the_key_and_the_metrics_port_does_not(keyed_server):
    server = keyed_server
    assert server.get("/metrics").status_code == 401
    wrong = httpx.get(server.base_url + "/metrics", timeout=5,
                      headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    keyed = httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=5)
    assert keyed.status_code == 200 and "shoal:num_requests_running" in keyed.text
    side = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5)
    assert side.status_code == 200 and "shoal:num_requests_running" in side.text
    assert server.get("/health").status_code == 200  # probes stay open


def test_sigterm_to_the_process_group_drains_then_exits_zero(keyed_server):
    server = keyed_server
    engine = server.engine_process()
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    streaming = threading.Event()
    result: dict[str, object] = {}

    def stream() -> None:
        chunks = client.completions.create(model=server.model, prompt="drain me",
                                           max_tokens=120, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        for chunk in chunks:
            streaming.set()
            tokens += 1
            finish = chunk.choices[0].finish_reason or finish
        result["finish"], result["chunks"] = finish, tokens

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(60)
    # every process of the group at once: the API, the engine core (and any rank)
    os.killpg(os.getpgid(server.proc.pid), signal.SIGTERM)
    thread.join(120)
    assert result.get("finish") == "length", (result, server.log()[-3000:])
    assert server.proc.wait(60) == 0, server.log()[-3000:]
    assert not engine.is_running()  # stopped by the API after the drain, not left behind
    assert "engine core failed" not in server.log()
