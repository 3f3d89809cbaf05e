"""End to end through `shoal fleet` machinery with real `shoal serve` engines (tiny qwen3)
and a router started with exactly the flags the operator renders (precise mode: KV events,
the tokenizer fetched from an engine): streaming pass-through, disconnect freeing engine
blocks, the router's view equal to the engines' caches, template errors answered as the
engine answers them, a killed replica."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from shoal.runtime.kv.block_hash import ExtraKeys, hash_prefix_blocks

from shoal.contract.metrics import parse_engine_metrics, parse_samples

pytestmark = pytest.mark.slow
BLOCK = 16


def normalized(sse: bytes) -> bytes:
    """The per-request id and creation second differ between any two requests."""
    sse = re.sub(rb'"id": ?"[^"]+"', b'"id":"-"', sse)
    return re.sub(rb'"created": ?\d+', b'"created":0', sse)


def engine_metrics(url: str):
    return parse_engine_metrics(httpx.get(f"{url}/metrics", timeout=5).text)


def operator_router_flags() -> tuple[list[str], bool]:
    """Exactly the routing flags the operator deploys, over this loopback fleet."""
    from shoal.operator.names import Owner
    from shoal.operator.render.router import router_args
    from shoal.operator.spec.service import parse_spec
    from shoal.runtime.router.local.fleet import loopback_router_args

    spec = parse_spec({"model": {"uri": "/opt/model"}, "runtime": {"blockSize": BLOCK}})
    return loopback_router_args(router_args(Owner("demo", "ml", "uid-1"), spec))


@pytest.fixture(scope="module")
def fleet(engine_fleet_factory, alternating_qwen3):
    flags, kv_events = operator_router_flags()
    assert kv_events and "--tokenizer-from-engine" in flags  # precise mode, deployed as is
    # + --enable-debug: the tests compare the router's /debug/blocks view with the engines'
    return engine_fleet_factory(2, ["--num-kv-blocks", "40", "--max-model-len", "512"],
                                kv_events=kv_events, router_flags=[*flags, "--enable-debug"],
                                model=alternating_qwen3)


def test_streaming_through_the_router_is_byte_identical(fleet):
    router = fleet.config.router_url
    body = {"messages": [{"role": "system", "content": "You are a harbor pilot. " * 6},
                         {"role": "user", "content": "When does the tide turn?"}],
            "max_tokens": 12, "stream": True, "temperature": 0, "seed": 3, "ignore_eos": True}
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        routed = b"".join(r.iter_raw())
    # the same request straight to each engine: one of them served it, both are deterministic
    direct = [httpx.post(f"{e}/v1/chat/completions", json=body, timeout=60).content
              for e in fleet.config.engine_urls()]
    # (no usage chunk: its cached_tokens would differ between a cold and a warm engine)
    assert routed.count(b"data: ") > 12 and routed.endswith(b"data: [DONE]\n\n")
    assert normalized(routed) == normalized(direct[0]) == normalized(direct[1])


def test_disconnect_at_the_router_frees_the_engines_blocks(fleet, wait_for):
    """The client hangs up after two chunks: the engine aborts the request (it generates far
    fewer than max_tokens) and frees its blocks. The tiny model makes 400 tokens in well
    under a second, so the check is on what was generated, not on catching it running."""
    router, engines = fleet.config.router_url, fleet.config.engine_urls()
    before = generated_tokens(engines)
    body = {"prompt": "The longest voyage began " * 4, "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
        chunks = r.iter_raw()
        next(chunks)
        next(chunks)
    wait_for(lambda: all(engine_metrics(e).running == 0 and engine_metrics(e).kv_cache_usage == 0
                         for e in engines), timeout=15, what="blocks freed after the disconnect")
    wait_for(lambda: generated_tokens(engines) > before, timeout=5, what="token counters")
    assert generated_tokens(engines) - before < 390  # aborted, not run to max_tokens


def generated_tokens(engines: list[str]) -> float:
    return sum(metric_value(e, "shoal:generation_tokens_total") for e in engines)


def metric_value(url: str, name: str) -> float:
    return parse_samples(httpx.get(f"{url}/metrics", timeout=5).text).get(name, 0.0)


def test_disconnect_before_the_first_byte_aborts_in_the_engine(fleet, wait_for):
    """Non-streaming: nothing reaches the client until the engine is done, so only the
    router's disconnect watcher can cancel it; the engine stops generating and frees."""
    router, engines = fleet.config.router_url, fleet.config.engine_urls()
    before = generated_tokens(engines)
    disconnects = metric_value(router, "shoal:router_client_disconnects_total")
    body = {"prompt": "A non-streaming voyage", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True}
    try:
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        raise AssertionError(f"answered before the timeout: {r.status_code} {r.text[:300]}")
    except httpx.ReadTimeout:
        pass
    wait_for(lambda: all(engine_metrics(e).running == 0 and engine_metrics(e).kv_cache_usage == 0
                         for e in engines), timeout=15, what="blocks freed after the disconnect")
    assert generated_tokens(engines) - before < 470  # aborted, not run to max_tokens
    assert metric_value(router, "shoal:router_client_disconnects_total") == disconnects + 1


