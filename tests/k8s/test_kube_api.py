"""The operator's client (kubernetes_asyncio's generated API) against the emulator: every kind
the operator renders is applied, read, listed and deleted on the path the API server serves."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiException
from shoal.operator.kube.api import ISVC, POD, KubeApi, Resource, _api_class_name, _snake
from shoal.operator.kube.credentials import load_credentials
from shoal.operator.names import Owner
from shoal.operator.render.children import render_children
from shoal.operator.spec.service import parse_spec

NS = "serving"


@pytest.mark.parametrize(("api_version", "kind", "api_class", "snake"), [
    ("v1", "Pod", "CoreV1Api", "pod"),
    ("apps/v1", "Deployment", "AppsV1Api", "deployment"),
    ("policy/v1", "PodDisruptionBudget", "PolicyV1Api", "pod_disruption_budget"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "RbacAuthorizationV1Api", "role_binding"),
    ("v1", "PersistentVolumeClaim", "CoreV1Api", "persistent_volume_claim"),
])
def test_generated_api_names(api_version: str, kind: str, api_class: str, snake: str) -> None:
    assert (_api_class_name(api_version), _snake(kind)) == (api_class, snake)


async def test_every_child_kind_round_trips_through_the_client(
        apiserver: SimpleNamespace) -> None:
    api = apiserver.api
    isvc = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "m", "namespace": NS},
            "spec": {"model": {"uri": "hf://org/m"}, "replicas": 2,
                     "storage": {"size": "10Gi"}, "monitoring": {"serviceMonitor": True}}}
    (await api.post(f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/inferenceservices",
                    json=isvc)).raise_for_status()
    kube = KubeApi(await load_credentials(server=apiserver.url))
    try:
        body = await kube.get(ISVC, NS, "m")
        assert body is not None and body["metadata"]["uid"]
        children = render_children(Owner.from_body(body), parse_spec(body["spec"]), 2)
        kinds = {c["kind"] for c in children}
        assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role",
                "RoleBinding", "PersistentVolumeClaim", "ServiceMonitor"} <= kinds
        for child in children:
            await kube.apply(child)
            await kube.apply(child)  # idempotent: the same object again
        for child in children:
            stored = await kube.get(Resource(child["apiVersion"], child["kind"]), NS,
                                    child["metadata"]["name"])
            assert stored is not None, child["kind"]
            content = {k: v for k, v in child.items() if k != "metadata"}
            assert {k: stored.get(k) for k in content} == content, child["kind"]
            assert stored["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]

        # Status through the subresource; spec through the object (merge patches).
        await kube.merge_patch(ISVC, NS, "m", {"status": {"phase": "Pending"}}, "status")
        await kube.merge_patch(ISVC, NS, "m", {"spec": {"replicas": 3}})
        body = await kube.get(ISVC, NS, "m")
        assert body is not None and body["status"]["phase"] == "Pending"
        assert body["spec"]["replicas"] == 3 and body["metadata"]["generation"] == 2

        # Pods: listed by label, their conditions merged by type (strategic merge).
        for name, component in (("p1", "engine"), ("p2", "router")):
            (await api.post(f"/api/v1/namespaces/{NS}/pods", json={
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NS, "labels": {"c": component}},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
             ).raise_for_status()
        assert [p["metadata"]["name"] for p in await kube.list(POD, NS, {"c": "engine"})] \
            == ["p1"]
        await kube.strategic_patch(POD, NS, "p1", {"status": {"conditions": [
            {"type": "serving.shoal.dev/engine-ready", "status": "False"}]}}, "status")
        pod = await kube.get(POD, NS, "p1")
        assert pod is not None
        assert {c["type"] for c in pod["status"]["conditions"]} == {
            "Ready", "serving.shoal.dev/engine-ready"}

        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": "m.1", "namespace": NS}, "reason": "Test"}
        assert (await kube.create(event))["reason"] == "Test"

        deployment = Resource("apps/v1", "Deployment")
        assert await kube.delete(deployment, NS, "m-router") is True
        assert await kube.delete(deployment, NS, "m-router") is False  # already gone
        assert await kube.get(deployment, NS, "m-router") is None
        with pytest.raises(ApiException) as failed:
            await kube.merge_patch(ISVC, NS, "missing", {"spec": {"replicas": 1}})
        assert failed.value.status == 404
    finally:
        await kube.close()


def test_unknown_kinds_are_a_clear_error() -> None:
    kube: Any = KubeApi.__new__(KubeApi)
    kube.api_client = None
    with pytest.raises(ValueError, match="does not manage Widget"):
        kube._method(Resource("example.com/v1", "Widget"), "patch")
