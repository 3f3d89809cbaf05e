"""Names the operator shares with the CRD, the chart and the pods it renders, and the metadata
every child carries: names, labels, selector and the owner reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP = "serving.shoal.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

# Pod readiness gate: True only after the operator saw the pod's /ready answer 200.
ENGINE_READY_CONDITION = f"{GROUP}/engine-ready"

# Labels on every child; the selector labels never change for the life of a service.
LABEL_SERVICE = f"{GROUP}/inference-service"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "shoal-operator"
COMPONENT_ENGINE = "engine"
COMPONENT_ROUTER = "router"
COMPONENT_PREFILL = "prefill"  # the prefill pool's engines (P/D disaggregation)
COMPONENT_EPP = "epp"  # `shoal route --epp`, the gateway's Endpoint Picker

# Label on engine pods when a prefill pool runs: prefill or decode (the selectors stay on
# LABEL_COMPONENT, which never changes for a pool).
LABEL_ROLE = f"{GROUP}/role"

# Annotation on engine pods: when the operator last recycled a crash-looping pod (and how often).
ANNOTATION_RECYCLES = f"{GROUP}/recycles"

# Annotation on the InferenceService, written by its router: a request waits for a replica
# (scale from zero). The router's side: runtime/router/replicas/capacity_request.py (same string).
ANNOTATION_CAPACITY_REQUEST = f"{GROUP}/capacity-requested-at"
# The same for the prefill pool (spec.prefill.autoscaling.minReplicas 0): a prompt wanted a
# prefill engine and none was ready (the decode engine computed it meanwhile).
ANNOTATION_PREFILL_CAPACITY_REQUEST = f"{GROUP}/prefill-capacity-requested-at"

# Annotation on the engine pod template: hash of the pod spec, so status can count updated pods.
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"

ENGINE_PORT = 8000
ENGINE_METRICS_PORT = 8002  # /metrics (and probes) without the API key, for Prometheus
ROUTER_PORT = 8080
EPP_PORT = 9002  # ext_proc gRPC, the inference extension's usual picker port
EPP_METRICS_PORT = 9090  # the picker's Prometheus /metrics, where the extension's has it
KV_TRANSFER_PORT = 14579  # prefill engines serve KV blocks here; decode engines pull
KV_EVENTS_PORT = 5557  # engines publish KV-cache events here; the router subscribes
ENGINE_CONTAINER = "engine"
# P/D through a gateway: each decode pod's `shoal route --pd-sidecar`, the address the
# picker sends requests to (llm-d's routing sidecar, in front of the engine on the same pod)
PD_SIDECAR_PORT = 8001
PD_SIDECAR_CONTAINER = "pd-sidecar"
FETCH_CONTAINER = "fetch-weights"  # init container that downloads hf:// weights
FIELD_MANAGER = MANAGER

DEFAULT_RUNTIME_IMAGE = "ghcr.io/shoal-dev/shoal-runtime:0.1.0"


@dataclass(frozen=True)
class Owner:
    """The InferenceService a child belongs to (from the object's metadata)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body.get("metadata") or {}
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default",
                   uid=meta.get("uid") or "")


def engine_name(owner: Owner) -> str:
    return f"{owner.name}-engine"


def router_name(owner: Owner) -> str:
    return f"{owner.name}-router"


def prefill_name(owner: Owner) -> str:
    return f"{owner.name}-prefill"


def pd_sidecar_name(owner: Owner) -> str:
    """The decode pods' service account when they run the P/D sidecar (gateway mode)."""
    return f"{owner.name}-pd-sidecar"


def epp_name(owner: Owner) -> str:
    return f"{owner.name}-epp"


def cache_claim_name(owner: Owner) -> str:
    return f"{owner.name}-model-cache"


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    return {LABEL_SERVICE: owner.name, LABEL_COMPONENT: component}


def engine_selector(owner: Owner) -> dict[str, str]:
    return selector_labels(owner, COMPONENT_ENGINE)


def label_selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def child_metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    labels = {**selector_labels(owner, component), LABEL_MANAGED_BY: MANAGER}
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    # controller=True: one controller per child; blockOwnerDeletion: foreground deletion waits.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
