"""Pruning: delete the children this InferenceService owns that its spec no longer renders.

Server-side apply removes fields the operator stops rendering, but not whole objects: turning
the gateway block off, switching endpointPicker from shoal to external, or turning routing off
would leave the InferencePool, HTTPRoute, picker or router behind until the service is deleted.
Each round therefore lists the service's children (by its labels) in the kinds that can come and
go, and deletes those not in the desired set, matched by kind + name.

Ownership is proved, never assumed: a child is pruned only when it carries both the operator's
labels for this service and a controller owner reference to this service's uid, so an object
someone else made with the same name or labels is left alone. Kinds whose CRD the cluster does
not serve (InferencePool, HTTPRoute, ServiceMonitor) are not listed at all. The PVC of the
model cache is never pruned (it holds downloaded weights). The decision is `stale_children`
(pure); `prune_children` is the I/O around it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from shoal.operator.kube.api import CUSTOM_PLURALS, Resource
from shoal.operator.names import (
    API_VERSION,
    KIND,
    LABEL_MANAGED_BY,
    LABEL_SERVICE,
    MANAGER,
    Owner,
)

# Kinds a spec change can make disappear (the engine's children are always rendered).
PRUNABLE: tuple[Resource, ...] = (
    Resource("apps/v1", "Deployment"),  # router, endpoint picker
    Resource("v1", "Service"),  # endpoint picker
    Resource("v1", "ServiceAccount"),
    Resource("rbac.authorization.k8s.io/v1", "Role"),
    Resource("rbac.authorization.k8s.io/v1", "RoleBinding"),
    Resource("inference.networking.k8s.io/v1", "InferencePool"),
    Resource("gateway.networking.k8s.io/v1", "HTTPRoute"),
    Resource("monitoring.coreos.com/v1", "ServiceMonitor"),
)


class PruneApi(Protocol):
    async def served_resources(self, group_version: str) -> set[str] | None: ...

    async def list(self, resource: Resource, namespace: str,
                   labels: dict[str, str] | None = None) -> list[dict[str, Any]]: ...

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool: ...


def owned_labels(owner: Owner) -> dict[str, str]:
    """The label selector every child of this service matches."""
    return {LABEL_SERVICE: owner.name, LABEL_MANAGED_BY: MANAGER}


def is_owned(owner: Owner, obj: dict[str, Any]) -> bool:
    """Both the labels and a controller reference to this very object (uid): a same-named
    service deleted and re-created, or an object copied by hand, is not ours."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in owned_labels(owner).items()):
        return False
    return bool(owner.uid) and any(
        ref.get("uid") == owner.uid and ref.get("kind") == KIND
        and ref.get("apiVersion") == API_VERSION and ref.get("controller")
        for ref in meta.get("ownerReferences") or [])


def stale_children(owner: Owner, desired: Iterable[dict[str, Any]],
                   observed: Iterable[tuple[Resource, dict[str, Any]]]
                   ) -> list[tuple[Resource, str]]:
    """Pure: (kind, name) of each observed child this service owns that `desired` lacks.

    `observed` pairs each object with the resource it was listed as (list items need not
    carry their kind)."""
    wanted = {(child["kind"], child["metadata"]["name"]) for child in desired}
    stale = []
    for resource, obj in observed:
        name = (obj.get("metadata") or {}).get("name")
        if (name and (resource.kind, name) not in wanted and is_owned(owner, obj)
                and not (obj.get("metadata") or {}).get("deletionTimestamp")):
            stale.append((resource, str(name)))
    return sorted(stale, key=lambda item: (item[0].kind, item[1]))


async def served_prunable(kube: PruneApi) -> list[Resource]:
    """PRUNABLE minus the custom kinds the API server does not serve (discovery)."""
    served: list[Resource] = []
    listings: dict[str, set[str] | None] = {}
    for resource in PRUNABLE:
        plural = CUSTOM_PLURALS.get(resource)
        if plural is not None:
            if resource.api_version not in listings:
                listings[resource.api_version] = await kube.served_resources(
                    resource.api_version)
            if plural not in (listings[resource.api_version] or set()):
                continue
        served.append(resource)
    return served


async def prune_children(kube: PruneApi, owner: Owner, desired: list[dict[str, Any]]
                         ) -> list[tuple[Resource, str]]:
    """List, decide, delete; returns what was deleted (a 404 means someone was faster)."""
    if not owner.uid:
        return []
    observed: list[tuple[Resource, dict[str, Any]]] = []
    for resource in await served_prunable(kube):
        observed += [(resource, obj) for obj in
                     await kube.list(resource, owner.namespace, owned_labels(owner))]
    deleted = []
    for resource, name in stale_children(owner, desired, observed):
        if await kube.delete(resource, owner.namespace, name):
            deleted.append((resource, name))
    return deleted
