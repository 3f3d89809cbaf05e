"""P/D disaggregation over HTTP: two real ``shoal serve`` processes on loopback, a prefill
engine (``kv_producer``) and a decode engine (``kv_consumer``), and a request taken through
both as vLLM's P/D proxies do: the prefill leg with ``kv_transfer_params.do_remote_decode``
and ``max_tokens`` 1, the decode leg with the ``kv_transfer_params`` the prefill answered.

The decode engine's greedy tokens equal one engine's computing the whole request; its
metrics say it computed none of the transferred prompt tokens; every KV block is back in both
pools afterwards. A decode engine killed mid-stream behind the router ends its stream and
leaves no block held on the prefill engine. Then the prefill engine is killed: the decode
engine computes the prompt itself (a failed pull, counted) and the request still completes
with the same tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import Server, free_port, wait_until

pytestmark = pytest.mark.slow
NEAR_TIE = 1e-3
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role,
                       "kv_ip": "127.0.0.1", "kv_port": 0,
                       "kv_connector_extra_config": {"transfer_timeout": 5}})


@pytest.fixture(scope="module")
def pd(start_server) -> tuple[Server, Server]:
    prefill = start_server("--kv-transfer-config", transfer_config("kv_producer"), wait=False)
    decode = start_server("--kv-transfer-config", transfer_config("kv_consumer"))
    prefill.wait_ready()
    return prefill, decode


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} ([0-9.e+-]+)$",
                      text, re.M)
    assert match, f"{name} {labels} not exported"
    return float(match.group(1))


def metrics(server: Server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def prefill_leg(prefill: Server, path: str, body: dict) -> dict:
    leg = {**body, "kv_transfer_params": PREFILL_PARAMS, "max_tokens": 1, "stream": False}
    response = httpx.post(prefill.v1 + path, json=leg, timeout=120)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


def idle(server: Server) -> bool:
    return sample(metrics(server), "shoal:kv_cache_usage_perc") == 0.0


def test_a_request_through_prefill_then_decode_equals_one_engine(pd):
    prefill, decode = pd
    prompt = list(range(100, 190))  # 90 tokens: 5 full blocks of 16 before the last token's
    body = {"model": "shoal-test", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reference = httpx.post(prefill.v1 + "/completions", timeout=120, json={
        **body, "logprobs": 2, "cache_salt": "reference"}).json()["choices"][0]

    params = prefill_leg(prefill, "/completions", body)
    assert len(params["remote_block_ids"]) == 5
    before = metrics(decode)
    response = httpx.post(decode.v1 + "/completions", json={**body, "kv_transfer_params": params},
                          timeout=120)
    assert response.status_code == 200, response.text
    after = metrics(decode)
    got = response.json()["choices"][0]["token_ids"]

    want = reference["token_ids"]
    tops = reference["logprobs"]["top_logprobs"]
    for pos, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        if ours != theirs:  # only a near-tie in the reference may flip, and ends the comparison
            values = sorted(tops[pos].values(), reverse=True)
            assert values[0] - values[1] < NEAR_TIE, (pos, got, want)
            break

    def delta(labels: str, name: str = "shoal:prompt_tokens_by_source_total") -> float:
        return sample(after, name, labels) - sample(before, name, labels)

    assert delta('source="external_kv_transfer"') == 5 * 16
    assert delta('source="local_compute"') == 90 - 5 * 16  # none of the transferred tokens
    assert delta('direction="received"', "shoal:kv_transfer_bytes_total") > 0
    assert sample(after, "shoal:kv_transfer_failures_total") == 0
    # each engine's role, and the id the decode engine was told to pull from
    assert sample(after, "shoal:kv_transfer_config_info", 'kv_role="kv_consumer"') == 1
    assert sample(metrics(prefill), "shoal:kv_transfer_config_info",
                  f'engine_id="{params["remote_engine_id"]}",kv_connector="TcpConnector",'
                  'kv_role="kv_producer"') == 1
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * 16
    wait_until(lambda: idle(prefill) and idle(decode), 20, 0.2, "both KV caches idle")
    assert sample(metrics(prefill), "shoal:kv_transfer_bytes_total", 'direction="sent"') > 0


def test_chat_through_prefill_then_decode(pd):
    prefill, decode = pd
    body = {"model": "shoal-test", "temperature": 0, "max_tokens": 6, "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell me about the sea " * 8}]}
    params = prefill_leg(prefill, "/chat/completions", body)
    response = httpx.post(decode.v1 + "/chat/completions",
                          json={**body, "kv_transfer_params": params}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["kv_transfer_params"] is None  # the decode leg offers nothing
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 16 * len(params["remote_block_ids"])
    wait_until(lambda: idle(prefill) and idle(decode), 20, 0.2, "both KV caches idle")


def test_bad_kv_transfer_params_are_a_400_naming_them(pd):
    _, decode = pd
    for bad in ({"do_remote_prefill": True, "remote_port": "x"},
                {"do_remote_prefill": True, "do_remote_decode": True}):
        response = httpx.post(decode.v1 + "/completions", timeout=30, json={
            "model": "shoal-test", "prompt": "hi", "max_tokens": 1, "kv_transfer_params": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "kv_transfer_params"


@contextlib.contextmanager
def router_over(decode: Server, prefill: Server, log_path: Path) -> Iterator[str]:
    """``shoal route`` in P/D mode over two engines: decode first, prefill when more than 40
    of the prompt's tokens are not cached on the decode engine."""
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.runtime.router.cli", "--host", "127.0.0.1", "--port",
         str(port), "--backend", decode.base_url, "--prefill-backend", prefill.base_url,
         "--pd-threshold", "40", "--tokenizer", str(decode.model_dir),
         "--health-interval", "0.2", "--scrape-interval", "0.2"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ok(url + "/ready"), 60, 0.1, "router ready")
        yield url
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


