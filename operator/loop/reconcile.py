"""One reconciliation round of an InferenceService: the I/O edge around the pure functions.

Level-based: every round reads the whole world (object, pods, engine endpoints) and writes the
whole desired state (children by server-side apply, pod gates, status), so a round after an
operator restart or a missed event converges the same way as any other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import httpx
from shoal.operator.decide.autoscale import (
    Activity,
    Recommendation,
    ScaleDecision,
    decide_replicas,
    observe_activity,
)
from shoal.operator.decide.backoff import RecycleState, after_recycle, after_round, may_recycle
from shoal.operator.decide.replica import (
    Failure,
    ProbeResult,
    ReplicaState,
    observe_replica,
    probe_target,
)
from shoal.operator.decide.status import (
    aggregate_metrics,
    build_pool_status,
    build_status,
    decide_phase,
)
from shoal.operator.kube.api import API_ERRORS, ISVC, POD, KubeApi
from shoal.operator.loop.engine_calls import probe_engine, sync_replica
from shoal.operator.loop.gateway import reconcile_gateway
from shoal.operator.loop.prune import prune_children
from shoal.operator.names import (
    ANNOTATION_CAPACITY_REQUEST,
    ANNOTATION_PREFILL_CAPACITY_REQUEST,
    ENGINE_CONTAINER,
    ENGINE_METRICS_PORT,
    ENGINE_READY_CONDITION,
    Owner,
    engine_name,
    engine_selector,
    label_selector_string,
    prefill_name,
)
from shoal.operator.render.children import render_children
from shoal.operator.render.engine import template_hash
from shoal.operator.render.event import render_event
from shoal.operator.render.gateway import render_gateway_children
from shoal.operator.render.pd import prefill_selector
from shoal.operator.render.router import service_url
from shoal.operator.spec.adapters import LoraSpec, adapters_in_args, syncs_at_run_time
from shoal.operator.spec.service import AutoscalingSpec, ServiceSpec, SpecError, parse_spec

log = logging.getLogger("shoal.operator")


@dataclass
class ReconcileContext:
    """What a round needs besides the object: the API client and the probing settings."""

    kube: KubeApi
    http: httpx.AsyncClient
    engine_port: int = ENGINE_METRICS_PORT  # /ready and /metrics without the API key
    probe_timeout: float = 2.0


def _now() -> datetime:
    return datetime.now(UTC)


def new_failures(previous: list[dict[str, Any]], replicas: list[ReplicaState]
                 ) -> list[tuple[str, Failure]]:
    """(pod, failure) whose reason is new since the last status (one Event per incident)."""
    before = {e.get("name"): (e.get("lastFailure") or {}).get("reason") for e in previous}
    return [(r.name, r.failure) for r in replicas
            if r.failure is not None and before.get(r.name) != r.failure.reason]


def gate_patches(pods: list[dict[str, Any]], replicas: list[ReplicaState], now: datetime
                 ) -> list[tuple[str, dict[str, Any]]]:
    """(pod name, status patch) for each pod whose readiness gate differs from its /ready."""
    stamp = now.isoformat().replace("+00:00", "Z")
    wanted = {r.name: r for r in replicas}
    patches = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        replica = wanted.get(meta.get("name"))
        if replica is None or meta.get("deletionTimestamp"):
            continue
        current = next((c for c in (pod.get("status") or {}).get("conditions") or []
                        if c.get("type") == ENGINE_READY_CONDITION), None)
        status = "True" if replica.ready else "False"
        if current is not None and current.get("status") == status:
            continue
        reason = "EngineReady" if replica.ready else f"Engine{replica.phase.capitalize()}"
        patches.append((meta["name"], {"status": {"conditions": [{
            "type": ENGINE_READY_CONDITION, "status": status, "reason": reason,
            "message": f"/ready: {replica.phase}", "lastTransitionTime": stamp,
            "lastProbeTime": stamp,
        }]}}))
    return patches


async def _event(ctx: ReconcileContext, owner: Owner, kind: str, reason: str, msg: str) -> None:
    try:
        await ctx.kube.create(render_event(owner, kind, reason, msg, _now()))
    except API_ERRORS as exc:  # an Event is best effort; never fail the round
        log.warning("event %s for %s/%s not posted: %s", reason, owner.namespace, owner.name, exc)


async def _probe_all(ctx: ReconcileContext, pods: list[dict[str, Any]]
                     ) -> list[ProbeResult | None]:
    async def one(pod: dict[str, Any]) -> ProbeResult | None:
        target = probe_target(pod)
        if target is None:
            return None
        return await probe_engine(ctx.http, target, ctx.engine_port)
    return list(await asyncio.gather(*(one(p) for p in pods)))


async def _sync_adapters(ctx: ReconcileContext, lora: LoraSpec, replicas: list[ReplicaState]
                         ) -> tuple[list[ReplicaState], list[str]]:
    """Load and unload on every ready replica so it serves exactly spec.adapters."""
    wanted = {a.name: a.engine_path for a in lora.adapters}

    async def one(r: ReplicaState) -> tuple[ReplicaState, list[str]]:
        if not r.ready or r.pod_ip is None:
            return r, []
        result = await sync_replica(ctx.http, r.pod_ip, ctx.engine_port, wanted)
        return replace(r, adapters=tuple(result.served)), [f"{r.name}: {e}"
                                                          for e in result.errors]

    done = await asyncio.gather(*(one(r) for r in replicas))
    return [r for r, _ in done], sorted(e for _, errors in done for e in errors)


def _engine_args(pod: dict[str, Any]) -> list[str]:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == ENGINE_CONTAINER:
            return list(container.get("args") or [])
    return []


async def _apply_children(ctx: ReconcileContext, owner: Owner, spec: ServiceSpec,
                          replicas: int) -> dict[str, str]:
    """Applies every child; returns each Deployment's pod-template hash by name."""
    children = render_children(owner, spec, replicas)
    for child in children:
        await ctx.kube.apply(child)
    return {c["metadata"]["name"]: template_hash(c["spec"]["template"]["spec"])
            for c in children if c["kind"] == "Deployment"}


