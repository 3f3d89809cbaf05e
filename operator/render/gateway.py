"""Pure rendering for Gateway API inference gateways (spec.routing.gateway).

* an ``InferencePool`` (inference.networking.k8s.io/v1) selecting the engine pods on the
  engine port, its ``endpointPickerRef`` naming Shoal's picker or an external one;
* with ``endpointPicker: shoal``, the picker itself: ``shoal route --epp`` (ext_proc gRPC on
  9002, the inference extension's usual port; appProtocol h2c so gateways speak HTTP/2 to it)
  as a Deployment and Service, reading EndpointSlices with its own ServiceAccount;
* with a ``gatewayRef``, an ``HTTPRoute`` attaching the pool to that Gateway.
The engine pods add ``--metrics-compat vllm`` so any picker can score them (render/engine.py).
Whether these kinds exist in the cluster is decided at the I/O edge, not here.
"""

from __future__ import annotations

from typing import Any

from shoal.operator.names import (
    COMPONENT_ENGINE,
    COMPONENT_EPP,
    ENGINE_PORT,
    EPP_METRICS_PORT,
    EPP_PORT,
    PD_SIDECAR_PORT,
    Owner,
    child_metadata,
    engine_selector,
    epp_name,
    selector_labels,
)
from shoal.operator.render.extras import render_endpointslice_reader_rbac
from shoal.operator.render.pd import prefill_scales_to_zero, wants_pd_sidecar
from shoal.operator.render.router import (
    PROBE_TIMING,
    capacity_request_rule,
    router_args,
    shoal_process_deployment,
)
from shoal.operator.spec.service import ServiceSpec

POOL_API_VERSION = "inference.networking.k8s.io/v1"
ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"


def pool_name(owner: Owner) -> str:
    return owner.name


def wants_pool(spec: ServiceSpec) -> bool:
    return spec.routing.gateway.inference_pool


def wants_shoal_picker(spec: ServiceSpec) -> bool:
    return wants_pool(spec) and spec.routing.gateway.endpoint_picker == "shoal"


def wants_route(spec: ServiceSpec) -> bool:
    return wants_pool(spec) and spec.routing.gateway.gateway_name is not None


def render_inference_pool(owner: Owner, spec: ServiceSpec) -> dict[str, Any]:
    gateway = spec.routing.gateway
    if gateway.endpoint_picker == "shoal":
        picker, port = epp_name(owner), EPP_PORT
    else:
        picker, port = str(gateway.picker_service), gateway.picker_port
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_metadata(owner, pool_name(owner), COMPONENT_ENGINE),
        "spec": {
            "selector": {"matchLabels": engine_selector(owner)},
            # P/D: requests reach a decode pod through its sidecar (render/pd.py)
            "targetPorts": [{"number": PD_SIDECAR_PORT if wants_pd_sidecar(spec)
                             else ENGINE_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker,
                                  "port": {"number": port},
                                  "failureMode": gateway.failure_mode},
        },
    }


def render_http_route(owner: Owner, spec: ServiceSpec) -> dict[str, Any]:
    gateway = spec.routing.gateway
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                              "name": gateway.gateway_name}
    if gateway.gateway_namespace:
        parent["namespace"] = gateway.gateway_namespace
    return {
        "apiVersion": ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": child_metadata(owner, pool_name(owner), COMPONENT_ENGINE),
        "spec": {
            "parentRefs": [parent],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io",
                                 "kind": "InferencePool", "name": pool_name(owner)}],
            }],
        },
    }


def epp_args(owner: Owner, spec: ServiceSpec) -> list[str]:
    """The router's own flags (same discovery and policy), served as an Endpoint Picker."""
    args = list(router_args(owner, spec))
    args[args.index("--port") + 1] = str(EPP_PORT)
    if wants_pd_sidecar(spec):  # it picks the decode pods' sidecars (their /ready is the
        # engine's; load is still scraped from the engine's metrics port); --prefill-backend
        # and --pd-threshold come with the router's flags
        args[args.index("--engine-port") + 1] = str(PD_SIDECAR_PORT)
    # holding requests is the proxy's, not the EPP's; asking for capacity stays where the
    # picker may ask for a prefill replica (a prefill pool that scales to zero)
    for proxy_only in ("--hold-timeout",) + (
            () if prefill_scales_to_zero(spec) else ("--capacity-request",)):
        if proxy_only in args:
            i = args.index(proxy_only)
            del args[i:i + 2]
    return [*args, "--epp", "--epp-metrics-port", str(EPP_METRICS_PORT)]


def render_epp_deployment(owner: Owner, spec: ServiceSpec) -> dict[str, Any]:
    # one picker: the affinity index lives in its memory
    return shoal_process_deployment(owner, spec, epp_name(owner), COMPONENT_EPP, 1, {
        "name": "epp",
        "args": epp_args(owner, spec),
        "ports": [{"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"grpc": {"port": EPP_PORT, "service": "readiness"}, **PROBE_TIMING},
        "livenessProbe": {"grpc": {"port": EPP_PORT, "service": "liveness"}, **PROBE_TIMING},
    })


def render_epp_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, epp_name(owner), COMPONENT_EPP),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner, COMPONENT_EPP),
            "ports": [{"name": "grpc-ext-proc", "port": EPP_PORT, "targetPort": EPP_PORT,
                       "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"},
                      {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics",
                       "protocol": "TCP"}],
        },
    }


def render_gateway_children(owner: Owner, spec: ServiceSpec) -> list[dict[str, Any]]:
    """In apply order; empty when no pool is asked for."""
    if not wants_pool(spec):
        return []
    children: list[dict[str, Any]] = []
    if wants_shoal_picker(spec):
        children += render_endpointslice_reader_rbac(owner, epp_name(owner), COMPONENT_EPP)
        if prefill_scales_to_zero(spec):  # the prefill capacity request: this object only
            children[-2]["rules"].append(capacity_request_rule(owner))
        children += [render_epp_deployment(owner, spec), render_epp_service(owner)]
    children.append(render_inference_pool(owner, spec))
    if wants_route(spec):
        children.append(render_http_route(owner, spec))
    return children
