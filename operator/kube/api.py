"""The operator's API calls, through kubernetes_asyncio's generated client, on plain dicts.

Children are written with server-side apply (PATCH application/apply-patch+yaml, one field
manager, force): applying the same rendered object twice is a no-op, and fields the operator
stops rendering are removed, so reconciliation is idempotent by construction.

Each (apiVersion, kind) maps to the generated API class and method the client library names for
it (`AppsV1Api.patch_namespaced_deployment`, ...); custom resources go through
`CustomObjectsApi`. Responses are read as JSON, not deserialized into models: the operator's
pure functions work on the objects as the API server sends them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient, ApiException
from shoal.operator.kube.credentials import Credentials
from shoal.operator.names import API_VERSION, FIELD_MANAGER, KIND, PLURAL

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"  # pod conditions merge by type

# What a failed call raises: an error status, a connection failure, a timeout.
API_ERRORS = (ApiException, aiohttp.ClientError, TimeoutError)


@dataclass(frozen=True)
class Resource:
    api_version: str
    kind: str


POD = Resource("v1", "Pod")
EVENT = Resource("v1", "Event")
ISVC = Resource(API_VERSION, KIND)

# Custom resources: plural names (built-in kinds have generated methods instead).
CUSTOM_PLURALS: dict[Resource, str] = {
    ISVC: PLURAL,
    Resource("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    Resource("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    Resource("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
}


def resource_of(obj: dict[str, Any]) -> Resource:
    return Resource(obj["apiVersion"], obj["kind"])


def _api_class_name(api_version: str) -> str:
    """`apps/v1` -> AppsV1Api, `rbac.authorization.k8s.io/v1` -> RbacAuthorizationV1Api."""
    group, _, version = api_version.rpartition("/")
    group = (group or "core").removesuffix(".k8s.io")
    return "".join(word.capitalize() for word in group.split(".")) + version.capitalize() + "Api"


def _snake(kind: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()


class KubeApi:
    def __init__(self, credentials: Credentials, timeout: float = 10.0) -> None:
        self.credentials = credentials
        self.api_client = ApiClient(credentials.configuration)
        self.timeout = timeout

    async def close(self) -> None:
        await self.api_client.close()

    def _method(self, resource: Resource, verb: str, subresource: str | None = None
                ) -> tuple[Callable[..., Awaitable[Any]], dict[str, str]]:
        """The generated method for `verb` on `resource`, and the arguments it takes besides
        name/namespace/body (group, version, plural for custom objects)."""
        suffix = f"_{subresource}" if subresource else ""
        if resource in CUSTOM_PLURALS:
            group, _, version = resource.api_version.rpartition("/")
            api = client.CustomObjectsApi(self.api_client)
            verb = "get" if verb == "read" else verb  # CustomObjectsApi's name for it
            return getattr(api, f"{verb}_namespaced_custom_object{suffix}"), {
                "group": group, "version": version, "plural": CUSTOM_PLURALS[resource]}
        api_class = getattr(client, _api_class_name(resource.api_version), None)
        if api_class is None:
            raise ValueError(f"the operator does not manage {resource.kind} "
                             f"({resource.api_version})")
        api = api_class(self.api_client)
        return getattr(api, f"{verb}_namespaced_{_snake(resource.kind)}{suffix}"), {}

    async def _call(self, method: Callable[..., Awaitable[Any]], **kwargs: Any
                    ) -> dict[str, Any]:
        """One call; a 401 refreshes the credentials (rotated or revoked token) and retries."""
        for attempt in (1, 2):
            response = await method(_preload_content=False,
                                    _request_timeout=self.timeout, **kwargs)
            try:
                raw = await response.read()
            finally:
                response.release()
            if response.status == 401 and attempt == 1:
                await self.credentials.refresh(force=True)
                continue
            if response.status >= 400:
                error = ApiException(status=response.status, reason=response.reason)
                error.body = raw.decode(errors="replace")[:1000]
                raise error
            break
        result: dict[str, Any] = json.loads(raw) if raw else {}
        return result

    async def served_resources(self, group_version: str) -> set[str] | None:
        """Discovery: the resource names the API server serves in a group/version (None
        when it serves none, e.g. the CRDs are not installed)."""
        group, _, version = group_version.rpartition("/")
        api = client.CustomObjectsApi(self.api_client)
        try:
            listing = await self._call(api.get_api_resources, group=group, version=version)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {str(r.get("name")) for r in listing.get("resources") or []}

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        method, extra = self._method(resource, "read")
        try:
            return await self._call(method, name=name, namespace=namespace, **extra)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, resource: Resource, namespace: str,
                   labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        method, extra = self._method(resource, "list")
        selector = ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))
        if selector:
            extra["label_selector"] = selector
        result = await self._call(method, namespace=namespace, **extra)
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        method, extra = self._method(resource_of(obj), "create")
        return await self._call(method, namespace=obj["metadata"]["namespace"], body=obj, **extra)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates the object or brings the fields we own to `obj`."""
        method, extra = self._method(resource_of(obj), "patch")
        meta = obj["metadata"]
        return await self._call(method, name=meta["name"], namespace=meta["namespace"], body=obj,
                                field_manager=FIELD_MANAGER, force=True, _content_type=APPLY,
                                **extra)

    async def merge_patch(self, resource: Resource, namespace: str, name: str,
                          patch: dict[str, Any], subresource: str | None = None
                          ) -> dict[str, Any]:
        method, extra = self._method(resource, "patch", subresource)
        return await self._call(method, name=name, namespace=namespace, body=patch,
                                _content_type=MERGE, **extra)

    async def strategic_patch(self, resource: Resource, namespace: str, name: str,
                              patch: dict[str, Any], subresource: str | None = None
                              ) -> dict[str, Any]:
        method, extra = self._method(resource, "patch", subresource)
        return await self._call(method, name=name, namespace=namespace, body=patch,
                                _content_type=STRATEGIC, **extra)

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        method, extra = self._method(resource, "delete")
        try:
            await self._call(method, name=name, namespace=namespace, **extra)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
