"""LoRA affinity before the routing policy: parsing an engine's ``lora_requests_info`` (as
the API exports it) and narrowing the candidates to replicas holding the adapter."""

from __future__ import annotations

from shoal.runtime.api.metrics import ServerMetrics
from shoal.runtime.engine.messages import SchedulerStats
from shoal.runtime.router.lora_affinity import model_of, prefer_adapter
from shoal.runtime.router.policy import ReplicaSnapshot

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
