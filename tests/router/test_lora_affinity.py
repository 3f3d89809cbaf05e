"""LoRA affinity before the routing policy: parsing an engine's ``lora_requests_info`` (as
the API exports it) and narrowing the candidates to replicas holding the adapter."""

from __future__ import annotations

import json

from shoal.runtime.api.metrics import ServerMetrics
from shoal.runtime.router.policies.base import ReplicaSnapshot
from shoal.runtime.router.policies.lora_affinity import model_of, prefer_adapter
from shoal.runtime.wire.messages import SchedulerStats

from shoal.contract.metrics import LoraInfo, parse_lora_info


def exported(running: list[str], waiting: list[str], compat: list[str] | None = None) -> str:
    metrics = ServerMetrics("base-model", compat)
    metrics.enable_lora(2)
    metrics.set_adapters(["a", "b", "c", "idle"])
    metrics.update_stats(SchedulerStats(running_lora_adapters=running,
                                        waiting_lora_adapters=waiting))
    return metrics.render().decode()


def test_the_info_gauge_round_trips_through_the_contract_parser():
    text = exported(["a", "b"], ["c"], ["vllm"])
    info = parse_lora_info(text)
    assert info == LoraInfo(2, frozenset({"a", "b"}), frozenset({"c"}), frozenset({"base-model"}),
                            frozenset({"a", "b", "c", "idle"}))
    assert parse_lora_info(text, prefix="vllm") == info
    assert not info.has_free_slot and info.active == {"a", "b", "c"}
    assert parse_lora_info(ServerMetrics("m").render().decode()) is None  # LoRA off
    empty = parse_lora_info(exported([], []))
    assert empty is not None and empty.running == frozenset() and empty.has_free_slot


def replica(url: str, running: set[str] = frozenset(), waiting: int = 0,
            max_lora: int = 1, loaded: set[str] = frozenset()) -> ReplicaSnapshot:
    return ReplicaSnapshot(url, num_waiting=waiting,
                           lora=LoraInfo(max_lora, frozenset(running), frozenset(),
                                         frozenset({"base"}), frozenset(loaded)))


def urls(snapshots) -> list[str]:
    return [s.url for s in snapshots]


def test_requests_go_where_their_adapter_is_active_while_it_has_room():
    a, b, idle = replica("a", {"x"}), replica("b", {"y"}), replica("idle")
    assert urls(prefer_adapter("x", [a, b, idle])) == ["a"]
    assert urls(prefer_adapter("y", [a, b, idle])) == ["b"]
    # nowhere active: only replicas that can load it without evicting a running adapter
    assert urls(prefer_adapter("z", [a, b, idle])) == ["idle"]
    # its replica queues: a replica with a free slot takes it instead
    busy = replica("a", {"x"}, waiting=3)
    assert urls(prefer_adapter("x", [busy, b, idle])) == ["idle"]
    # no free slot anywhere: the replica holding it, queue or not
    assert urls(prefer_adapter("x", [busy, b])) == ["a"]
    assert urls(prefer_adapter("z", [busy, b])) == ["a", "b"]


def test_only_replicas_serving_the_adapter_qualify_when_some_report_it():
    holds_x = replica("a", loaded={"x"})
    holds_y = replica("b", {"y"}, loaded={"y"})
    assert urls(prefer_adapter("x", [holds_x, holds_y])) == ["a"]
    busy_x = replica("a", {"x"}, waiting=4, loaded={"x"})
    assert urls(prefer_adapter("x", [busy_x, holds_y, replica("c")])) == ["a"]
    assert urls(prefer_adapter("y", [busy_x, holds_y])) == ["b"]


def test_base_model_and_lora_free_fleets_are_not_narrowed():
    a, b = replica("a", {"x"}), replica("b")
    assert urls(prefer_adapter("base", [a, b])) == ["a", "b"]
    assert urls(prefer_adapter(None, [a, b])) == ["a", "b"]
    plain = [ReplicaSnapshot("p"), ReplicaSnapshot("q")]
    assert urls(prefer_adapter("x", plain)) == ["p", "q"]


def test_model_of_reads_the_body_model_field_only():
    assert model_of(b'{"model": "x", "prompt": "hi"}') == "x"
    assert model_of(b'{"prompt": "hi"}') is None
    assert model_of(b"not json") is None
    assert model_of(b'["model"]') is None


