"""The operator's own Prometheus metrics (`--metrics-port`): rounds and per-service replicas.

Separate from the engines' `shoal:` metrics, which the operator reads but does not re-export
(scrape the engines for those; the ServiceMonitor / Grafana dashboard do).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
ROUNDS = Counter("shoal_operator_reconcile_rounds_total",
                 "reconcile rounds by result (ok, error)", ["result"], registry=REGISTRY)
ROUND_SECONDS = Histogram("shoal_operator_reconcile_seconds", "duration of one reconcile round",
                          buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
_LABELS = ["namespace", "name"]
DESIRED = Gauge("shoal_operator_desired_replicas", "engine replicas wanted", _LABELS,
                registry=REGISTRY)
READY = Gauge("shoal_operator_ready_replicas", "engine replicas passing their readiness gate",
              _LABELS, registry=REGISTRY)
KV_USAGE = Gauge("shoal_operator_kv_cache_usage",
                 "mean KV-cache usage (0-1) of the ready replicas", _LABELS, registry=REGISTRY)
_SERVICE_GAUGES = (DESIRED, READY, KV_USAGE)


def serve(port: int) -> None:
    start_http_server(port, addr="0.0.0.0", registry=REGISTRY)


def record_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    if "desiredReplicas" in status:
        DESIRED.labels(namespace, name).set(status["desiredReplicas"])
    if "readyReplicas" in status:
        READY.labels(namespace, name).set(status["readyReplicas"])
    if status.get("kvCacheUsage") is not None:
        KV_USAGE.labels(namespace, name).set(status["kvCacheUsage"])


def forget(namespace: str, name: str) -> None:
    for gauge in _SERVICE_GAUGES:
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
