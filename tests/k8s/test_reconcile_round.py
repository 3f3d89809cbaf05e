"""One reconcile round against an in-memory API (the I/O edge, without HTTP)."""

from __future__ import annotations

from typing import Any

import httpx
from shoal.operator.kube.api import Resource, resource_of
from shoal.operator.loop.reconcile import ReconcileContext, reconcile


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
        return [obj for (kind, _), obj in self.objects.items() if kind == resource.kind
                and (labels or {}).items() <= (obj["metadata"].get("labels") or {}).items()]

    async def served_resources(self, group_version: str) -> set[str] | None:
        return None  # no Gateway API, no Prometheus Operator CRDs in this cluster

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
        return self.objects.pop((resource.kind, name), None) is not None


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


async def test_routing_off_prunes_the_router_and_only_what_the_service_owns() -> None:
    api = MemoryApi()
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        await reconcile(ctx, service({"model": {"uri": "hf://org/m"}}))
        assert ("Deployment", "m-router") in api.objects
        # same labels, but made by someone else (no owner reference): never ours to delete
        stranger = {**api.objects[("Deployment", "m-router")]}
        stranger["metadata"] = {**stranger["metadata"], "name": "m-other",
                                "ownerReferences": []}
        api.objects[("Deployment", "m-other")] = stranger
        await reconcile(ctx, service({"model": {"uri": "hf://org/m"},
                                      "routing": {"enabled": False}}))
    assert sorted(api.deleted) == [("Deployment", "m-router"), ("Role", "m-router"),
                                   ("RoleBinding", "m-router"), ("ServiceAccount", "m-router")]
    assert ("Deployment", "m-other") in api.objects and ("Deployment", "m-engine") in api.objects
    assert [e["message"] for e in api.events if e["reason"] == "Pruned"] == [
        "deleted, no longer rendered by the spec: Deployment/m-router, Role/m-router, "
        "RoleBinding/m-router, ServiceAccount/m-router"]


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


def prefill_pod(name: str, template: dict[str, Any]) -> dict[str, Any]:
    """A pod of the prefill Deployment's template, scheduled but not yet running."""
    return {"metadata": {"name": name, "namespace": "ml", "labels": template["metadata"]["labels"],
                         "annotations": template["metadata"]["annotations"]},
            "spec": template["spec"], "status": {"phase": "Pending"}}


async def test_a_prefill_pool_is_rendered_reported_and_pruned_when_removed() -> None:
    api = MemoryApi()
    pd = {"model": {"uri": "hf://org/m"}, "replicas": 2, "prefill": {"replicas": 1}}
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        first = await reconcile(ctx, service(pd))
        assert {("Deployment", "m-prefill"), ("Service", "m-prefill"),
                ("Deployment", "m-engine")} <= set(api.objects)
        router = api.objects[("Deployment", "m-router")]["spec"]["template"]["spec"]
        args = router["containers"][0]["args"]
        assert args[args.index("--prefill-service") + 1] == "m-prefill"
        assert (first["ready"], first["prefill"]["ready"]) == ("0/2", "0/1")
        # a prefill pod shows up in the prefill block only, never among the decode replicas
        template = api.objects[("Deployment", "m-prefill")]["spec"]["template"]
        api.objects[("Pod", "m-prefill-a")] = prefill_pod("m-prefill-a", template)
        second = await reconcile(ctx, service(pd, status=first))
        assert [r["name"] for r in second["prefill"]["replicaStatus"]] == ["m-prefill-a"]
        assert (second["prefill"]["replicas"], second["prefill"]["updatedReplicas"]) == (1, 1)
        assert second["replicas"] == 0 and second["replicaStatus"] == []
        assert second["prefill"]["phase"] == "Pending"

        del pd["prefill"]
        api.deleted.clear()
        third = await reconcile(ctx, service(pd, status=second))
    assert sorted(api.deleted) == [("Deployment", "m-prefill"), ("Service", "m-prefill")]
    assert third["prefill"] is None  # the merge patch removes the block
    engine = api.objects[("Deployment", "m-engine")]["spec"]["template"]["spec"]
    assert "--kv-transfer-config" not in engine["containers"][0]["args"]


async def test_the_prefill_autoscaler_scales_its_own_pool_on_the_routers_request() -> None:
    """spec.prefill.autoscaling with minReplicas 0: the pool starts at 0 (phase Idle), and a
    prefill capacity request from the router brings it to 1 (spec.prefill.replicas and the
    Deployment), leaving the decode pool alone."""
    api = MemoryApi()
    pd = {"model": {"uri": "hf://org/m"}, "replicas": 2,
          "prefill": {"autoscaling": {"minReplicas": 0, "maxReplicas": 3}}}
    async with httpx.AsyncClient() as http:
        ctx = ReconcileContext(kube=api, http=http)  # type: ignore[arg-type]
        first = await reconcile(ctx, service(pd))
        assert api.objects[("Deployment", "m-prefill")]["spec"]["replicas"] == 0
        assert (first["prefill"]["ready"], first["prefill"]["phase"]) == ("0/0", "Idle")
        assert first["phase"] == "Pending" and first["ready"] == "0/2"
        body = service(pd, status=first)
        stamp = "2026-12-07T04:00:00.000000Z"
        body["metadata"]["annotations"] = {"serving.shoal.dev/prefill-capacity-requested-at":
                                           stamp}
        api.patches.clear()
        second = await reconcile(ctx, body)
        assert {"spec": {"prefill": {"replicas": 1}}} in [p[2] for p in api.patches]
        assert api.objects[("Deployment", "m-prefill")]["spec"]["replicas"] == 1
        assert api.objects[("Deployment", "m-engine")]["spec"]["replicas"] == 2
        assert second["prefill"]["ready"] == "0/1"
        assert second["prefill"]["autoscaler"]["capacityRequestSeen"] == stamp
        scaled = [e["message"] for e in api.events if e["reason"] == "Scaled"]
        assert scaled == ["prefill replicas 0 -> 1: the router asked for a replica"]
        # the same annotation again is not a new request: the pool stays where the spec says
        pd["prefill"]["replicas"] = 1
        again = service(pd, status=second)
        again["metadata"]["annotations"] = body["metadata"]["annotations"]
        api.events.clear()
        await reconcile(ctx, again)
        assert not [e for e in api.events if e["reason"] == "Scaled"]
