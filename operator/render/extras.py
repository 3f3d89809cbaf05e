"""Pure rendering of the optional children: PodDisruptionBudget, weight-cache PVC, ServiceMonitor."""

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
