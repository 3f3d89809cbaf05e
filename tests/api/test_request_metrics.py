"""vLLM's per-request timing histograms: queue, prefill, decode, inference and time per
output token, one observation per finished engine request, under both prefixes."""

from __future__ import annotations

import re
import threading

import openai
import pytest

PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds",
          "request_decode_time_seconds", "request_inference_time_seconds",
          "request_time_per_output_token_seconds", "e2e_request_latency_seconds")
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@pytest.fixture(scope="module")
def server(start_server):
    """One request runs at a time, so a second concurrent one really waits in the queue."""
    return start_server("--max-num-seqs", "1", "--metrics-compat", "vllm")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def snapshot(server) -> dict[str, float]:
    return {f"{prefix}:{phase}_{kind}": server.metric(f"{prefix}:{phase}_{kind}")
            for prefix in ("shoal", "vllm") for phase in PHASES for kind in ("count", "sum")}


def moved(server, before: dict[str, float]) -> dict[str, float]:
    after = snapshot(server)
    return {name: after[name] - before[name] for name in after}


def test_every_finished_engine_request_is_observed_once_in_each_phase(server, client):
    before = snapshot(server)
    out = client.completions.create(model=server.model, prompt="count the phases", n=2,
                                    max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for _ in stream) >= 4
    delta = moved(server, before)
    for prefix in ("shoal", "vllm"):
        for phase in PHASES:
            assert delta[f"{prefix}:{phase}_count"] == 3, (prefix, phase)
        assert delta[f"{prefix}:request_queue_time_seconds_sum"] == pytest.approx(
            delta["shoal:request_queue_time_seconds_sum"])
    s = {phase: delta[f"shoal:{phase}_sum"] for phase in PHASES}
    assert s["request_prefill_time_seconds"] > 0 and s["request_decode_time_seconds"] > 0
    assert s["request_time_per_output_token_seconds"] > 0
    # the phases split one timeline: inference = prefill + decode ...
    assert s["request_inference_time_seconds"] == pytest.approx(
        s["request_prefill_time_seconds"] + s["request_decode_time_seconds"], abs=1e-6)
    # ... and the engine's part (queue + inference) lies within the end-to-end latency
    assert s["request_queue_time_seconds"] + s["request_inference_time_seconds"] <= (
        s["e2e_request_latency_seconds"] + 1e-3)


def test_a_request_that_waits_for_the_batch_shows_it_as_queue_time(server, client):
    before = snapshot(server)

    def one(i: int) -> None:
        client.completions.create(model=server.model, prompt=f"wait your turn {i}",
                                  max_tokens=150, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    delta = moved(server, before)
    assert delta["shoal:request_queue_time_seconds_count"] == 2
    # max_num_seqs 1: the second waits while the first runs, about half the inference time
    assert delta["shoal:request_queue_time_seconds_sum"] >= (
        0.25 * delta["shoal:request_inference_time_seconds_sum"])


def test_the_buckets_are_vllms(server):
    text = server.get("/metrics").text
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        bounds = re.findall(rf'^vllm:{name}_bucket{{[^}}]*le="([^"]+)"', text, re.M)
        assert bounds == [str(b) for b in VLLM_REQUEST_LATENCY_BUCKETS] + ["+Inf"], name

