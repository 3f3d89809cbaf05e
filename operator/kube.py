"""A small async Kubernetes API client: the few verbs the operator needs, over httpx.

Children are written with server-side apply (PATCH application/apply-patch+yaml, one field
manager, force): applying the same rendered object twice is a no-op, and fields the operator
stops rendering are removed, so reconciliation is idempotent by construction.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import httpx
from shoal.operator.constants import FIELD_MANAGER
from shoal.operator.kubeconfig import ClusterAccess


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [root]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


KINDS: dict[tuple[str, str], Kind] = {
    ("v1", "Pod"): Kind("v1", "pods"),
    ("v1", "Service"): Kind("v1", "services"),
    ("v1", "ServiceAccount"): Kind("v1", "serviceaccounts"),
    ("v1", "PersistentVolumeClaim"): Kind("v1", "persistentvolumeclaims"),
    ("v1", "Event"): Kind("v1", "events"),
    ("apps/v1", "Deployment"): Kind("apps/v1", "deployments"),
    ("policy/v1", "PodDisruptionBudget"): Kind("policy/v1", "poddisruptionbudgets"),
    ("rbac.authorization.k8s.io/v1", "Role"): Kind("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"):
        Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        Kind("monitoring.coreos.com/v1", "servicemonitors"),
    ("serving.shoal.dev/v1alpha1", "InferenceService"):
        Kind("serving.shoal.dev/v1alpha1", "inferenceservices"),
}


def kind_of(obj: dict[str, Any]) -> Kind:
    key = (obj["apiVersion"], obj["kind"])
    if key not in KINDS:
        raise ValueError(f"the operator does not manage {key[1]} ({key[0]})")
    return KINDS[key]


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {body[:300]}")
        self.status = status


class KubeClient:
    def __init__(self, access: ClusterAccess, timeout: float = 10.0) -> None:
        verify: ssl.SSLContext | bool = True
        if access.insecure:
            verify = False
        elif access.ca_path:
            verify = ssl.create_default_context(cafile=access.ca_path)
        if access.cert_path and access.key_path and isinstance(verify, ssl.SSLContext):
            verify.load_cert_chain(access.cert_path, access.key_path)
        headers = {"Authorization": f"Bearer {access.token}"} if access.token else {}
        self._http = httpx.AsyncClient(base_url=access.server, verify=verify, headers=headers,
                                       timeout=timeout)

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, *, params: dict[str, str] | None = None,
                    json: Any = None, content_type: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": content_type} if content_type else None
        response = await self._http.request(method, path, params=params, json=json,
                                            headers=headers)
        if response.status_code >= 400:
            raise ApiError(response.status_code, method, path, response.text)
        return response.json() if response.content else {}

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", kind.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str | None,
                   labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        params = {}
        if labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        result = await self._call("GET", kind.path(namespace), params=params)
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        return await self._call("POST", kind.path(obj["metadata"].get("namespace")), json=obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates the object or brings the fields we own to `obj`."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        return await self._call(
            "PATCH", kind.path(meta.get("namespace"), meta["name"]),
            params={"fieldManager": FIELD_MANAGER, "force": "true"}, json=obj,
            content_type="application/apply-patch+yaml",
        )

    async def merge_patch(self, kind: Kind, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        return await self._call("PATCH", kind.path(namespace, name, subresource), json=patch,
                                content_type="application/merge-patch+json")

    async def strategic_patch(self, kind: Kind, namespace: str, name: str,
                              patch: dict[str, Any], subresource: str | None = None
                              ) -> dict[str, Any]:
        """Strategic merge: pod conditions merge by type instead of replacing the list."""
        return await self._call("PATCH", kind.path(namespace, name, subresource), json=patch,
                                content_type="application/strategic-merge-patch+json")

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        try:
            await self._call("DELETE", kind.path(namespace, name))
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
