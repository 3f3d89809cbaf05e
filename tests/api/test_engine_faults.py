"""A dead or hung engine is fatal: liveness fails, live streams end with an error, the server
exits non-zero (so the container restarts). A failed startup exits non-zero with the cause."""

from __future__ import annotations

import shutil
import signal
import threading
import time

import httpx
import openai
import pytest


def stream_until_error(server, started: threading.Event, outcome: dict) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    try:
        stream = client.completions.create(model=server.model, prompt="long: ", max_tokens=3000,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()
        outcome["result"] = "ended without an error"
    except openai.APIError as exc:
        outcome["result"] = exc
    finally:
        started.set()


def non_streaming_status(server, outcome: dict) -> None:
    response = httpx.post(server.v1 + "/completions", timeout=60,
                          json={"prompt": "also long", "max_tokens": 3000, "ignore_eos": True})
    outcome["non_streaming_status"] = response.status_code


def health_status(server) -> int | None:
    try:
        return server.get("/health").status_code
    except httpx.TransportError:
        return None  # the server has exited or is exiting


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill -9", "SIGSTOP"])
def test_engine_death_fails_health_errors_streams_and_exits_non_zero(start_server, how):
    server = start_server()
    started, outcome = threading.Event(), {}
    reader = threading.Thread(target=stream_until_error, args=(server, started, outcome))
    reader.start()
    waiting = threading.Thread(target=non_streaming_status, args=(server, outcome))
    assert started.wait(30)
    waiting.start()
    deadline = time.monotonic() + 60  # the non-streaming request is in the engine too
    while (server.metric("shoal:num_requests_running")
           + server.metric("shoal:num_requests_waiting")) < 2:
        assert time.monotonic() < deadline, "the second request never reached the engine"
        time.sleep(0.05)
    assert server.get("/health").status_code == 200
    engine = server.engine_process()
    t0 = time.monotonic()
    engine.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGSTOP)
    # detected by the process watch or the 3 s heartbeat timeout; the bound only allows for
    # a loaded machine's scheduling delays (a missed detection never ends)
    # the server may already have exited (a refused connection fails liveness too) when a
    # loaded machine delays the next probe past its shutdown
    while server.proc.poll() is None and health_status(server) != 503:
        assert time.monotonic() - t0 < 30.0, "/health still 200 thirty seconds after the death"
        time.sleep(0.1)
    reader.join(10)
    waiting.join(10)
    assert outcome["non_streaming_status"] == 503
    assert isinstance(outcome.get("result"), openai.APIError), outcome
    assert "engine" in str(outcome["result"]).lower()
    assert server.proc.wait(15) != 0
    assert "engine" in server.log()


@pytest.mark.slow
def test_a_startup_failure_exits_non_zero_with_the_engines_error(start_server, small_qwen3,
                                                                  tmp_path):
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copy(small_qwen3 / name, broken / name)
    server = start_server(model_dir=broken, wait=False)
    assert server.proc.wait(60) != 0
    log = server.log()
    assert "engine" in log and "safetensors" in log.lower(), log[-2000:]


@pytest.mark.slow
def test_the_engine_process_does_not_outlive_a_killed_api_process(start_server):
    server = start_server()
    engine = server.engine_process()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    engine.wait(10)  # psutil: raises TimeoutExpired if the orphan keeps running
