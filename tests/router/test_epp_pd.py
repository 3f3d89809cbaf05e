"""P/D through the Endpoint Picker, as llm-d does it, with real processes on loopback: a
prefill engine (``kv_producer``), a decode engine (``kv_consumer``) behind its sidecar
(``shoal route --pd-sidecar``), and ``shoal route --epp --prefill-backend`` over the sidecar.

This test plays Envoy: it asks the picker over ext_proc, then sends the request to the
endpoint the picker named, with the headers it set. A long uncached prompt gets the sidecar
as its destination and the prefill engine in ``x-prefiller-host-port``; the sidecar runs the
prefill leg there and the decode engine pulls the prompt's KV: the greedy tokens equal one
engine's and the decode engine computed none of the transferred prompt tokens. A short prompt
gets no prefill header (a client's own is removed); a header naming an address that is not a
prefill backend is refused by the sidecar, and the decode engine computes the prompt; so does
a prefill engine the sidecar cannot reach.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import httpx
import pytest

from tests.processes import free_port
from tests.router.conftest import http_ok, wait_until
from tests.router.epp_client import (
    EnvoyStream,
    Mode,
    body_message,
    headers_message,
    pick_buffered,
    start_epp,
)

pytestmark = pytest.mark.slow
PREFILLER = "x-prefiller-host-port"


def transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_ip": "127.0.0.1",
                       "kv_port": 0, "kv_connector_extra_config": {"transfer_timeout": 5}})


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*{re.escape(labels)}[^}}]*}})? "
                      r"([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def header_mutation(answer) -> tuple[dict[str, str], list[str]]:
    common = (answer.request_headers.response if answer.HasField("request_headers")
              else answer.request_body.response)
    mutation = common.header_mutation
    return ({h.header.key: h.header.raw_value.decode() for h in mutation.set_headers},
            list(mutation.remove_headers))


@dataclass
class PdFleet:
    prefill: str
    decode: str
    sidecar: str
    channel: grpc.Channel
    spawn: Callable[..., subprocess.Popen]  # stopped with the fixture's other processes
    epp_metrics: str  # the picker's /metrics (--epp-metrics-port)


@pytest.fixture(scope="module")
def pd_fleet(tiny_qwen3, tmp_path_factory):
    logs = tmp_path_factory.mktemp("epp-pd")
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str], name: str = "epp") -> subprocess.Popen:
        procs.append(subprocess.Popen(
            argv, stdout=open(logs / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        return procs[-1]

    def engine(role: str) -> str:
        port = free_port("127.0.0.1")
        spawn([sys.executable, "-m", "shoal.cli", "serve", "--host", "127.0.0.1", "--port",
               str(port), "--model", str(tiny_qwen3), "--served-model-name", "shoal-test",
               "--num-kv-blocks", "64", "--max-model-len", "512",
               "--kv-transfer-config", transfer_config(role)], role)
        return f"http://127.0.0.1:{port}"

    try:
        prefill, decode = engine("kv_producer"), engine("kv_consumer")
        for url in (prefill, decode):
            wait_until(lambda u=url: http_ok(f"{u}/ready"), timeout=180, what=f"{url} ready")
        port = free_port("127.0.0.1")
        spawn([sys.executable, "-m", "shoal.runtime.router.cli", "--pd-sidecar", "--host",
               "127.0.0.1", "--port", str(port), "--backend", decode, "--prefill-backend",
               prefill, "--health-interval", "0.2", "--scrape-interval", "0.2"], "sidecar")
        sidecar = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{sidecar}/ready"), timeout=60, what="sidecar ready")
        # the picker scores the sidecar's address (its /ready follows the decode engine's)
        # and picks prefill engines from --prefill-backend; precise keys from the tokenizer
        metrics_port = free_port("127.0.0.1")
        channel = start_epp(lambda argv: spawn(argv), free_port, [sidecar],
                            "--prefill-backend", prefill, "--pd-threshold", "40",
                            "--tokenizer", str(tiny_qwen3),
                            "--epp-metrics-port", str(metrics_port))
        yield PdFleet(prefill, decode, sidecar, channel, spawn,
                      f"http://127.0.0.1:{metrics_port}")
        channel.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def endpoint(url: str) -> str:
    return url.removeprefix("http://")


def test_the_picker_names_a_prefill_engine_and_the_sidecar_runs_it(pd_fleet):
    prefill, decode, sidecar, channel = (pd_fleet.prefill, pd_fleet.decode, pd_fleet.sidecar,
                                         pd_fleet.channel)
    body = {"model": "shoal-test", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    long_prompt = {**body, "prompt": list(range(500, 590))}  # 90 uncached tokens > 40
    answer, _ = pick_buffered(channel, "/v1/completions", long_prompt)
    assert answer.request_body.response.clear_route_cache
    set_headers, removed = header_mutation(answer)
    assert set_headers["x-gateway-destination-endpoint"].split(",")[0] == endpoint(sidecar)
    assert set_headers[PREFILLER] == endpoint(prefill)
    assert removed == []
    # the picker's /metrics: the decision and why, and both pools' queue and KV by role
    picked = metrics(pd_fleet.epp_metrics)
    assert sample(picked, "shoal:router_pd_decisions_total",
                  'decision="remote",reason="uncached_prompt"') >= 1
    for url, role in ((sidecar, "decode"), (prefill, "prefill")):
        assert f'shoal:router_replica_kv_cache_usage_perc{{replica="{url}",role="{role}"}}' \
            in picked
        assert f'shoal:router_replica_num_requests_waiting{{replica="{url}",role="{role}"}}' \
            in picked

    # Envoy's part: the request goes to the destination with the picker's headers
    d_before, s_before = metrics(decode), metrics(sidecar)
    response = httpx.post(sidecar + "/v1/completions", json=long_prompt, timeout=120,
                          headers={PREFILLER: set_headers[PREFILLER]})
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["token_ids"]
    d_after = metrics(decode)

    def delta(labels: str, name: str = "shoal:prompt_tokens_by_source_total") -> float:
        return sample(d_after, name, labels) - sample(d_before, name, labels)

    assert delta('source="external_kv_transfer"') == 5 * 16  # 5 full blocks before the last
    assert delta('source="local_compute"') == 90 - 5 * 16  # none of the transferred tokens
    remote = 'decision="remote",reason="picker_named"'
    assert sample(metrics(sidecar), "shoal:router_pd_decisions_total", remote) \
        == sample(s_before, "shoal:router_pd_decisions_total", remote) + 1
    # one engine computing the whole request (another salt: nothing reused from the above)
    want = httpx.post(prefill + "/v1/completions", timeout=120, json={
        **long_prompt, "cache_salt": "reference"}).json()["choices"][0]["token_ids"]
    assert got == want

    # streamed through the sidecar: the prefill leg is not, the decode leg streams back
    streamed = {**body, "prompt": list(range(700, 790)), "stream": True}
    answer, _ = pick_buffered(channel, "/v1/completions", streamed)
    named = header_mutation(answer)[0][PREFILLER]
    with httpx.stream("POST", sidecar + "/v1/completions", json=streamed, timeout=120,
                      headers={PREFILLER: named}) as events:
        assert events.status_code == 200
        text = "".join(events.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    assert sample(metrics(sidecar), "shoal:router_pd_decisions_total", 'decision="remote"') \
        == sample(s_before, "shoal:router_pd_decisions_total", 'decision="remote"') + 2
    # the sidecar stands where a picker expects the engine: its tokenizer is the engine's
    tokenizer = httpx.get(sidecar + "/tokenizer", timeout=10)
    assert tokenizer.status_code == 200
    assert tokenizer.content == httpx.get(decode + "/tokenizer", timeout=10).content


def test_short_prompts_get_no_prefill_header_and_a_clients_own_is_not_followed(pd_fleet):
    prefill, decode, sidecar, channel = (pd_fleet.prefill, pd_fleet.decode, pd_fleet.sidecar,
                                         pd_fleet.channel)
    short = {"model": "shoal-test", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
             "prompt": list(range(600, 620)), "return_token_ids": True}  # 20 tokens < 40
    answer, _ = pick_buffered(channel, "/v1/completions", short)
    set_headers, removed = header_mutation(answer)
    assert PREFILLER not in set_headers and removed == [PREFILLER]
    assert sample(metrics(pd_fleet.epp_metrics), "shoal:router_pd_decisions_total",
                  'decision="local",reason="short_prompt"') >= 1

    # full duplex too: the answer to the headers carries the same mutation
    stream = EnvoyStream(channel)
    stream.send(headers_message("/v1/completions", end_of_stream=False,
                                mode=Mode.FULL_DUPLEX_STREAMED))
    stream.send(body_message(json.dumps({**short, "prompt": list(range(100, 190))}).encode(),
                             end_of_stream=True))
    first = stream.recv()
    stream.close()
    assert header_mutation(first)[0][PREFILLER] == endpoint(prefill)

    # a header naming what is not a --prefill-backend (a client's, past no picker): the
    # sidecar does not post the prompt there; the decode engine computes it
    before = metrics(decode)
    prompt = {**short, "prompt": list(range(300, 360))}
    response = httpx.post(sidecar + "/v1/completions", json=prompt, timeout=120,
                          headers={PREFILLER: "169.254.169.254:80"})
    assert response.status_code == 200, response.text
    after = metrics(decode)
    computed = sample(after, "shoal:prompt_tokens_by_source_total", 'source="local_compute"') \
        - sample(before, "shoal:prompt_tokens_by_source_total", 'source="local_compute"')
    assert computed == 60
    assert sample(metrics(sidecar), "shoal:router_pd_decisions_total",
                  'decision="refused",reason="not_allowed"') == 1
    assert http_ok(f"{prefill}/ready")


def test_a_prefill_engine_the_sidecar_cannot_reach_leaves_the_prompt_to_the_decode_engine(
        pd_fleet):
    """The picker named a prefill engine that is gone by the time the sidecar posts to it:
    the request still completes, the decode engine computing the whole prompt, counted as a
    failed prefill leg, and no KV block stays held."""
    decode = pd_fleet.decode
    gone = f"127.0.0.1:{free_port('127.0.0.1')}"  # nobody listens there
    port = free_port("127.0.0.1")
    pd_fleet.spawn([sys.executable, "-m", "shoal.runtime.router.cli", "--pd-sidecar", "--host",
                    "127.0.0.1", "--port", str(port), "--backend", decode,
                    "--prefill-backend", f"http://{gone}", "--health-interval", "0.2"],
                   "sidecar-gone")
    sidecar = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{sidecar}/ready"), timeout=60, what="second sidecar ready")
    body = {"model": "shoal-test", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "prompt": list(range(900, 970)), "return_token_ids": True}
    before = metrics(decode)
    response = httpx.post(sidecar + "/v1/completions", json=body, timeout=120,
                          headers={PREFILLER: gone})
    assert response.status_code == 200, response.text
    after = metrics(decode)
    computed = sample(after, "shoal:prompt_tokens_by_source_total", 'source="local_compute"') \
        - sample(before, "shoal:prompt_tokens_by_source_total", 'source="local_compute"')
    assert computed == 70
    assert sample(metrics(sidecar), "shoal:router_pd_decisions_total",
                  'decision="failed",reason="prefill_error"') == 1
    want = httpx.post(decode + "/v1/completions", timeout=120, json={
        **body, "cache_salt": "reference"}).json()["choices"][0]["token_ids"]
    assert response.json()["choices"][0]["token_ids"] == want
    wait_until(lambda: sample(metrics(decode), "shoal:kv_cache_usage_perc") == 0.0, 20,
               0.2, "the decode KV cache idle")
