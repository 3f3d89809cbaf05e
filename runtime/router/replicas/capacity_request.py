"""The router's side of scale from zero: ask the operator for a replica.

The contract (docs/operations.md, "Scale to and from zero"): the router merge-patches the
annotation ``serving.shoal.dev/capacity-requested-at`` (an RFC 3339 UTC time) on its own
InferenceService with its service account (RBAC: ``patch`` on that one object). The operator
watches InferenceServices, sees the annotation newer than the last one it acted on, and
scales the engine Deployment from 0 to 1. An annotation, not a status field: status belongs
to the operator, and an annotation change reaches the operator's watch like any update.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import httpx
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery

log = logging.getLogger("shoal.router.capacity")

CAPACITY_ANNOTATION = "serving.shoal.dev/capacity-requested-at"
ISVC_PATH = "/apis/serving.shoal.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{name}"


def capacity_patch(now: datetime) -> dict[str, object]:
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"annotations": {CAPACITY_ANNOTATION: stamp}}}


class CapacityRequester:
    """PATCHes the annotation through the API server the discovery already talks to."""

    def __init__(self, discovery: KubernetesDiscovery, inference_service: str,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
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
                                          json=capacity_patch(datetime.now(UTC)))
            response.raise_for_status()
        self.sent += 1
        log.info("asked for capacity: %s", self.url)
