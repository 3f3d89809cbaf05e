"""The router's side of scale from zero: ask the operator for a replica.

The contract (docs/operations.md, "Scale to and from zero"): the router merge-patches the
annotation ``serving.shoal.dev/capacity-requested-at`` (an RFC 3339 UTC time) on its own
InferenceService with its service account (RBAC: ``patch`` on that one object). The operator
watches InferenceServices, sees the annotation newer than the last one it acted on, and
scales the engine Deployment from 0 to 1. An annotation, not a status field: status belongs
to the operator, and an annotation change reaches the operator's watch like any update.

The prefill pool (P/D, ``spec.prefill.autoscaling.minReplicas`` 0) has its own annotation,
``serving.shoal.dev/prefill-capacity-requested-at``: the router writes it when a prompt
wanted a prefill engine and none was ready (the decode engine computes that prompt itself;
nothing is held). ``CapacityAsker`` sends either at most once per interval, in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import httpx
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery

log = logging.getLogger("shoal.router.capacity")

CAPACITY_ANNOTATION = "serving.shoal.dev/capacity-requested-at"
PREFILL_CAPACITY_ANNOTATION = "serving.shoal.dev/prefill-capacity-requested-at"
ISVC_PATH = "/apis/serving.shoal.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{name}"


def capacity_patch(now: datetime, annotation: str = CAPACITY_ANNOTATION) -> dict[str, object]:
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"annotations": {annotation: stamp}}}


class CapacityRequester:
    """PATCHes the annotation through the API server the discovery already talks to."""

    def __init__(self, discovery: KubernetesDiscovery, inference_service: str,
                 transport: httpx.AsyncBaseTransport | None = None,
                 annotation: str = CAPACITY_ANNOTATION) -> None:
        self.annotation = annotation
        self.url = discovery.api_url + ISVC_PATH.format(namespace=discovery.namespace,
                                                        name=inference_service)
        self.headers = {**discovery.headers, "Content-Type": "application/merge-patch+json"}
        self.verify = discovery.verify
        self.transport = transport
        self.sent = 0

    async def __call__(self) -> None:
        async with httpx.AsyncClient(verify=self.verify, timeout=10.0,
                                     transport=self.transport) as client:
            response = await client.patch(self.url, headers=self.headers,
                                          json=capacity_patch(datetime.now(UTC), self.annotation))
            response.raise_for_status()
        self.sent += 1
        log.info("asked for capacity (%s): %s", self.annotation, self.url)


class CapacityAsker:
    """Sends a capacity request in the background, at most once per ``interval_s`` and one
    at a time; a failed one is logged and the next call may retry at once."""

    def __init__(self, send: Callable[[], Awaitable[None]], interval_s: float = 10.0) -> None:
        self.send = send
        self.interval_s = interval_s
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None

    def ask(self) -> None:
        if self._task is not None and not self._task.done():
            return
        now = time.monotonic()
        if self._last and now - self._last < self.interval_s:
            return
        self._last = now
        self._task = asyncio.create_task(self._send_once(), name="capacity request")

    async def _send_once(self) -> None:
        try:
            await self.send()
        except Exception as exc:  # noqa: BLE001 (logged; the next ask retries)
            log.warning("capacity request failed: %r", exc)
            self._last = 0.0