async def _observe_prefill(ctx: ReconcileContext, owner: Owner, spec: ServiceSpec,
                           current_hash: str, previous: dict[str, Any], now: datetime
                           ) -> tuple[dict[str, Any], list[ReplicaState]] | None:
    """The prefill pool's pods: probed and gated like the decode pool's; its status block."""
    if spec.prefill is None:
        return None
    pods = await ctx.kube.list(POD, owner.namespace, prefill_selector(owner))
    probes = await _probe_all(ctx, pods)
    replicas = [observe_replica(p, r, now, spec.startup_timeout_seconds)
                for p, r in zip(pods, probes, strict=True)]
    for pod_name, patch in gate_patches(pods, replicas, now):
        await ctx.kube.strategic_patch(POD, owner.namespace, pod_name, patch,
                                       subresource="status")
    before = (previous.get("prefill") or {}).get("replicaStatus") or []
    for pod_name, failure in new_failures(before, replicas):
        await _event(ctx, owner, "Warning", failure.reason, f"{pod_name}: {failure.message}")
    return build_pool_status(replicas, spec.prefill.replicas, current_hash), replicas


@dataclass(frozen=True)
class PoolScaling:
    """What the built-in autoscaler needs of one pool: the decode pool (spec.autoscaling,
    spec.replicas) or the prefill pool (spec.prefill.autoscaling, spec.prefill.replicas)."""

    policy: AutoscalingSpec
    current: int  # the replicas the spec asks for now
    saved: dict[str, Any]  # the pool's autoscaler block of the last status
    capacity_annotation: str  # the router's ask for this pool (scale from zero)
    label: str  # "replicas" or "prefill replicas", in the Scaled Event

    def spec_patch(self, replicas: int) -> dict[str, Any]:
        if self.label == "replicas":  # the field the scale subresource (HPA/KEDA) writes too
            return {"spec": {"replicas": replicas}}
        return {"spec": {"prefill": {"replicas": replicas}}}


@dataclass(frozen=True)
class AutoscaleOutcome:
    decision: ScaleDecision
    activity: Activity
    capacity_seen: str | None

    def status(self) -> dict[str, Any]:
        """The pool's autoscaler block of status (read back by the next round)."""
        return {
            "recommendation": self.decision.recommendation,
            "recommendations": [{"at": r.at, "replicas": r.replicas}
                                for r in self.decision.history],
            "lastActiveAt": self.activity.last_active_at,
            "requestsSeen": self.activity.requests_seen,
            "capacityRequestSeen": self.capacity_seen,
        }


