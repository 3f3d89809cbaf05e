"""Pure rendering of the optional children: PodDisruptionBudget, weight-cache PVC, ServiceMonitor,
and the EndpointSlice readers' ServiceAccount and Role (router, Endpoint Picker, P/D sidecar)."""

from __future__ import annotations

from typing import Any

from shoal.operator.names import (
    COMPONENT_ENGINE,
    Owner,
    cache_claim_name,
    child_metadata,
    engine_name,
    engine_selector,
)
from shoal.operator.spec.service import ServiceSpec


def render_pdb(owner: Owner) -> dict[str, Any]:
    # One engine at a time may be evicted: a drain never takes the whole service down at once.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, engine_name(owner), COMPONENT_ENGINE),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": engine_selector(owner)}},
    }


def render_cache_pvc(owner: Owner, spec: ServiceSpec) -> dict[str, Any] | None:
    """A weight cache the operator creates when the spec gives a size (not an existing claim)."""
    if spec.storage is None or spec.storage.size is None:
        return None
    pvc_spec: dict[str, Any] = {
        "accessModes": [spec.storage.access_mode],
        "resources": {"requests": {"storage": spec.storage.size}},
    }
    if spec.storage.storage_class_name:
        pvc_spec["storageClassName"] = spec.storage.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_metadata(owner, cache_claim_name(owner), COMPONENT_ENGINE),
        "spec": pvc_spec,
    }


def render_service_monitor(owner: Owner) -> dict[str, Any]:
    """Prometheus Operator scrape config for every engine pod's /metrics."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(owner, engine_name(owner), COMPONENT_ENGINE),
        "spec": {
            "selector": {"matchLabels": engine_selector(owner)},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            # the engines' --metrics-port: no API key needed there
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def render_endpointslice_reader_rbac(owner: Owner, name: str,
                                     component: str) -> list[dict[str, Any]]:
    """A ServiceAccount allowed to read EndpointSlices in this namespace only (the router's,
    the Endpoint Picker's, the decode pods' P/D sidecar's)."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(owner, name, component),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_metadata(owner, name, component),
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                   "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_metadata(owner, name, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }
    return [account, role, binding]
