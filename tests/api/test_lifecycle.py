"""Probes and lifecycle: readiness during startup and drain, SIGTERM drain, bounded queue."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest


@pytest.mark.slow
def test_ready_is_503_with_the_phase_until_warmup_ends(start_server):
    server = start_server(wait=False)
    # hold the engine in its startup (SIGSTOP) so the check cannot race the warmup
    engine = None
    deadline = time.monotonic() + 30
    while engine is None:
        assert time.monotonic() < deadline
        children = psutil.Process(server.proc.pid).children()
        engine = next((c for c in children
                       if "core_proc" in " ".join(c.cmdline())), None)
    engine.suspend()
    try:
        while True:
            assert time.monotonic() < deadline, "the port never opened"
            try:
                response = server.get("/ready")
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert response.status_code == 503
        assert response.json()["phase"] in {"starting", "loading", "profiling", "capturing"}
        assert response.json()["status"] == "starting"
        assert server.get("/health").status_code == 200  # alive, just not ready
        with httpx.Client() as http:
            early = http.post(server.v1 + "/completions", json={"prompt": "x"})
        assert early.status_code == 503
    finally:
        engine.resume()
    server.wait_ready()
    body = server.get("/ready").json()
    assert body["phase"] == body["status"] == "ready"
    assert set(body["phase_durations"]) == {"loading", "profiling", "capturing"}
    assert server.metric('shoal:startup_phase_duration_seconds') >= 0.0


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_zero(start_server):
    server = start_server("--shutdown-timeout", "6")
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    results: dict[str, object] = {}
    streaming = threading.Event()

    def short() -> None:
        stream = client.completions.create(model=server.model, prompt="short", max_tokens=10,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            streaming.set()
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        results["short"] = finish

    def long() -> None:
        out = client.completions.create(model=server.model, prompt="long", max_tokens=3500,
                                        temperature=0, extra_body={"ignore_eos": True})
        results["long"] = out.choices[0].finish_reason

    threads = [threading.Thread(target=short), threading.Thread(target=long)]
    for t in threads:
        t.start()
    assert streaming.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30  # the signal is handled on the loop's next turn
    while (ready := server.get("/ready")).status_code == 200:
        assert time.monotonic() < deadline, "/ready still 200 thirty seconds after SIGTERM"
        time.sleep(0.05)
    assert (ready.status_code, ready.json()["phase"], ready.json()["status"]) == (503, "draining", "draining")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=server.model, prompt="late", max_tokens=2)
    assert err.value.status_code == 503
    for t in threads:
        t.join(30)
    assert results == {"short": "length", "long": "abort"}  # finished; cut at the timeout
    assert server.proc.wait(15) == 0


@pytest.mark.slow
async def test_a_burst_beyond_the_queue_gets_429s_never_5xx_and_stays_ready(start_server):
    server = start_server("--max-num-seqs", "2", "--max-queued-requests", "3",
                          "--metrics-compat", "vllm")
    client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        try:
            await client.completions.create(model=server.model, prompt=f"burst {i}",
                                            max_tokens=30, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as exc:
            assert 1 <= int(exc.response.headers["retry-after"]) <= 60  # see admission.py
            return "429"

    outcomes = await asyncio.gather(*(one(i) for i in range(24)))
    assert outcomes.count("ok") >= 5  # the batch (2) plus the queue (3) always get in
    assert outcomes.count("429") >= 1
    assert set(outcomes) <= {"ok", "429"}  # any 5xx would have raised another error type
    assert server.get("/ready").status_code == 200
    # after the burst the queue is free again
    await client.completions.create(model=server.model, prompt="after", max_tokens=2)
    text = server.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:prompt_tokens_total",
                 "shoal:request_success_total"):
        assert name in text, name
    assert 'vllm:request_rejected_total{model_name="shoal-test",status="429"}' in text