async def _autoscale(ctx: ReconcileContext, owner: Owner, pool: PoolScaling,
                     body: dict[str, Any], replicas: list[ReplicaState]) -> AutoscaleOutcome:
    """One pool's scaling decision from its own engines' queue and KV usage; a change is
    written to the pool's replicas field of the spec."""
    saved = pool.saved
    history = tuple(Recommendation(float(r["at"]), int(r["replicas"]))
                    for r in saved.get("recommendations") or [])
    now = time.time()
    previous = (Activity(float(saved["lastActiveAt"]), float(saved.get("requestsSeen") or 0))
                if saved.get("lastActiveAt") is not None else None)
    load = aggregate_metrics(replicas)
    scraped = [r.metrics for r in replicas if r.ready and r.metrics is not None]
    finished = sum(m.finished for m in scraped) if scraped else None
    activity = observe_activity(previous, load.running, load.waiting, finished, now)
    # the router's ask for capacity: an annotation newer than the last one acted on
    asked = ((body.get("metadata") or {}).get("annotations") or {}).get(
        pool.capacity_annotation)
    capacity_requested = bool(asked) and asked != saved.get("capacityRequestSeen")
    current = pool.current
    ready = sum(r.ready for r in replicas)
    kv = None if load.kv_cache_usage is None else round(load.kv_cache_usage, 4)
    decision, activity = decide_replicas(pool.policy, current, ready, kv, load.waiting,
                                         history, activity, capacity_requested, now)
    if decision.replicas != current:
        await ctx.kube.merge_patch(ISVC, owner.namespace, owner.name,
                                   pool.spec_patch(decision.replicas))
        await _event(ctx, owner, "Normal", "Scaled",
                     f"{pool.label} {current} -> {decision.replicas}: {decision.reason}")
    return AutoscaleOutcome(decision, activity, asked)