def router_view(router: str) -> dict[str, set[int]]:
    view = httpx.get(f"{router}/debug/blocks", timeout=5).json()
    assert view["precise"]
    return {url: set(blocks) for url, blocks in view["replicas"].items()}


def cached_tokens(engine: str, prompt: list[int]) -> int:
    r = httpx.post(f"{engine}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_precise_view_matches_the_engines_caches_through_eviction(fleet, wait_for):
    """Each probe: predict from the router's view how many leading blocks an engine holds,
    then ask the engine (its cached_tokens). 40-block caches and 6-block prompts force
    evictions, which the view must follow too."""
    router = fleet.config.router_url
    engines = fleet.config.engine_urls()
    extra = ExtraKeys().digest()
    prompts = [[(7 * p + t) % 900 + 50 for t in range(6 * BLOCK + 5)] for p in range(10)]
    for p in prompts[:8]:  # through the router: the view fills from both engines' events
        httpx.post(f"{router}/v1/completions", timeout=60,
                   json={"prompt": p, "max_tokens": 1}).raise_for_status()
    time.sleep(0.5)
    removed_seen = False
    checked = 0
    previous: dict[str, set[int]] = {}
    for round_ in range(3):
        for engine in engines:
            for p in prompts:
                view = router_view(router)[engine]
                if previous.get(engine, set()) - view:
                    removed_seen = True
                previous[engine] = view
                keys = hash_prefix_blocks(p, BLOCK, extra)
                predicted = 0
                for key in keys:
                    if key not in view:
                        break
                    predicted += 1
                actual = cached_tokens(engine, p) // BLOCK
                assert actual == predicted, (round_, engine, prompts.index(p))
                checked += 1
                # the probe itself stored and evicted blocks: wait until the view shows it
                wait_for(lambda e=engine, k=keys: set(k[:6]) <= router_view(router)[e],
                         timeout=5, what="probe's blocks in the view")
    assert removed_seen, "no eviction happened: the cache is too large for this test"
    assert checked == 3 * len(engines) * len(prompts)
    for engine in engines:
        assert len(router_view(router)[engine]) <= 40
    metrics = httpx.get(f"{router}/metrics").text
    for engine in engines:
        assert f'shoal:router_kv_event_gaps_total{{replica="{engine}"}} 0.0' in metrics
        assert not re.search(rf'kv_event_batches_total\{{replica="{re.escape(engine)}"\}} 0\.0',
                             metrics)


def affinity_hits(router: str, engine: str) -> float:
    text = httpx.get(f"{router}/metrics", timeout=5).text
    found = re.search(rf'^shoal:router_affinity_hits_total\{{replica="{re.escape(engine)}"\}} '
                      r'(\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_router_key_hashes_match_engine_events_for_chat(fleet, wait_for):
    """Token-precise affinity with the tokenizer the router fetched from an engine: a chat
    sent straight to engine 1 (the router never saw it) is found there by the router's own
    hashes of the same chat (template + tokenizer), matched against engine 1's KV events."""
    router, engine = fleet.config.router_url, fleet.config.engine_urls()[1]
    body = {"messages": [{"role": "system", "content": "Unique crew manifest check. " * 8},
                         {"role": "user", "content": "List the crew."}], "max_tokens": 1}
    before = router_view(router)[engine]
    httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    wait_for(lambda: len(router_view(router)[engine] - before) >= 4, timeout=5,
             what="engine 1's new blocks in the router's view")
    hits = affinity_hits(router, engine)
    r1 = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60).json()
    assert affinity_hits(router, engine) == hits + 1  # routed to engine 1 on a prefix match
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK


def test_killed_replica_is_ejected_and_later_requests_succeed(engine_fleet_factory, wait_for):
    fleet = engine_fleet_factory(2, ["--max-model-len", "512"])
    router = fleet.config.router_url
    victim_url = fleet.config.engine_urls()[0]
    victim = fleet.engines[0]
    os.killpg(victim.pid, signal.SIGKILL)  # the engine and its engine-core process
    victim.wait(timeout=10)
    ok = 0
    for k in range(6):
        r = httpx.post(f"{router}/v1/completions", timeout=60,
                       json={"prompt": f"request {k} after the crash " * 3, "max_tokens": 2})
        assert r.status_code == 200
        ok += 1
    assert ok == 6
    wait_for(lambda: f'shoal:router_replica_ready{{replica="{victim_url}"}} 0.0'
             in httpx.get(f"{router}/metrics").text, timeout=10, what="ejection")


def test_a_chat_template_error_through_the_router_is_the_engines_4xx(fleet):
    """The router renders the template to key the request; when the template raises
    (roles must alternate) the client gets the engine's own 400 and body, never a 5xx."""
    body = {"messages": [{"role": "user", "content": "first"},
                         {"role": "user", "content": "second, out of turn"}], "max_tokens": 1}
    routed = httpx.post(f"{fleet.config.router_url}/v1/chat/completions", json=body, timeout=60)
    direct = httpx.post(f"{fleet.config.engine_urls()[0]}/v1/chat/completions", json=body,
                        timeout=60)
    assert direct.status_code == 400
    assert (routed.status_code, routed.json()) == (400, direct.json())
    assert "alternate" in routed.json()["error"]["message"]
    fine = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(f"{fleet.config.router_url}/v1/chat/completions", json=fine,
                      timeout=60).status_code == 200


def test_responses_messages_and_tokenize_pass_through_the_router(fleet):
    router, engine = fleet.config.router_url, fleet.config.engine_urls()[0]
    response = httpx.post(f"{router}/v1/responses", timeout=60,
                          json={"input": "hello there", "max_output_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "response"
    message = {"messages": [{"role": "user", "content": "hello"}]}
    counted = httpx.post(f"{router}/v1/messages/count_tokens", json=message, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    response = httpx.post(f"{router}/v1/messages", json={**message, "max_tokens": 3},
                          timeout=60)
    assert response.status_code == 200 and response.json()["type"] == "message"
    body = {"prompt": "the same text either way"}
    routed = httpx.post(f"{router}/tokenize", json=body, timeout=60)
    assert routed.status_code == 200
    assert routed.json() == httpx.post(f"{engine}/tokenize", json=body, timeout=60).json()
    ids = routed.json()["tokens"]
    detok = httpx.post(f"{router}/detokenize", json={"tokens": ids}, timeout=60)
    assert detok.status_code == 200 and "same text" in detok.json()["prompt"]
