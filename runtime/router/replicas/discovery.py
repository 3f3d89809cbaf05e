"""Where the replicas are: a static list, or the engine Service's EndpointSlices (for P/D's
prefill pool, both: ``PrefillDiscovery``).

Kubernetes discovery lists the EndpointSlices labelled ``kubernetes.io/service-name=<svc>``
and then watches them, so pods that become ready (or go away) enter (or leave) the replica
set within a watch event; a broken watch is re-listed after a short backoff. It talks to
the API server with the pod's service-account token, over plain httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("shoal.router.discovery")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def slice_urls(endpoint_slice: dict[str, Any], service: str, port: int | None) -> set[str]:
    """Replica URLs of one EndpointSlice: ready endpoints only, on ``port`` or the slice's
    port named ``http`` (else its first port)."""
    labels = endpoint_slice.get("metadata", {}).get("labels") or {}
    if labels.get(SERVICE_NAME_LABEL) != service:
        return set()
    if port is None:
        ports = endpoint_slice.get("ports") or []
        named = [p for p in ports if p.get("name") == "http"] or ports
        if not named or named[0].get("port") is None:
            return set()
        port = int(named[0]["port"])
    urls = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.add(f"http://{host}:{port}")
    return urls


class StaticDiscovery:
    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = list(urls)
        if not self.urls:
            raise ValueError("static discovery needs at least one --backend URL")

    async def run(self, publish: Callable[[set[str]], None]) -> None:
        publish(set(self.urls))


class KubernetesDiscovery:
    def __init__(self, namespace: str, service: str, engine_port: int | None,
                 api_url: str | None = None, token: str | None = None,
                 verify: bool | str = True, backoff_s: float = 2.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not service:
            raise ValueError("kubernetes discovery needs --service")
        self.namespace = namespace
        self.service = service
        self.engine_port = engine_port
        self.backoff_s = backoff_s
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("not running in a cluster (KUBERNETES_SERVICE_HOST unset); "
                                 "pass --kube-api URL")
            api_url = f"https://{host}:{port}"
            token = token or (SA_DIR / "token").read_text().strip()
            ca = SA_DIR / "ca.crt"
            verify = str(ca) if ca.exists() else verify
        self.api_url = api_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.verify = verify
        self.slices: dict[str, set[str]] = {}
        self._transport = transport

    @property
    def _path(self) -> str:
        return f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def _params(self) -> dict[str, str]:
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}"}

    def current(self) -> set[str]:
        return set().union(*self.slices.values()) if self.slices else set()

    def apply_event(self, event: dict[str, Any]) -> bool:
        """Apply one watch event; True when the replica set may have changed."""
        kind, obj = event.get("type"), event.get("object") or {}
        name = obj.get("metadata", {}).get("name")
        if kind == "ERROR" or not name:
            raise RuntimeError(f"watch error: {obj}")
        if kind == "DELETED":
            return self.slices.pop(name, None) is not None
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = slice_urls(obj, self.service, self.engine_port)
            return True
        return False

    async def run(self, publish: Callable[[set[str]], None]) -> None:
        async with httpx.AsyncClient(headers=self.headers, verify=self.verify,
                                     timeout=httpx.Timeout(10.0, read=None),
                                     transport=self._transport) as client:
            while True:
                try:
                    listing = await client.get(self._path, params=self._params())
                    listing.raise_for_status()
                    body = listing.json()
                    self.slices = {
                        item["metadata"]["name"]: slice_urls(item, self.service, self.engine_port)
                        for item in body.get("items") or []}
                    publish(self.current())
                    version = (body.get("metadata") or {}).get("resourceVersion")
                    params = {**self._params(), "watch": "true"}
                    if version:
                        params["resourceVersion"] = version
                    async with client.stream("GET", self._path, params=params) as watch:
                        watch.raise_for_status()
                        async for line in watch.aiter_lines():
                            if line.strip() and self.apply_event(json.loads(line)):
                                publish(self.current())
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                    log.warning("endpointslice watch for %s/%s failed: %r; relisting",
                                self.namespace, self.service, exc)
                await asyncio.sleep(self.backoff_s)


class PrefillDiscovery:
    """P/D's prefill replicas: the fixed ``--prefill-backend`` URLs plus, with
    ``--prefill-service``, the ready endpoints of that Service, each pod by its own IP (what
    llm-d's picker names, and what lets the router weigh each prefill pod's load; a pool
    scaled to zero has none)."""

    def __init__(self, urls: Iterable[str], service: KubernetesDiscovery | None) -> None:
        self.urls = set(urls)
        self.service = service

    async def run(self, publish: Callable[[set[str]], None]) -> None:
        publish(set(self.urls))
        if self.service is not None:
            await self.service.run(lambda pods: publish(self.urls | pods))