async def reconcile(ctx: ReconcileContext, body: dict[str, Any]) -> dict[str, Any]:
    """Run one round; returns the status written."""
    owner = Owner.from_body(body)
    meta = body.get("metadata") or {}
    generation = int(meta.get("generation") or 0)
    previous: dict[str, Any] = dict(body.get("status") or {})
    try:
        spec = parse_spec(body.get("spec") or {})
    except SpecError as exc:
        status = {"phase": "Failed", "observedGeneration": generation, "conditions": [{
            "type": "Ready", "status": "False", "reason": "InvalidSpec", "message": str(exc),
            "lastTransitionTime": _now().isoformat().replace("+00:00", "Z")}]}
        if (previous.get("conditions") or [{}])[0].get("message") != str(exc):
            await _event(ctx, owner, "Warning", "InvalidSpec", str(exc))
            await ctx.kube.merge_patch(ISVC, owner.namespace, owner.name, {"status": status},
                                       subresource="status")
        return status

    desired = spec.replicas
    hashes = await _apply_children(ctx, owner, spec, desired)
    current_hash = hashes[engine_name(owner)]
    gateway = await reconcile_gateway(ctx.kube, owner, spec, previous.get("conditions") or [],
                                      _now(), generation)
    if gateway.event is not None:
        await _event(ctx, owner, *gateway.event)
    # what the spec no longer renders (router off, gateway block gone, picker external)
    pruned = await prune_children(ctx.kube, owner, render_children(owner, spec, desired)
                                  + render_gateway_children(owner, spec))
    if pruned:
        await _event(ctx, owner, "Normal", "Pruned", "deleted, no longer rendered by the spec: "
                     + ", ".join(f"{resource.kind}/{name}" for resource, name in pruned))

    pods = await ctx.kube.list(POD, owner.namespace, engine_selector(owner))
    probes = await _probe_all(ctx, pods)
    now = _now()
    replicas = [observe_replica(p, r, now, spec.startup_timeout_seconds)
                for p, r in zip(pods, probes, strict=True)]
    adapter_errors: list[str] = []
    if syncs_at_run_time(spec.lora, spec.auth is not None) and spec.lora is not None:
        # before the gates open: a new replica serves them first
        replicas, adapter_errors = await _sync_adapters(ctx, spec.lora, replicas)
        reported = set(previous.get("adapterErrors") or [])
        for error in adapter_errors:
            if error not in reported:
                await _event(ctx, owner, "Warning", "AdapterSyncFailed", error)

    elif spec.lora is not None:  # given at startup (spec.auth): what each pod started with
        replicas = [replace(r, adapters=adapters_in_args(_engine_args(p))) if r.ready else r
                    for p, r in zip(pods, replicas, strict=True)]

    for pod_name, patch in gate_patches(pods, replicas, now):
        await ctx.kube.strategic_patch(POD, owner.namespace, pod_name, patch,
                                       subresource="status")
    for pod_name, failure in new_failures(previous.get("replicaStatus") or [], replicas):
        await _event(ctx, owner, "Warning", failure.reason, f"{pod_name}: {failure.message}")

    saved = previous.get("recycle") or {}
    recycle = RecycleState(count=int(saved.get("count") or 0), last_at=saved.get("lastAt"))
    for r in replicas:
        if r.failure is not None and may_recycle(r.failure.reason, recycle, time.time()):
            if await ctx.kube.delete(POD, owner.namespace, r.name):
                recycle = after_recycle(recycle, time.time())
                await _event(ctx, owner, "Warning", "Recycled",
                             f"{r.name} deleted after {r.failure.reason} (attempt "
                             f"{recycle.count}); the Deployment starts a fresh pod")

    status = build_status(
        replicas=replicas, desired=desired, current_hash=current_hash, generation=generation,
        served_name=spec.model.served_name, url=service_url(owner),
        selector=label_selector_string(engine_selector(owner)), previous=previous, now=now)
    recycle = after_round(recycle, status["readyReplicas"] >= desired and desired > 0)
    if spec.lora is not None or "adapterErrors" in previous:
        status["adapterErrors"] = adapter_errors if spec.lora is not None else None
    status["recycle"] = {"count": recycle.count, "lastAt": recycle.last_at}

    observed = await _observe_prefill(ctx, owner, spec, hashes.get(prefill_name(owner), ""),
                                      previous, now)
    if observed is not None or "prefill" in previous:
        # None: the pool is gone, the merge patch removes it
        status["prefill"] = observed[0] if observed is not None else None
    if gateway.condition is not None:
        status["conditions"].append(gateway.condition)
        status["gateway"] = gateway.status
    elif "gateway" in previous:
        status["gateway"] = None  # the pool is gone: the merge patch removes the stale block
    if spec.autoscaling is not None:
        outcome = await _autoscale(ctx, owner, PoolScaling(
            spec.autoscaling, desired, previous.get("autoscaler") or {},
            ANNOTATION_CAPACITY_REQUEST, "replicas"), body, replicas)
        status["autoscaler"] = outcome.status()
        decided = outcome.decision.replicas
        if decided != desired:
            await ctx.kube.apply(next(c for c in render_children(owner, spec, decided)
                                      if c["kind"] == "Deployment"
                                      and c["metadata"]["name"] == engine_name(owner)))
            status["desiredReplicas"] = decided
            status["ready"] = f"{status['readyReplicas']}/{decided}"
            if decided == 0:
                status["phase"] = "Idle"
    if observed is not None and "autoscaler" in (previous.get("prefill") or {}):
        observed[0]["autoscaler"] = None  # spec.prefill.autoscaling gone: clear its state
    if observed is not None and spec.prefill is not None \
            and spec.prefill.autoscaling is not None:
        pool_status, prefill_replicas = observed
        outcome = await _autoscale(ctx, owner, PoolScaling(
            spec.prefill.autoscaling, spec.prefill.replicas,
            ((previous.get("prefill") or {}).get("autoscaler") or {}),
            ANNOTATION_PREFILL_CAPACITY_REQUEST, "prefill replicas"), body, prefill_replicas)
        pool_status["autoscaler"] = outcome.status()
        decided = outcome.decision.replicas
        if decided != spec.prefill.replicas:
            resized = replace(spec, prefill=replace(spec.prefill, replicas=decided))
            await ctx.kube.apply(next(c for c in render_children(owner, resized, desired)
                                      if c["kind"] == "Deployment"
                                      and c["metadata"]["name"] == prefill_name(owner)))
            pool_status.update(desiredReplicas=decided,
                               ready=f"{pool_status['readyReplicas']}/{decided}",
                               phase=decide_phase(prefill_replicas, decided)[0])

    if previous.get("phase") != status["phase"]:
        level = "Warning" if status["phase"] in ("Degraded", "Failed") else "Normal"
        await _event(ctx, owner, level, f"Phase{status['phase']}",
                     f"{status['ready']} replicas ready; phase {previous.get('phase') or 'new'}"
                     f" -> {status['phase']}")
    if _changed(previous, status):
        await ctx.kube.merge_patch(ISVC, owner.namespace, owner.name, {"status": status},
                                   subresource="status")
    return status


def _changed(previous: dict[str, Any], status: dict[str, Any]) -> bool:
    return any(previous.get(k) != v for k, v in status.items())

