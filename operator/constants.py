"""Names the operator shares with the CRD, the chart and the pods it renders."""

from __future__ import annotations

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
# (scale from zero). The router's side: runtime/router/capacity_request.py (same string).
ANNOTATION_CAPACITY_REQUEST = f"{GROUP}/capacity-requested-at"

# Annotation on the engine pod template: hash of the pod spec, so status can count updated pods.
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"

ENGINE_PORT = 8000
ENGINE_METRICS_PORT = 8002  # /metrics (and probes) without the API key, for Prometheus
ROUTER_PORT = 8080
EPP_PORT = 9002  # ext_proc gRPC, the inference extension's usual picker port
KV_TRANSFER_PORT = 14579  # prefill engines serve KV blocks here; decode engines pull
KV_EVENTS_PORT = 5557  # engines publish KV-cache events here; the router subscribes
ENGINE_CONTAINER = "engine"
FETCH_CONTAINER = "fetch-weights"  # init container that downloads hf:// weights
FIELD_MANAGER = MANAGER

DEFAULT_RUNTIME_IMAGE = "ghcr.io/shoal-dev/shoal-runtime:0.1.0"
