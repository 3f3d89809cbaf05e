"""One reconcile round against an in-memory API (the I/O edge, without HTTP)."""

from __future__ import annotations

from typing import Any

import httpx
from shoal.operator.kube_api import Resource, resource_of
from shoal.operator.reconcile import ReconcileContext, reconcile


class MemoryApi:
    """Records what a round writes; serves lists from what it holds."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.patches: list[tuple[str, str, dict[str, Any], str | None]] = []
        self.events: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.objects[(resource_of(obj).kind, obj["metadata"]["name"])] = obj
        return obj

    async def list(self, resource: Resource, namespace: str | None,
                   labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return []

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((resource.kind, name))

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.events.append(obj)
        return obj

    async def merge_patch(self, resource: Resource, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        self.patches.append((resource.kind, name, patch, subresource))
        return patch

    async def strategic_patch(self, resource: Resource, namespace: str, name: str,
                              patch: dict[str, Any], subresource: str | None = None
                              ) -> dict[str, Any]:
        return await self.merge_patch(resource, namespace, name, patch, subresource)

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        self.deleted.append((resource.kind, name))
        return False


def service(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "m", "namespace": "ml", "uid": "u1", "generation": 4},
            "spec": spec, "status": status or {}}


async def test_a_first_round_creates_every_child_and_reports_pending() -> None:
    api = MemoryApi()
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        status = await reconcile(ctx, service({"model": {"uri": "hf://org/m"}, "replicas": 2}))
    assert sorted(api.objects) == [
        ("Deployment", "m-engine"), ("Deployment", "m-router"),
        ("PodDisruptionBudget", "m-engine"), ("Role", "m-router"),
        ("RoleBinding", "m-router"), ("Service", "m"), ("Service", "m-engine"),
        ("ServiceAccount", "m-router")]
    assert (status["phase"], status["ready"], status["observedGeneration"]) == ("Pending", "0/2", 4)
    (written,) = [p for p in api.patches if p[3] == "status"]
    assert written[2]["status"]["phase"] == "Pending"
    assert [e["reason"] for e in api.events] == ["PhasePending"]


async def test_an_unchanged_status_is_not_written_again() -> None:
    api = MemoryApi()
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        first = await reconcile(ctx, service({"model": {"uri": "hf://org/m"}}))
        api.patches.clear()
        await reconcile(ctx, service({"model": {"uri": "hf://org/m"}}, status=first))
    assert api.patches == []


async def test_routing_off_removes_the_router() -> None:
    api = MemoryApi()
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        await reconcile(ctx, service({"model": {"uri": "hf://org/m"},
                                      "routing": {"enabled": False}}))
    assert ("Deployment", "m-router") not in api.objects
    assert sorted(api.deleted) == [("Deployment", "m-router"), ("Role", "m-router"),
                                   ("RoleBinding", "m-router"), ("ServiceAccount", "m-router")]


async def test_an_invalid_spec_is_reported_not_acted_on() -> None:
    api = MemoryApi()
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        status = await reconcile(ctx, service({"model": {"uri": "ftp://x"}}))
    assert api.objects == {}
    assert status["phase"] == "Failed"
    assert status["conditions"][0]["reason"] == "InvalidSpec"
    assert "spec.model.uri" in status["conditions"][0]["message"]
    assert [e["reason"] for e in api.events] == ["InvalidSpec"]