def test_the_adapter_salts_prefix_keys_only_when_the_model_is_not_the_base():
    from shoal.runtime.router.policies.lora_affinity import adapter_for_keys

    info = LoraInfo(2, frozenset(), frozenset(), frozenset({"base"}), frozenset({"a"}))
    assert adapter_for_keys("a", [None, info]) == "a"
    assert adapter_for_keys("not-loaded-yet", [info]) == "not-loaded-yet"  # its KV is its own
    assert adapter_for_keys("base", [info, None]) is None
    assert adapter_for_keys(None, [info]) is None
    assert adapter_for_keys("a", [None, None]) is None  # LoRA off everywhere: all the base


async def test_router_and_picker_keys_equal_the_engines_block_hashes_per_adapter():
    """Same token prompt, base vs adapter: the router's and the picker's keys are exactly
    the block hashes the engine core gives such a request (its scheduler Request with that
    adapter), so the base's and each adapter's prefixes never match each other."""
    from shoal.runtime.kv.block_hash import hash_prefix_blocks
    from shoal.runtime.router.epp.picker import EndpointPicker
    from shoal.runtime.router.policies.base import make_policy
    from shoal.runtime.router.policies.request_keys import KeyConfig, RequestKeys
    from shoal.runtime.router.proxy.app import ProxySettings, RouterApp
    from shoal.runtime.router.replicas.pool import ReplicaPool
    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.scheduler.request import Request
    from shoal.runtime.wire.messages import EngineCoreRequest

    ids, config = list(range(100, 132)), KeyConfig(block_size=4, model_revision="rev")

    def engine_hashes(adapter: str | None) -> list[int]:
        core = Request(EngineCoreRequest(request_id="r", prompt_token_ids=ids,
                                         sampling_params=SamplingParams(),
                                         adapter_id=adapter), 0, 4096, model_revision="rev")
        return hash_prefix_blocks(ids, 4, core.extra_digest)

    pool = ReplicaPool()
    pool.sync(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    for replica in pool.replicas.values():
        replica.ready = True
        replica.lora = LoraInfo(2, frozenset(), frozenset(), frozenset({"base"}),
                                frozenset({"a", "b"}))
    router = RouterApp(pool, make_policy("cache-affinity"), ProxySettings(key_config=config))
    picker = EndpointPicker(pool, make_policy("cache-affinity"), config)

    async def both(model: str) -> tuple[list[int], list[int]]:
        body = json.dumps({"model": model, "prompt": ids}).encode()
        routed = await router._keys("/v1/completions", body, None)
        picked = await picker.keys("/v1/completions", body)
        assert isinstance(routed, RequestKeys) and isinstance(picked, RequestKeys)
        return routed.block_keys, picked.block_keys

    for model, adapter in (("base", None), ("a", "a"), ("b", "b")):
        routed, picked = await both(model)
        assert routed == engine_hashes(adapter), (model, "router")
        assert picked == engine_hashes(adapter), (model, "picker")
    assert set(engine_hashes("a")).isdisjoint(engine_hashes(None))
    assert set(engine_hashes("a")).isdisjoint(engine_hashes("b"))


async def test_an_adapter_request_does_not_follow_the_bases_cached_prefix():
    """The picker sent a long base prompt to one endpoint; the same prompt for an adapter
    matches nothing there (different KV), while the base's repeat follows it."""
    from shoal.runtime.router.epp.picker import EndpointPicker
    from shoal.runtime.router.policies.base import make_policy
    from shoal.runtime.router.policies.request_keys import KeyConfig
    from shoal.runtime.router.replicas.pool import ReplicaPool

    pool = ReplicaPool()
    pool.sync(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    for replica in pool.replicas.values():
        replica.ready = True
        replica.lora = LoraInfo(4, frozenset(), frozenset(), frozenset({"base"}),
                                frozenset({"a"}))
    picker = EndpointPicker(pool, make_policy("cache-affinity"), KeyConfig(block_size=4))
    prompt = list(range(200, 264))

    async def pick(model: str):
        body = json.dumps({"model": model, "prompt": prompt}).encode()
        chosen = await picker.pick("/v1/completions", body, None)
        picker.release(chosen.url)
        return chosen

    first = await pick("base")
    assert first.matched_blocks == 0
    again = await pick("base")
    assert again.url == first.url and again.matched_blocks == len(prompt) // 4
    adapter = await pick("a")
    assert adapter.matched_blocks == 0  # the base's blocks are not its KV
