"""kopf wiring: a timer per InferenceService runs the reconcile round; spec changes run it at once.

Handlers are registered into a registry built at start-up (no import-time globals), with the
round interval chosen on the command line. kopf logs in with the same credentials as the
operator's own client (login.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import kopf
from shoal.operator.kube.api import API_ERRORS, ISVC, KubeApi
from shoal.operator.kube.credentials import Credentials, login_handler
from shoal.operator.loop import metrics as operator_metrics
from shoal.operator.loop.reconcile import ReconcileContext, reconcile
from shoal.operator.names import (
    ANNOTATION_CAPACITY_REQUEST,
    ANNOTATION_PREFILL_CAPACITY_REQUEST,
    ENGINE_METRICS_PORT,
    GROUP,
    PLURAL,
    VERSION,
)

log = logging.getLogger("shoal.operator")


@dataclass(frozen=True)
class OperatorOptions:
    credentials: Credentials
    interval: float = 5.0  # seconds between rounds per object
    engine_port: int = ENGINE_METRICS_PORT  # /ready and /metrics without the API key
    probe_timeout: float = 2.0
    metrics_port: int | None = None  # the operator's own /metrics; None: not served


def build_registry(options: OperatorOptions) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    state: dict[str, ReconcileContext] = {}

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # our own Events say what happened
        settings.watching.server_timeout = 300
        if options.metrics_port:
            operator_metrics.serve(options.metrics_port)
        state["ctx"] = ReconcileContext(
            kube=KubeApi(options.credentials),
            http=httpx.AsyncClient(timeout=options.probe_timeout),
            engine_port=options.engine_port, probe_timeout=options.probe_timeout)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        ctx = state.pop("ctx", None)
        if ctx is not None:
            await ctx.kube.close()
            await ctx.http.aclose()

    kopf.on.login(registry=registry)(login_handler(options.credentials))

    # One round at a time per object: the timer and a spec change must not interleave (double
    # Events, a status written from an older view).
    locks: dict[str, asyncio.Lock] = {}

    async def run_round(body: kopf.Body, why: str) -> None:
        ctx = state["ctx"]
        uid = str((body.get("metadata") or {}).get("uid") or id(body))
        try:
            async with locks.setdefault(uid, asyncio.Lock()):
                # Read the object afresh: kopf's copy may predate the previous round's status.
                meta = body.get("metadata") or {}
                namespace = meta.get("namespace") or "default"
                fresh = await ctx.kube.get(ISVC, namespace, meta["name"])
                if fresh is not None and not (fresh.get("metadata") or {}).get(
                        "deletionTimestamp"):
                    with operator_metrics.ROUND_SECONDS.time():
                        status = await reconcile(ctx, fresh)
                    operator_metrics.ROUNDS.labels("ok").inc()
                    operator_metrics.record_status(namespace, meta["name"], status)
        except (*API_ERRORS, httpx.HTTPError) as exc:
            operator_metrics.ROUNDS.labels("error").inc()
            # Transient API trouble: the next round retries from scratch (level-based).
            raise kopf.TemporaryError(f"{why}: {exc}", delay=options.interval) from exc

    @kopf.timer(GROUP, VERSION, PLURAL, interval=options.interval, registry=registry,
                errors=kopf.ErrorsMode.IGNORED)
    async def periodic(body: kopf.Body, **_: Any) -> None:
        await run_round(body, "periodic round")

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def on_change(body: kopf.Body, type: str | None, **_: Any) -> None:
        # Only spec changes (generation ahead of what status saw) and a router's new capacity
        # request need an immediate round; status-only updates (our own writes) wait.
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        if type == "DELETED" or meta.get("deletionTimestamp"):
            locks.pop(str(meta.get("uid")), None)
            operator_metrics.forget(meta.get("namespace") or "default", meta.get("name", ""))
            return  # children go with their owner (garbage collection); nothing to converge
        if meta.get("generation") != status.get("observedGeneration") or not status:
            await run_round(body, "spec change")
        elif _new_capacity_request(meta, status):
            await run_round(body, "capacity request")  # the router asks for an engine: now

    return registry



def _new_capacity_request(meta: dict[str, Any], status: dict[str, Any]) -> bool:
    """The router annotated a capacity request (either pool's) not acted on yet."""
    annotations = meta.get("annotations") or {}
    seen = ((status.get("autoscaler") or {}).get("capacityRequestSeen"),
            ((status.get("prefill") or {}).get("autoscaler") or {}).get("capacityRequestSeen"))
    return any(annotations.get(name) not in (None, last) for name, last in zip(
        (ANNOTATION_CAPACITY_REQUEST, ANNOTATION_PREFILL_CAPACITY_REQUEST), seen, strict=True))
