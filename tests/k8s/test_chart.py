"""The Helm chart lints, renders, and every rendered manifest is valid Kubernetes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).parents[2] / "charts" / "shoal"


def helm(tools: SimpleNamespace, *args: str) -> str:
    result = subprocess.run([tools.helm, *args], capture_output=True, text=True, timeout=120,
                            env={"HOME": "/tmp", "PATH": "/usr/bin:/bin",
                                 "HELM_CACHE_HOME": "/tmp/helm-cache",
                                 "HELM_CONFIG_HOME": "/tmp/helm-config",
                                 "HELM_DATA_HOME": "/tmp/helm-data"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(tools: SimpleNamespace, *values: str) -> list[dict[str, Any]]:
    flags = [item for value in values for item in ("--set", value)]
    out = helm(tools, "template", "shoal", str(CHART), "--namespace", "shoal-system",
               "--include-crds", *flags)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_helm_lint(k8s_tools: SimpleNamespace) -> None:
    out = helm(k8s_tools, "lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", [(), ("watchNamespaces={ml,research}",)],
                         ids=["cluster-wide", "two-namespaces"])
def test_rendered_manifests_validate(k8s_tools: SimpleNamespace, values: tuple[str, ...]) -> None:
    docs = render(k8s_tools, *values)
    kinds = sorted(d["kind"] for d in docs)
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_the_chart_installs_our_crd(k8s_tools: SimpleNamespace, crd: dict[str, Any]) -> None:
    (rendered,) = [d for d in render(k8s_tools) if d["kind"] == "CustomResourceDefinition"]
    assert rendered == crd


def _rules(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [rule for d in docs if d["kind"] == kind for rule in d["rules"]]


def test_rbac_is_least_privilege(k8s_tools: SimpleNamespace) -> None:
    docs = render(k8s_tools)
    rules = _rules(docs, "ClusterRole")
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "*" not in rule["apiGroups"]
    resources = {r for rule in rules for r in rule["resources"]}
    assert "secrets" not in resources  # the engine reads its API key; the operator never does
    crd_rule = next(r for r in rules if "customresourcedefinitions" in r["resources"])
    assert set(crd_rule["verbs"]) == {"get", "list", "watch"}
    pods = next(r for r in rules if r["resources"] == ["pods"])
    assert "create" not in pods["verbs"]  # the Deployment controller makes pods, not us


def test_the_operator_may_write_every_kind_it_renders(k8s_tools: SimpleNamespace) -> None:
    """Including the gateway children, and what it grants its routers (RBAC lets it grant
    only what it holds: EndpointSlice reads, the capacity-request patch)."""
    from shoal.operator.names import Owner
    from shoal.operator.render.children import render_children
    from shoal.operator.render.gateway import render_gateway_children
    from shoal.operator.spec.service import parse_spec

    spec = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                       "autoscaling": {"minReplicas": 0, "maxReplicas": 2},
                       "monitoring": {"serviceMonitor": True}, "storage": {"size": "1Gi"},
                       "routing": {"gateway": {"inferencePool": True,
                                               "gatewayRef": {"name": "gw"}}}})
    owner = Owner("m", "ml", "u")
    children = render_children(owner, spec, 1) + render_gateway_children(owner, spec)
    rules = _rules(render(k8s_tools), "ClusterRole")

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
                   for r in rules)

    plurals = {"Deployment": "deployments", "Service": "services",
               "ServiceAccount": "serviceaccounts", "PersistentVolumeClaim":
               "persistentvolumeclaims", "PodDisruptionBudget": "poddisruptionbudgets",
               "Role": "roles", "RoleBinding": "rolebindings",
               "ServiceMonitor": "servicemonitors", "InferencePool": "inferencepools",
               "HTTPRoute": "httproutes"}
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        assert allowed(group, plurals[child["kind"]], "patch"), child["kind"]
    for child in children:
        for rule in child.get("rules") or []:  # what a rendered Role grants
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert allowed(group, resource, verb), (group, resource, verb)


def test_watch_namespaces_get_roles_not_cluster_roles(k8s_tools: SimpleNamespace) -> None:
    docs = render(k8s_tools, "watchNamespaces={ml,research}")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    cluster_resources = {r for rule in _rules(docs, "ClusterRole") for r in rule["resources"]}
    assert cluster_resources == {"customresourcedefinitions", "namespaces"}
    operator = next(d for d in docs if d["kind"] == "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args


def test_operator_pod_is_hardened(k8s_tools: SimpleNamespace) -> None:
    operator = next(d for d in render(k8s_tools) if d["kind"] == "Deployment")
    pod = operator["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert any(a.startswith("--liveness=http://0.0.0.0:") for a in container["args"])


@pytest.mark.parametrize("enabled", [True, False])
def test_operator_metrics_toggle(k8s_tools: SimpleNamespace, enabled: bool) -> None:
    docs = render(k8s_tools, f"metrics.enabled={str(enabled).lower()}", "metrics.port=9100")
    operator = next(d for d in docs if d["kind"] == "Deployment")
    template = operator["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert ("--metrics-port=9100" in container["args"]) is enabled
    assert ({"name": "metrics", "containerPort": 9100, "protocol": "TCP"}
            in container["ports"]) is enabled
    annotations = template["metadata"].get("annotations") or {}
    assert (annotations.get("prometheus.io/port") == "9100") is enabled
