"""`shoal route --epp` against real `shoal serve` engines, driven by an ext_proc client that
streams like Envoy: affinity, header == metadata, subset hints, 503 / 429 immediate
responses, full-duplex body echo, gRPC health, and the picked endpoint really serving."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.router.conftest import http_ok, wait_until
from tests.router.epp_client import (
    EnvoyStream,
    Mode,
    body_message,
    destination,
    headers_message,
    pick_buffered,
    response_headers_message,
    start_epp,
)

pytestmark = pytest.mark.slow
SYSTEM = "You are the harbor master of a small port on a cold northern sea. " * 3


def chat(user: str, system: str = SYSTEM) -> dict:
    return {"model": "shoal-test", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


@pytest.fixture(scope="module")
def engines(tiny_qwen3, tmp_path_factory):
    """Two real engines with the vLLM metric names, on 127.0.0.2 and 127.0.0.3."""
    import os
    import signal
    import subprocess

    from tests.router.conftest import _free_port

    procs, urls = [], []
    logs = tmp_path_factory.mktemp("epp-engines")
    for i in range(2):
        host = f"127.0.0.{i + 2}"
        port = _free_port(host)
        log = open(logs / f"engine{i}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "serve", "--host", host, "--port", str(port),
             "--model", str(tiny_qwen3), "--served-model-name", "shoal-test",
             "--metrics-compat", "vllm", "--num-kv-blocks", "64", "--max-model-len", "512"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"}))
        urls.append(f"http://{host}:{port}")
    try:
        for url in urls:
            wait_until(lambda u=url: http_ok(f"{u}/ready"), timeout=180, what=f"{url} ready")
        yield urls
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(30)


@pytest.fixture
def epp(engines, spawn, free_port):
    return start_epp(spawn, free_port, engines)


def endpoints(urls: list[str]) -> list[str]:
    return [u.removeprefix("http://") for u in urls]


def test_engines_expose_what_endpoint_pickers_scrape(engines):
    text = httpx.get(f"{engines[0]}/metrics", timeout=5).text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="shoal-test"}}' in text, name
    assert ('vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="64"} 1.0'
            in text)
    models = httpx.get(f"{engines[0]}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["shoal-test"]


def test_health_services(epp):
    health = health_pb2_grpc.HealthStub(epp)
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


def test_same_prefix_same_endpoint_and_header_equals_metadata(epp, engines):
    picks = []
    for user in ("When is high tide?", "Which pier is free?", "Is the fog lifting?"):
        answer, _ = pick_buffered(epp, "/v1/chat/completions", chat(user))
        assert answer.HasField("request_body"), answer
        header, meta = destination(answer)
        assert header == meta
        assert answer.request_body.response.clear_route_cache
        picks.append(header.split(","))
    primaries = {p[0] for p in picks}
    assert len(primaries) == 1, picks  # one prefix, one home
    assert sorted(picks[0]) == sorted(endpoints(engines))  # the other one as the fallback
    # the data plane would now send the request there: it is a real model server
    served = httpx.post(f"http://{picks[0][0]}/v1/chat/completions",
                        json=chat("When is high tide?"), timeout=60)
    assert served.status_code == 200 and served.json()["choices"]
    # every prefix keeps its home while the fleet is idle
    for i in range(3):
        homes = {destination(pick_buffered(epp, "/v1/chat/completions",
                                           chat("Hello", system=f"Tug {i} " * 30))[0])[0]
                 for _ in range(3)}
        assert len(homes) == 1, homes


def test_subset_hint_restricts_the_choice(epp, engines):
    home = destination(pick_buffered(epp, "/v1/chat/completions", chat("Tide?"))[0])[0]
    home_endpoint = home.split(",")[0]
    other = next(e for e in endpoints(engines) if e != home_endpoint)
    for _ in range(3):
        answer, _ = pick_buffered(epp, "/v1/chat/completions", chat("Tide?"), subset=[other])
        header, meta = destination(answer)
        assert header == meta == other  # only the hinted endpoint, no fallbacks outside it
    outside, _ = pick_buffered(epp, "/v1/chat/completions", chat("Tide?"),
                               subset=["10.255.0.1:8000"])
    assert outside.immediate_response.status.code == 503


def test_full_duplex_defers_the_headers_and_streams_the_body_back(epp, engines):
    body = json.dumps(chat("Where do the ferries dock?")).encode()
    stream = EnvoyStream(epp)
    stream.send(headers_message("/v1/chat/completions", end_of_stream=False,
                                mode=Mode.FULL_DUPLEX_STREAMED))
    stream.send(body_message(body[:40], end_of_stream=False))
    stream.send(body_message(body[40:], end_of_stream=True))
    headers = stream.recv()  # nothing was answered before the body ended
    assert headers.HasField("request_headers")
    header, meta = destination(headers)
    assert header == meta and header.split(",")[0] in endpoints(engines)
    echoed, end = b"", False
    while not end:
        chunk = stream.recv().request_body.response.body_mutation.streamed_response
        echoed += chunk.body
        end = chunk.end_of_stream
    assert echoed == body
    # the response passes through, echoed in full duplex, the served endpoint reported
    stream.send(response_headers_message(served=header.split(",")[0]))
    assert stream.recv().HasField("response_headers")
    stream.close()


def test_bodyless_request_is_picked_on_its_headers(epp, engines):
    stream = EnvoyStream(epp)
    stream.send(headers_message("/v1/models", end_of_stream=True))
    header, meta = destination(stream.recv())
    stream.close()
    assert header == meta and header.split(",")[0] in endpoints(engines)
    # body mode NONE: a POST whose body the gateway will not send is picked on its headers
    stream = EnvoyStream(epp)
    stream.send(headers_message("/v1/completions", end_of_stream=False, mode=Mode.NONE))
    header, meta = destination(stream.recv())
    stream.close()
    assert header == meta and header.split(",")[0] in endpoints(engines)


def test_shedding_answers_429_once_every_endpoint_is_full(engines, spawn, free_port):
    channel = start_epp(spawn, free_port, engines, "--epp-shed-limit", "2")
    open_streams = []
    for i in range(4):  # picks held open, new prefixes go to the least loaded: 2 each
        answer, stream = pick_buffered(channel, "/v1/completions",
                                       {"prompt": f"prefix {i} " * 20, "max_tokens": 1},
                                       keep_open=True)
        assert answer.HasField("request_body"), (i, answer)
        open_streams.append(stream)
    shed, _ = pick_buffered(channel, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert shed.immediate_response.status.code == 429
    retry = {h.header.key: h.header.raw_value for h in
             shed.immediate_response.headers.set_headers}["retry-after"]
    assert int(retry) >= 1
    assert json.loads(shed.immediate_response.body)["error"]["code"] == 429
    open_streams.pop().close()  # a request ends: its endpoint takes the next one
    wait_until(lambda: pick_buffered(channel, "/v1/completions",
                                     {"prompt": "y", "max_tokens": 1})[0].HasField(
                                         "request_body"), timeout=10, what="capacity back")
    for stream in open_streams:
        stream.close()


def test_no_ready_endpoint_is_a_503_immediate_response(spawn, free_port):
    dead = f"http://127.0.0.9:{free_port('127.0.0.9')}"  # nobody listens there
    channel = start_epp(spawn, free_port, [dead])
    answer, _ = pick_buffered(channel, "/v1/completions", {"prompt": "hello", "max_tokens": 1})
    assert answer.immediate_response.status.code == 503
    error = json.loads(answer.immediate_response.body)["error"]
    assert "no ready endpoint" in error["message"]
    stream = EnvoyStream(channel)
    stream.send(headers_message("/v1/models", end_of_stream=True))
    assert stream.recv().immediate_response.status.code == 503
    stream.close()


def test_the_picker_runs_with_the_flags_the_operator_renders(engines, spawn, free_port):
    """Precise mode as deployed: KV-event subscriptions and the engine's own tokenizer."""
    channel = start_epp(spawn, free_port, engines, "--kv-events", "--kv-events-port",
                        str(free_port("127.0.0.2")), "--tokenizer-from-engine")
    answer, _ = pick_buffered(channel, "/v1/chat/completions", chat("Any cargo today?"))
    header, meta = destination(answer)
    assert header == meta and header.split(",")[0] in endpoints(engines)
