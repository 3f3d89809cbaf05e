"""Pure rendering of P/D disaggregation (spec.prefill): the engines' KV-transfer roles, the
prefill pool's Service and the router's P/D flags.

Prefill engines serve the blocks of each prompt they computed on their own pod IP (the
downward API's status.podIP, expanded by the kubelet in the container's args), and name that
address in the kv_transfer_params they answer with; the router hands those to the decode
engine, which pulls from that very pod. So decode engines need only the consumer role. The
router finds the prefill pods through the EndpointSlices of a Service in front of the pool
(``--prefill-service``), each by its own IP, so it weighs each pod's load and sees a pool
scaled to zero as empty.

Through a gateway (spec.routing.gateway.inferencePool) the picker, Shoal's or llm-d's, names
a prefill pod in the ``x-prefiller-host-port`` header of the request it sends to a decode pod;
each decode pod then runs ``shoal route --pd-sidecar`` in front of its engine, and the pool
and the picker address that sidecar. The sidecar follows the header only to a ready pod of the
prefill Service (by IP, any port, as llm-d's sidecar allows the pods of its pool) or to the
Service's own address; to watch the EndpointSlices it runs as its own service account, whose
token is mounted in the sidecar container alone (the engine's container gets none).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from shoal.operator.names import (
    COMPONENT_ENGINE,
    COMPONENT_PREFILL,
    ENGINE_METRICS_PORT,
    ENGINE_PORT,
    KV_TRANSFER_PORT,
    PD_SIDECAR_CONTAINER,
    PD_SIDECAR_PORT,
    Owner,
    child_metadata,
    pd_sidecar_name,
    prefill_name,
    selector_labels,
)
from shoal.operator.render.extras import render_endpointslice_reader_rbac
from shoal.operator.spec.service import ServiceSpec

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
POD_IP_ENV = "POD_IP"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def pool_component(role: str) -> str:
    return COMPONENT_PREFILL if role == ROLE_PREFILL else COMPONENT_ENGINE


def pool_spec(spec: ServiceSpec, role: str) -> ServiceSpec:
    """The spec one pool's engines are rendered from: the prefill pool has its own resources."""
    if role == ROLE_PREFILL and spec.prefill is not None:
        return replace(spec, resources=spec.prefill.resources)
    return spec


def kv_transfer_args(spec: ServiceSpec, role: str) -> list[str]:
    """`--kv-transfer-config` for one pool's engines (nothing without spec.prefill)."""
    if spec.prefill is None:
        return []
    config: dict[str, Any] = {"kv_connector": "TcpConnector"}
    if role == ROLE_PREFILL:
        config.update(kv_role="kv_producer", kv_ip=f"$({POD_IP_ENV})", kv_port=KV_TRANSFER_PORT)
    else:
        config.update(kv_role="kv_consumer")
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def pod_ip_env() -> dict[str, Any]:
    return {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def prefill_selector(owner: Owner) -> dict[str, str]:
    return selector_labels(owner, COMPONENT_PREFILL)


def render_prefill_service(owner: Owner) -> dict[str, Any]:
    """The router's --prefill-backend: one address for the pool (kube-proxy spreads the
    prompts; the metrics port is what the router scrapes for load)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, prefill_name(owner), COMPONENT_PREFILL),
        "spec": {
            "type": "ClusterIP",
            "selector": prefill_selector(owner),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http",
                       "protocol": "TCP"},
                      {"name": "metrics", "port": ENGINE_METRICS_PORT, "targetPort": "metrics",
                       "protocol": "TCP"}],
        },
    }


def prefill_url(owner: Owner) -> str:
    return f"http://{prefill_name(owner)}.{owner.namespace}.svc.cluster.local:{ENGINE_PORT}"


def router_pd_args(owner: Owner, spec: ServiceSpec) -> list[str]:
    if spec.prefill is None:
        return []
    return ["--prefill-service", prefill_name(owner),
            "--pd-threshold", str(spec.prefill.threshold)]


def prefill_scales_to_zero(spec: ServiceSpec) -> bool:
    """spec.prefill.autoscaling.minReplicas 0: the router (or the picker) asks for a prefill
    replica when a prompt wants one and none is ready."""
    return spec.prefill is not None and spec.prefill.autoscaling is not None \
        and spec.prefill.autoscaling.scales_to_zero


def wants_pd_sidecar(spec: ServiceSpec) -> bool:
    """P/D through a gateway: the decode pods take the picker's requests through a sidecar."""
    return spec.prefill is not None and spec.routing.gateway.inference_pool


def render_pd_sidecar_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The decode pods' service account: reads the EndpointSlices of this namespace (the
    prefill Service's), nothing else."""
    return render_endpointslice_reader_rbac(owner, pd_sidecar_name(owner), COMPONENT_ENGINE)


def render_pd_sidecar(owner: Owner, spec: ServiceSpec) -> tuple[dict[str, Any],
                                                                list[dict[str, Any]]]:
    """The sidecar container of a decode pod (the caller adds the engine's security
    context and the pod's service account) and its volumes: scratch, and the account's
    token as the kubelet would mount it, for this container only. The client's headers
    (its API key included) pass through to both engines, as they do through the gateway."""
    tmp = f"{PD_SIDECAR_CONTAINER}-tmp"
    token = f"{PD_SIDECAR_CONTAINER}-token"
    container = {
        "name": PD_SIDECAR_CONTAINER,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["shoal"],
        "args": ["route", "--pd-sidecar", "--host", "0.0.0.0", "--port", str(PD_SIDECAR_PORT),
                 "--backend", f"http://127.0.0.1:{ENGINE_PORT}",
                 "--prefill-backend", prefill_url(owner),
                 "--prefill-service", prefill_name(owner), "--namespace", owner.namespace],
        "ports": [{"name": "pd-sidecar", "containerPort": PD_SIDECAR_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        # its /ready is its engine's: the pool sees the pod ready when both are
        "readinessProbe": {"httpGet": {"path": "/ready", "port": PD_SIDECAR_PORT},
                           "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 2},
        "volumeMounts": [{"name": tmp, "mountPath": "/tmp"},
                         {"name": token, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}],
    }
    return container, [{"name": tmp, "emptyDir": {}}, {"name": token, "projected": {
        "sources": [
            # 3607 s: the kubelet's own automount value (the API server may extend it)
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "kube-root-ca.crt",
                           "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}]
