"""Status is a pure function of the pods and what their /ready and /metrics said."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from shoal.operator.decide.replica import ProbeResult, observe_replica, probe_target
from shoal.operator.decide.status import aggregate_metrics, build_status, decide_phase
from shoal.operator.loop.reconcile import gate_patches, new_failures

from shoal.contract.metrics import EngineMetrics, parse_engine_metrics

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
GATE = "serving.shoal.dev/engine-ready"
READY = ProbeResult(200, {"status": "ready", "phase": "ready"},
                    EngineMetrics(running=2, waiting=1, kv_cache_usage=0.4,
                                  prefix_cache_queries=100, prefix_cache_hits=30))
LOADING = ProbeResult(503, {"status": "starting", "phase": "loading"})
DOWN = ProbeResult(None)


def pod(name: str = "p0", *, started_s_ago: int = 60, restarts: int = 0,
        waiting: str | None = None, last_exit: dict[str, Any] | None = None,
        gate: str | None = None, unschedulable: bool = False,
        template_hash: str = "h1") -> dict[str, Any]:
    container: dict[str, Any] = {"name": "engine", "restartCount": restarts,
                                 "state": {"waiting": {"reason": waiting}} if waiting else
                                 {"running": {}}}
    if last_exit:
        container["lastState"] = {"terminated": last_exit}
    conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                   "message": "0/3 nodes have nvidia.com/gpu"}] if unschedulable else []
    if gate:
        conditions.append({"type": GATE, "status": gate})
    return {
        "metadata": {"name": name, "annotations": {"serving.shoal.dev/template-hash":
                                                   template_hash}},
        "status": {"phase": "Pending" if unschedulable else "Running", "podIP": "10.0.0.1",
                   "startTime": (NOW - timedelta(seconds=started_s_ago)).isoformat(),
                   "containerStatuses": [container], "conditions": conditions},
    }


def observe(p: dict[str, Any], probe: ProbeResult | None, budget: int = 600) -> Any:
    return observe_replica(p, probe, NOW, budget)


@pytest.mark.parametrize("p, probe, ready, phase, reason", [
    (pod(), READY, True, "ready", None),
    (pod(), LOADING, False, "loading", None),
    (pod(started_s_ago=700), LOADING, False, "loading", "StartupTimeout"),
    (pod(restarts=1, last_exit={"exitCode": 1, "reason": "Error"}), DOWN, False, "unreachable",
     "RankFailure"),
    (pod(restarts=1, last_exit={"exitCode": 137, "reason": "OOMKilled"}), DOWN, False,
     "unreachable", "OOMKilled"),
    (pod(restarts=4, waiting="CrashLoopBackOff", last_exit={"exitCode": 1}), None, False,
     "pending", "CrashLoop"),
    (pod(waiting="ImagePullBackOff"), None, False, "pending", "ImagePullFailure"),
    (pod(unschedulable=True), None, False, "pending", "Unschedulable"),
    (pod(gate="True"), DOWN, False, "unreachable", "EngineUnreachable"),
    (pod(), ProbeResult(503, {"status": "failed", "phase": "loading"}), False, "loading",
     "RankFailure"),
    (pod(), ProbeResult(503, {"status": "not ready", "phase": "dead"}), False, "dead",
     "RankFailure"),
    # a restarted engine that came back is healthy again: the old exit is history
    (pod(restarts=1, last_exit={"exitCode": 1}), READY, True, "ready", None),
])
def test_replica_classification(p: dict[str, Any], probe: ProbeResult | None, ready: bool,
                                phase: str, reason: str | None) -> None:
    replica = observe(p, probe)
    assert (replica.ready, replica.phase) == (ready, phase)
    assert (replica.failure.reason if replica.failure else None) == reason


def test_a_replica_fetching_weights_is_downloading_and_the_service_loading() -> None:
    fetching = pod()
    fetching["status"]["phase"] = "Pending"
    fetching["status"]["initContainerStatuses"] = [
        {"name": "fetch-weights", "state": {"running": {"startedAt": NOW.isoformat()}}}]
    replica = observe(fetching, None)
    assert (replica.ready, replica.phase, replica.failure) == (False, "downloading", None)
    assert decide_phase([replica], 1) == ("Loading", "EnginesLoading")


def test_only_running_pods_with_an_ip_are_probed() -> None:
    assert probe_target(pod()) == "10.0.0.1"
    assert probe_target(pod(unschedulable=True)) is None
    terminating = pod()
    terminating["metadata"]["deletionTimestamp"] = NOW.isoformat()
    assert probe_target(terminating) is None


def test_metrics_are_read_from_prometheus_text() -> None:
    text = "\n".join([
        "# HELP shoal:kv_cache_usage_perc KV-cache usage",
        "# TYPE shoal:kv_cache_usage_perc gauge",
        'shoal:kv_cache_usage_perc{model_name="m"} 0.375',
        'shoal:num_requests_running{model_name="m"} 3.0',
        'shoal:num_requests_waiting{model_name="m"} 7',
        'shoal:prefix_cache_queries_total{model_name="m"} 1000.0',
        'shoal:prefix_cache_hits_total{model_name="m"} 250.0 1712345678',
        'shoal:num_preemptions_total{model_name="m"} 2',
        'shoal:prompt_tokens_total{model_name="m"} 99',
        'shoal:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5',
        "garbage line without value",
    ])
    assert parse_engine_metrics(text) == EngineMetrics(
        running=3, waiting=7, kv_cache_usage=0.375, prefix_cache_queries=1000,
        prefix_cache_hits=250, preemptions=2)


def test_aggregates_use_ready_replicas_only() -> None:
    busy = ProbeResult(200, {"phase": "ready"}, EngineMetrics(
        running=4, waiting=5, kv_cache_usage=0.8, prefix_cache_queries=300,
        prefix_cache_hits=270))
    replicas = [observe(pod("a"), READY), observe(pod("b"), busy), observe(pod("c"), LOADING)]
    agg = aggregate_metrics(replicas)
    assert agg.kv_cache_usage == pytest.approx(0.6)
    assert agg.prefix_cache_hit_rate == pytest.approx(300 / 400)
    assert (agg.waiting, agg.running) == (6, 6)
    assert aggregate_metrics([observe(pod(), LOADING)]).kv_cache_usage is None


@pytest.mark.parametrize("probes, desired, phase, reason", [
    ([READY, READY], 2, "Ready", "AllReplicasReady"),
    ([], 0, "Idle", "ScaledToZero"),
    ([], 2, "Pending", "WaitingForPods"),
    ([LOADING, LOADING], 2, "Loading", "EnginesLoading"),
    ([READY, LOADING], 2, "Degraded", "ReplicasStarting"),
    ([READY, DOWN], 2, "Degraded", "RankFailure"),
    ([DOWN, DOWN], 2, "Failed", "RankFailure"),
])
def test_phase(probes: list[ProbeResult], desired: int, phase: str, reason: str) -> None:
    crashed = {"exitCode": 1, "reason": "Error"}
    replicas = [observe(pod(f"p{i}", restarts=1 if p is DOWN else 0,
                            last_exit=crashed if p is DOWN else None), p)
                for i, p in enumerate(probes)]
    assert decide_phase(replicas, desired) == (phase, reason)


def test_status_fields_and_conditions() -> None:
    replicas = [observe(pod("a"), READY),
                observe(pod("b", restarts=1, last_exit={"exitCode": 1}, template_hash="old"),
                        DOWN)]
    status = build_status(replicas=replicas, desired=2, current_hash="h1", generation=3,
                          served_name="m", url="http://m.ns.svc.cluster.local",
                          selector="a=b", previous={}, now=NOW)
    assert status["ready"] == "1/2"
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 1, 1)
    assert status["phase"] == "Degraded" and status["observedGeneration"] == 3
    assert (status["kvCacheUsage"], status["kvCacheUsagePercent"]) == (0.4, 40)
    assert (status["prefixCacheHitRate"], status["prefixCacheHitPercent"]) == (0.3, 30)
    assert status["waitingRequests"] == 1
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Degraded"]["reason"] == "RankFailure"
    assert "b: RankFailure" in conditions["Degraded"]["message"]
    assert conditions["Progressing"]["reason"] == "RollingOut"
    entry = status["replicaStatus"][1]
    assert entry["name"] == "b" and entry["lastFailure"]["reason"] == "RankFailure"
    assert "kvCacheUsage" in status["replicaStatus"][0] and "kvCacheUsage" not in entry


def test_condition_transition_time_survives_rounds_without_change() -> None:
    replicas = [observe(pod("a"), READY)]
    first = build_status(replicas=replicas, desired=1, current_hash="h1", generation=1,
                         served_name="m", url="u", selector="s", previous={}, now=NOW)
    later = build_status(replicas=replicas, desired=1, current_hash="h1", generation=1,
                         served_name="m", url="u", selector="s", previous=first,
                         now=NOW + timedelta(minutes=5))
    assert first["conditions"] == later["conditions"]
    broken = [observe(pod("a", restarts=1, last_exit={"exitCode": 1}), DOWN)]
    after = build_status(replicas=broken, desired=1, current_hash="h1", generation=1,
                         served_name="m", url="u", selector="s", previous=first,
                         now=NOW + timedelta(minutes=6))
    ready = next(c for c in after["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"].startswith("2026-01-01T12:06")


def test_gate_patches_follow_ready_and_skip_unchanged_pods() -> None:
    pods = [pod("a", gate="True"), pod("b"), pod("c", gate="True")]
    replicas = [observe(pods[0], READY), observe(pods[1], READY), observe(pods[2], LOADING)]
    patches = dict(gate_patches(pods, replicas, NOW))
    assert set(patches) == {"b", "c"}
    (cond_b,) = patches["b"]["status"]["conditions"]
    (cond_c,) = patches["c"]["status"]["conditions"]
    assert (cond_b["type"], cond_b["status"]) == (GATE, "True")
    assert (cond_c["status"], cond_c["reason"]) == ("False", "EngineLoading")


def test_events_are_valid_core_v1_events() -> None:
    import kubernetes_validate
    from shoal.operator.names import Owner
    from shoal.operator.render.event import render_event

    event = render_event(Owner("m", "ml", "uid-1"), "Warning", "RankFailure", "p0: exited", NOW)
    kubernetes_validate.validate(event, "1.30.0", strict=True)
    assert event["involvedObject"]["kind"] == "InferenceService"
    assert event["metadata"]["name"].startswith("m.")


def test_a_failure_is_announced_once_per_incident() -> None:
    replicas = [observe(pod("a", restarts=1, last_exit={"exitCode": 1}), DOWN)]
    assert [(name, f.reason) for name, f in new_failures([], replicas)] == [("a", "RankFailure")]
    previous = [{"name": "a", "lastFailure": {"reason": "RankFailure"}}]
    assert new_failures(previous, replicas) == []


def _undeclared(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Fields the API server would prune (not declared in the structural schema)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        missing = [f"{path}.{k}" for k in value if k not in props]
        return missing + [m for k, v in value.items() if k in props
                          for m in _undeclared(props[k], v, f"{path}.{k}")]
    if isinstance(value, list) and "items" in schema:
        return [m for i, v in enumerate(value) for m in _undeclared(schema["items"], v,
                                                                     f"{path}[{i}]")]
    return []


def test_every_status_field_is_declared_in_the_crd(crd_schema: dict[str, Any]) -> None:
    import jsonschema

    replicas = [observe(pod("a"), READY),
                observe(pod("b", restarts=1, last_exit={"exitCode": 1}), DOWN)]
    status = build_status(replicas=replicas, desired=2, current_hash="h1", generation=1,
                          served_name="m", url="u", selector="s", previous={}, now=NOW)
    status["recycle"] = {"count": 1, "lastAt": 1700000000.0}
    status["autoscaler"] = {"recommendation": 2,
                            "recommendations": [{"at": 1700000000.0, "replicas": 2}]}
    status_schema = crd_schema["properties"]["status"]
    assert _undeclared(status_schema, status, "status") == []
    jsonschema.Draft4Validator(status_schema).validate(status)
