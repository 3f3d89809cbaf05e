"""One engine pod's state, from its Pod object and what its /ready and /metrics said (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shoal.operator.names import (
    ANNOTATION_TEMPLATE_HASH,
    ENGINE_CONTAINER,
    ENGINE_READY_CONDITION,
    FETCH_CONTAINER,
)

from shoal.contract.metrics import EngineMetrics

CRASHLOOP_RESTARTS = 3
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")


@dataclass(frozen=True)
class ProbeResult:
    """What the operator got from the pod over HTTP this round."""

    ready_status: int | None  # HTTP status of GET /ready; None: unreachable
    ready_body: dict[str, Any] | None = None
    metrics: EngineMetrics | None = None


@dataclass(frozen=True)
class Failure:
    reason: str  # RankFailure, CrashLoop, StartupTimeout, ImagePullFailure, Unschedulable, ...
    message: str


@dataclass(frozen=True)
class ReplicaState:
    name: str
    pod_ip: str | None
    ready: bool  # the value the readiness gate should have
    phase: str  # startup phase from /ready, or pending / unreachable / terminating
    restarts: int
    failure: Failure | None
    metrics: EngineMetrics | None
    template_hash: str | None
    started_at: datetime | None
    adapters: tuple[str, ...] | None = None  # LoRA adapters it serves (spec.adapters set)


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def engine_container_status(pod: dict[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == ENGINE_CONTAINER:
            return status
    return {}


def gate_status(pod: dict[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ENGINE_READY_CONDITION:
            return cond.get("status") == "True"
    return False


def _failure(pod: dict[str, Any], probe: ProbeResult | None, now: datetime,
             startup_timeout_s: int) -> Failure | None:
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return Failure("Unschedulable", cond.get("message") or "no node fits the pod")
    container = engine_container_status(pod)
    waiting = (container.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in IMAGE_PULL_REASONS:
        return Failure("ImagePullFailure", waiting.get("message") or waiting["reason"])
    restarts = int(container.get("restartCount") or 0)
    last = (container.get("lastState") or {}).get("terminated") or {}
    healthy_now = probe is not None and probe.ready_status == 200
    if waiting.get("reason") == "CrashLoopBackOff" or (
        restarts >= CRASHLOOP_RESTARTS and not healthy_now
    ):
        return Failure("CrashLoop", f"restarted {restarts} times; last exit: "
                       f"{_describe_exit(last)}")
    if last and not healthy_now:
        # The engine exits non-zero when a rank dies (or hangs); the kubelet restarts it.
        message = last.get("message") or ""
        reason = "OOMKilled" if last.get("reason") == "OOMKilled" else "RankFailure"
        return Failure(reason, f"engine exited: {_describe_exit(last)} {message}".strip())
    started = parse_time(status.get("startTime"))
    if not healthy_now and started is not None and \
            (now - started).total_seconds() > startup_timeout_s and not gate_status(pod):
        return Failure("StartupTimeout",
                       f"not ready {int((now - started).total_seconds())}s after start "
                       f"(budget {startup_timeout_s}s)")
    if probe is not None and probe.ready_status is None and container.get("ready") is not False \
            and gate_status(pod):
        return Failure("EngineUnreachable", "/ready did not answer")
    body = (probe.ready_body or {}) if probe is not None else {}
    if body.get("status") == "failed" or body.get("phase") in ("failed", "dead"):
        # The engine is up but its core is gone or hung: it is about to exit non-zero.
        return Failure("RankFailure", f"engine reports {body.get('phase') or body['status']}")
    return None


def _describe_exit(terminated: dict[str, Any]) -> str:
    if not terminated:
        return "none"
    return f"code {terminated.get('exitCode')} ({terminated.get('reason') or 'Error'})"


def observe_replica(pod: dict[str, Any], probe: ProbeResult | None, now: datetime,
                    startup_timeout_s: int) -> ReplicaState:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    container = engine_container_status(pod)
    ready = bool(probe is not None and probe.ready_status == 200)
    if meta.get("deletionTimestamp"):
        phase, ready = "terminating", False
    elif probe is None:
        phase = "downloading" if _fetching_weights(pod) else "pending"
    elif probe.ready_status is None:
        phase = "unreachable"
    else:
        body = probe.ready_body or {}
        phase = str(body.get("phase") or ("ready" if ready else "starting"))
    return ReplicaState(
        name=meta.get("name", ""),
        pod_ip=status.get("podIP"),
        ready=ready,
        phase=phase,
        restarts=int(container.get("restartCount") or 0),
        failure=None if ready else _failure(pod, probe, now, startup_timeout_s),
        metrics=probe.metrics if probe is not None and ready else None,
        template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
        started_at=parse_time(status.get("startTime")),
    )


def _fetching_weights(pod: dict[str, Any]) -> bool:
    """The fetch-weights init container is running: the replica is downloading its model."""
    for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if status.get("name") == FETCH_CONTAINER and "running" in (status.get("state") or {}):
            return True
    return False


def probe_target(pod: dict[str, Any]) -> str | None:
    """The pod's IP when it can be probed: running and not being deleted."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    if status.get("phase") != "Running" or not status.get("podIP"):
        return None
    return str(status["podIP"])