@pytest.fixture
def router(pd, tmp_path):
    prefill, decode = pd
    with router_over(decode, prefill, tmp_path / "router.log") as url:
        yield url


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_router_sends_long_uncached_prompts_through_a_prefill_engine(pd, router):
    prefill, decode = pd
    body = {"model": "shoal-test", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    long_prompt = list(range(500, 580))  # 80 uncached tokens > 40: prefill, then decode
    short_prompt = list(range(600, 620))  # 20: straight to the decode engine
    p_before, d_before = metrics(prefill), metrics(decode)
    response = httpx.post(router + "/v1/completions", json={**body, "prompt": long_prompt},
                          timeout=120)
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["token_ids"]
    short = httpx.post(router + "/v1/completions", json={**body, "prompt": short_prompt},
                       timeout=120)
    assert short.status_code == 200, short.text
    p_after, d_after = metrics(prefill), metrics(decode)
    pulled = sample(d_after, "shoal:prompt_tokens_by_source_total",
                    'source="external_kv_transfer"') - sample(
        d_before, "shoal:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    assert pulled == 4 * 16  # the long prompt's full blocks before its last token's
    # the prefill engine saw the long prompt only
    assert sample(p_after, "shoal:prompt_tokens_total") - \
        sample(p_before, "shoal:prompt_tokens_total") == len(long_prompt)
    decisions = httpx.get(router + "/metrics", timeout=5).text
    assert sample(decisions, "shoal:router_pd_decisions_total",
                  'decision="remote",reason="uncached_prompt"') == 1
    assert sample(decisions, "shoal:router_pd_decisions_total",
                  'decision="local",reason="short_prompt"') == 1
    # both pools' queue and KV usage, by role, as the router's scrapes saw them
    for url, role in ((prefill.base_url, "prefill"), (decode.base_url, "decode")):
        assert f'shoal:router_replica_kv_cache_usage_perc{{replica="{url}",role="{role}"}}' \
            in decisions
    want = httpx.post(prefill.v1 + "/completions", timeout=120, json={
        **body, "prompt": long_prompt, "cache_salt": "reference"}).json()["choices"][0]
    assert got == want["token_ids"]

    # streamed: the prefill leg is not, the decode leg streams to the client through the router
    streamed = list(range(700, 790))
    with httpx.stream("POST", router + "/v1/completions", timeout=120, json={
            **body, "prompt": streamed, "stream": True}) as events:
        assert events.status_code == 200
        text = "".join(events.iter_text())
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert text.rstrip().endswith("data: [DONE]")
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks if c["choices"]) == 8
    decisions = httpx.get(router + "/metrics", timeout=5).text
    assert sample(decisions, "shoal:router_pd_decisions_total", 'decision="remote"') == 2
    wait_until(lambda: idle(prefill) and idle(decode), 20, 0.2, "both KV caches idle")


def test_a_decode_engine_killed_mid_stream_ends_the_stream_and_frees_the_prefill_side(
        pd, start_server, tmp_path):
    """The decode engine (a second one, this test's own) dies while it streams a request
    the prefill engine computed: the client's stream ends without [DONE], the router counts
    a broken upstream, and the prefill engine holds no block afterwards."""
    prefill, _ = pd
    victim = start_server("--kv-transfer-config", transfer_config("kv_consumer"))
    sent_before = sample(metrics(prefill), "shoal:kv_transfer_bytes_total", 'direction="sent"')
    with router_over(victim, prefill, tmp_path / "router.log") as url:
        body = {"model": "shoal-test", "prompt": list(range(800, 900)), "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as events:
            assert events.status_code == 200
            lines = events.iter_lines()
            # a token streamed: the prompt's blocks were pulled and the engine decodes
            next(line for line in lines if line.startswith("data: {"))
            victim.stop()  # kill -9, the engine core with it
            rest = list(lines)
        assert "data: [DONE]" not in rest
        assert sample(httpx.get(url + "/metrics", timeout=5).text,
                      "shoal:router_upstream_failures_total", 'reason="broken"') == 1
    assert sample(metrics(prefill), "shoal:kv_transfer_bytes_total",
                  'direction="sent"') > sent_before
    wait_until(lambda: idle(prefill), 20, 0.2, "the prefill KV cache idle")


def test_a_killed_prefill_engine_makes_the_decode_engine_compute_the_prompt(pd):
    prefill, decode = pd
    prompt = list(range(300, 360))
    body = {"model": "shoal-test", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    params = prefill_leg(prefill, "/completions", body)
    prefill.stop()  # gone before the decode engine pulls
    before = metrics(decode)
    response = httpx.post(decode.v1 + "/completions", json={**body, "kv_transfer_params": params},
                          timeout=120)
    assert response.status_code == 200, response.text
    after = metrics(decode)
    assert sample(after, "shoal:kv_transfer_failures_total") == \
        sample(before, "shoal:kv_transfer_failures_total") + 1
    computed = sample(after, "shoal:prompt_tokens_by_source_total", 'source="local_compute"') \
        - sample(before, "shoal:prompt_tokens_by_source_total", 'source="local_compute"')
    assert computed == len(prompt)
    want = httpx.post(decode.v1 + "/completions", json={**body, "cache_salt": "reference"},
                      timeout=120).json()["choices"][0]["token_ids"]
    assert response.json()["choices"][0]["token_ids"] == want  # one engine, both times
    wait_until(lambda: idle(decode), 20, 0.2, "the decode KV cache idle")
