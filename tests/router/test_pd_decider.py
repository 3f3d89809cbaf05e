"""P/D's decisions, the same for the router and the Endpoint Picker
(runtime/router/policies/pd_decider.py): which prompts a prefill replica computes, which one;
the prefill leg's body (vLLM's proxy flow); the sidecar's reading of the picker's header."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict
from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.policies.base import Decision, ReplicaSnapshot
from shoal.runtime.router.policies.pd_decider import (
    least_loaded,
    pd_choice,
    uncached_tokens,
)
from shoal.runtime.router.policies.request_keys import KeyConfig, RequestKeys
from shoal.runtime.router.proxy.pd import (
    HeaderPrefill,
    PrefillOutcome,
    PrefillStage,
    prefill_request,
)
from shoal.runtime.router.replicas.capacity_request import CapacityAsker
from shoal.runtime.router.replicas.pool import ReplicaPool

CONFIG = KeyConfig(block_size=16, chars_per_block=64)


def keys(units: int, precise: bool = True) -> RequestKeys:
    per_block = 16 if precise else 64
    return RequestKeys(list(range(units // per_block)), precise, units, 0)


def test_uncached_tokens_are_the_prompt_less_the_blocks_the_decode_replica_holds():
    assert uncached_tokens(keys(100), 0, CONFIG) == 100
    assert uncached_tokens(keys(100), 4, CONFIG) == 36
    assert uncached_tokens(keys(640, precise=False), 2, CONFIG) == (640 - 128) // 4


@pytest.mark.parametrize("units, matched, threshold, remote, reason", [
    (300, 0, 256, True, "uncached_prompt"),  # long and uncached: a prefill replica computes it
    (300, 16, 256, False, "cached_prefix"),  # mostly cached on the decode replica
    (200, 0, 256, False, "short_prompt"),  # short: straight to decode
    (257, 0, 256, True, "uncached_prompt"),
    (256, 0, 256, False, "short_prompt"),
])
def test_a_prefill_replica_computes_only_long_uncached_prompts(units, matched, threshold,
                                                              remote, reason):
    choice = pd_choice(keys(units), Decision("http://d", matched_blocks=matched), CONFIG,
                       threshold)
    assert (choice.remote, choice.reason) == (remote, reason)


def test_a_body_the_router_cannot_key_goes_straight_to_decode():
    choice = pd_choice(None, Decision("http://d"), CONFIG, 0)
    assert (choice.remote, choice.reason) == (False, "unkeyed_body")


def test_the_prefill_leg_is_the_request_with_one_token_not_streamed():
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": 1},
            "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 5, "temperature": 0}
    leg = prefill_request(body)
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False
    assert (leg["max_tokens"], leg["max_completion_tokens"], leg["stream"]) == (1, 1, False)
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["temperature"] == 0 and body["max_tokens"] == 50  # the original is untouched


def test_prefill_backends_need_the_cache_affinity_policy_and_a_sane_threshold():
    with pytest.raises(ValueError, match="--prefill-backend/--prefill-service needs --policy"):
        RouterConfig(policy="round-robin", backends=["http://d"],
                     prefill_backends=["http://p"]).validate()
    with pytest.raises(ValueError, match="--pd-threshold"):
        RouterConfig(backends=["http://d"], prefill_backends=["http://p"],
                     pd_threshold=-1).validate()


def test_the_least_loaded_prefill_replica_takes_the_prompt():
    replicas = [ReplicaSnapshot("http://b", in_flight=1), ReplicaSnapshot("http://a", 1),
                ReplicaSnapshot("http://c", num_waiting=0)]
    assert least_loaded(replicas).url == "http://c"
    assert least_loaded(replicas[:2]).url == "http://a"  # a tie: the url decides


def test_the_sidecar_follows_only_an_allowed_prefill_address():
    sidecar = HeaderPrefill(["http://10.0.0.7:8000", "prefill.ns.svc:8000"])
    assert sidecar.target([]) is None  # no header: the decode engine computes the prompt
    assert sidecar.target(["10.0.0.7:8000"]) == "http://10.0.0.7:8000"
    assert sidecar.target([" prefill.ns.svc:8000 , 10.0.0.7:8000"]) == \
        "http://prefill.ns.svc:8000"  # comma-joined: the first, as llm-d's sidecar
    refused = sidecar.target(["169.254.169.254:80"])
    assert isinstance(refused, PrefillOutcome) and refused.decision == "refused"
    # --prefill-service: its ready pods by IP, any port (llm-d's sidecar allowlist)
    assert isinstance(sidecar.target(["10.1.2.3:8000"]), PrefillOutcome)
    sidecar.allow_peers({"http://10.1.2.3:8000"})
    assert sidecar.target(["10.1.2.3:8200"]) == "http://10.1.2.3:8200"
    sidecar.allow_peers(set())  # the pod went away
    assert isinstance(sidecar.target(["10.1.2.3:8000"]), PrefillOutcome)


def test_a_sidecar_needs_one_decode_engine_and_the_prefill_addresses():
    RouterConfig(backends=["http://d"], prefill_backends=["http://p"], pd_sidecar=True).validate()
    for bad in (RouterConfig(backends=["http://d"], pd_sidecar=True),
                RouterConfig(backends=["http://d", "http://e"], prefill_backends=["http://p"],
                             pd_sidecar=True)):
        with pytest.raises(ValueError, match="--pd-sidecar"):
            bad.validate()


async def test_a_prefill_pool_at_zero_sends_the_prompt_to_decode_and_asks_for_a_replica():
    """spec.prefill.autoscaling.minReplicas 0: no prefill replica is ready, so the decode
    replica gets the request as it came, and the operator is asked (once per interval)."""
    sent: list[str] = []

    async def send() -> None:
        sent.append("asked")

    stage = PrefillStage(ReplicaPool(), threshold=0, asker=CapacityAsker(send, interval_s=60))
    body = b'{"model": "m", "prompt": "a long prompt"}'
    for _ in range(3):
        outcome = await stage.run(None, "/v1/completions", body,  # type: ignore[arg-type]
                                  CIMultiDict(), 1.0, "uncached_prompt")
        assert (outcome.body, outcome.decision, outcome.reason) == \
            (body, "failed", "no_prefill_replica")
    await asyncio.sleep(0)  # the ask runs in the background
    assert sent == ["asked"]  # three prompts, one request within the interval


async def test_the_picker_over_a_prefill_pool_at_zero_names_none_and_asks_for_a_replica():
    """Through a gateway: no prefill replica ready, so no x-prefiller-host-port (the decode
    endpoint computes the prompt) and one prefill capacity request per interval."""
    import json

    from shoal.runtime.router.epp.picker import EndpointPicker
    from shoal.runtime.router.policies.base import make_policy

    sent: list[str] = []

    async def send() -> None:
        sent.append("asked")

    decode = ReplicaPool()
    decode.sync(["http://127.0.0.1:1"])
    decode.replicas["http://127.0.0.1:1"].ready = True
    picker = EndpointPicker(decode, make_policy("cache-affinity"), CONFIG,
                            prefill_pool=ReplicaPool(), pd_threshold=4)
    picker.prefill_asker = CapacityAsker(send, interval_s=60)
    body = json.dumps({"model": "m", "prompt": list(range(100, 400))}).encode()
    for _ in range(2):
        pick = await picker.pick("/v1/completions", body, None)
        assert pick.prefill is None and pick.url == "http://127.0.0.1:1"
        picker.release(pick.url)
    await asyncio.sleep(0)
    assert sent == ["asked"]
