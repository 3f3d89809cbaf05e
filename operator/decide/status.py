"""InferenceService status from the replicas' states (pure): counts, phase, aggregates, conditions.

Phases: Pending (nothing started), Loading (starting, none ready), Ready (ready == desired),
Degraded (below desired with some ready, or a replica failing), Failed (none ready and failing),
Idle (scaled to zero: no engine runs; the router holds a request and asks for one).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shoal.operator.decide.replica import ReplicaState

STARTING_PHASES = ("downloading", "loading", "profiling", "capturing", "starting")


@dataclass(frozen=True)
class Aggregates:
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    waiting: int
    running: int


def aggregate_metrics(replicas: list[ReplicaState]) -> Aggregates:
    """Mean KV usage of ready replicas; hit rate = hit tokens / queried tokens summed over them."""
    scraped = [r.metrics for r in replicas if r.ready and r.metrics is not None]
    if not scraped:
        return Aggregates(None, None, 0, 0)
    kv = sum(m.kv_cache_usage for m in scraped) / len(scraped)
    queries = sum(m.prefix_cache_queries for m in scraped)
    hits = sum(m.prefix_cache_hits for m in scraped)
    return Aggregates(
        kv_cache_usage=min(1.0, max(0.0, kv)),
        prefix_cache_hit_rate=(hits / queries) if queries > 0 else 0.0,
        waiting=int(sum(m.waiting for m in scraped)),
        running=int(sum(m.running for m in scraped)),
    )


def decide_phase(replicas: list[ReplicaState], desired: int) -> tuple[str, str]:
    """(phase, reason)."""
    ready = sum(r.ready for r in replicas)
    failing = [r for r in replicas if r.failure is not None]
    if desired == 0:
        return "Idle", "ScaledToZero"
    if ready >= desired:
        return "Ready", "AllReplicasReady"
    if failing:
        reason = failing[0].failure.reason if failing[0].failure else "ReplicaFailed"
        return ("Degraded" if ready > 0 else "Failed"), reason
    if ready > 0:
        return "Degraded", "ReplicasStarting"
    if any(r.phase in STARTING_PHASES for r in replicas):
        return "Loading", "EnginesLoading"
    return "Pending", "WaitingForPods"


def _condition(kind: str, ok: bool, reason: str, message: str, previous: dict[str, dict[str, Any]],
               now: datetime, generation: int) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(kind)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now.isoformat().replace("+00:00", "Z"),
        "observedGeneration": generation,
    }


def build_conditions(replicas: list[ReplicaState], desired: int, updated: int, phase: str,
                     reason: str, previous: list[dict[str, Any]], now: datetime,
                     generation: int) -> list[dict[str, Any]]:
    ready = sum(r.ready for r in replicas)
    prev = {c.get("type", ""): c for c in previous or []}
    failing = [r for r in replicas if r.failure is not None]
    failure_text = "; ".join(f"{r.name}: {r.failure.reason}: {r.failure.message}"
                             for r in failing if r.failure)
    progressing = updated < desired or len(replicas) != desired or (
        ready < desired and not failing)
    return [
        _condition("Ready", phase in ("Ready", "Idle"), reason, f"{ready}/{desired} replicas ready",
                   prev, now, generation),
        _condition("Progressing", progressing,
                   "RollingOut" if updated < desired else
                   ("Scaling" if len(replicas) != desired else
                    ("Loading" if progressing else "Stable")),
                   f"{updated}/{desired} replicas on the current spec", prev, now, generation),
        _condition("Degraded", phase in ("Degraded", "Failed"),
                   reason if phase in ("Degraded", "Failed") else "AsExpected",
                   failure_text or (f"{ready}/{desired} replicas ready"), prev, now, generation),
    ]


def replica_status_entry(r: ReplicaState) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": r.name,
        "ready": r.ready,
        "phase": r.phase,
        "restarts": r.restarts,
    }
    if r.metrics is not None:
        entry.update(kvCacheUsage=round(r.metrics.kv_cache_usage, 4),
                     running=int(r.metrics.running), waiting=int(r.metrics.waiting))
    if r.failure is not None:
        entry["lastFailure"] = {"reason": r.failure.reason, "message": r.failure.message}
    if r.adapters is not None:
        entry["adapters"] = list(r.adapters)
    return entry


def build_status(*, replicas: list[ReplicaState], desired: int, current_hash: str,
                 generation: int, served_name: str, url: str, selector: str,
                 previous: dict[str, Any], now: datetime) -> dict[str, Any]:
    ready = sum(r.ready for r in replicas)
    updated = sum(r.template_hash == current_hash for r in replicas)
    phase, reason = decide_phase(replicas, desired)
    agg = aggregate_metrics(replicas)
    return {
        "replicas": len(replicas),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "desiredReplicas": desired,
        "ready": f"{ready}/{desired}",
        "selector": selector,
        "phase": phase,
        "servedModelName": served_name,
        "url": url,
        "observedGeneration": generation,
        # None clears the field (merge patch) when no ready replica was scraped.
        "kvCacheUsage": None if agg.kv_cache_usage is None else round(agg.kv_cache_usage, 4),
        "kvCacheUsagePercent": None if agg.kv_cache_usage is None else
        round(agg.kv_cache_usage * 100),
        "prefixCacheHitRate": None if agg.prefix_cache_hit_rate is None else
        round(agg.prefix_cache_hit_rate, 4),
        "prefixCacheHitPercent": None if agg.prefix_cache_hit_rate is None else
        round(agg.prefix_cache_hit_rate * 100),
        "waitingRequests": agg.waiting,
        "runningRequests": agg.running,
        "replicaStatus": [replica_status_entry(r) for r in sorted(replicas, key=lambda r: r.name)],
        "conditions": build_conditions(replicas, desired, updated, phase, reason,
                                       previous.get("conditions") or [], now, generation),
    }


def build_pool_status(replicas: list[ReplicaState], desired: int,
                      current_hash: str) -> dict[str, Any]:
    """status.prefill: the prefill pool's counts, phase and load. The service's own phase
    stays the decode pool's: without a ready prefill engine the router lets decode compute
    the prompt (phase Idle: scaled to zero)."""
    ready = sum(r.ready for r in replicas)
    agg = aggregate_metrics(replicas)
    return {
        "replicas": len(replicas),
        "readyReplicas": ready,
        "updatedReplicas": sum(r.template_hash == current_hash for r in replicas),
        "desiredReplicas": desired,
        "ready": f"{ready}/{desired}",
        "phase": decide_phase(replicas, desired)[0],
        "kvCacheUsage": None if agg.kv_cache_usage is None else round(agg.kv_cache_usage, 4),
        "waitingRequests": agg.waiting,
        "runningRequests": agg.running,
        "replicaStatus": [replica_status_entry(r)
                          for r in sorted(replicas, key=lambda r: r.name)],
    }
