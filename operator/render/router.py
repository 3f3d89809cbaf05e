"""Pure rendering of the router (`shoal route`) and the Service clients call.

The router discovers engines from the EndpointSlices of the headless engine Service, so it gets
its own ServiceAccount with read access to EndpointSlices in this namespace only.
"""

from __future__ import annotations

from typing import Any

from shoal.operator.names import (
    COMPONENT_ENGINE,
    COMPONENT_ROUTER,
    ENGINE_METRICS_PORT,
    ENGINE_PORT,
    GROUP,
    KV_EVENTS_PORT,
    PLURAL,
    ROUTER_PORT,
    Owner,
    child_metadata,
    engine_name,
    engine_selector,
    router_name,
    selector_labels,
)
from shoal.operator.render.auth import router_auth_args, router_auth_volume
from shoal.operator.render.engine import (
    container_security_context,
    pod_security_context,
    publishes_kv_events,
)
from shoal.operator.render.extras import render_endpointslice_reader_rbac
from shoal.operator.render.pd import prefill_scales_to_zero, router_pd_args
from shoal.operator.spec.service import ServiceSpec

SERVICE_PORT = 80


def router_args(owner: Owner, spec: ServiceSpec) -> list[str]:
    # Precise mode: the router subscribes to every discovered engine's KV events and takes
    # the tokenizer from the first ready engine (GET /tokenizer), so it needs no model files.
    precise = ["--kv-events", "--kv-events-port", str(KV_EVENTS_PORT),
               "--tokenizer-from-engine"] if publishes_kv_events(spec) else []
    return [
        "route", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
        "--policy", spec.routing.policy,
        "--discovery", "kubernetes",
        "--namespace", owner.namespace,
        "--service", engine_name(owner),
        "--engine-port", str(ENGINE_PORT),
        # engines guard /metrics on the serving port when they have keys; this one is open
        "--engine-metrics-port", str(ENGINE_METRICS_PORT),
        # The router hashes prompts in the engines' block size, so its cache-affinity index
        # lines up with the blocks the engines actually cache.
        "--block-size", str(spec.runtime.block_size),
    ] + (["--model-revision", spec.model.source.revision] if spec.model.source.revision else []
         ) + scale_from_zero_args(owner, spec) + precise + router_pd_args(owner, spec) \
        + router_auth_args(spec)


def scale_from_zero_args(owner: Owner, spec: ServiceSpec) -> list[str]:
    """minReplicas 0: the router holds requests while no engine is ready and asks for one by
    annotating this InferenceService (runtime/router/replicas/capacity_request.py). A prefill
    pool at zero holds nothing (the decode engine computes the prompt) but is asked for the
    same way."""
    decode = spec.autoscaling is not None and spec.autoscaling.scales_to_zero
    hold = ["--hold-timeout", str(spec.autoscaling.hold_timeout_seconds)] \
        if decode and spec.autoscaling is not None else []
    return hold + (["--capacity-request", owner.name]
                   if decode or prefill_scales_to_zero(spec) else [])


def capacity_request_rule(owner: Owner) -> dict[str, Any]:
    """The capacity request: patch this one InferenceService (its annotation), nothing else."""
    return {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [owner.name],
            "verbs": ["get", "patch"]}


PROBE_TIMING = {"periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 2}


def shoal_process_deployment(owner: Owner, spec: ServiceSpec, name: str, component: str,
                             replicas: int, container: dict[str, Any]) -> dict[str, Any]:
    """A Deployment of one non-GPU `shoal` process (the router, the endpoint picker): the
    caller gives the container's name, args, ports and probes; the rest is shared."""
    metadata = child_metadata(owner, name, component)
    container = {
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["shoal"],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        **container,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner, component)},
            "template": {
                "metadata": {"labels": dict(metadata["labels"])},
                "spec": {
                    "serviceAccountName": name,
                    "securityContext": pod_security_context(),
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def render_router_deployment(owner: Owner, spec: ServiceSpec) -> dict[str, Any]:
    deployment = shoal_process_deployment(owner, spec, router_name(owner), COMPONENT_ROUTER,
                                          spec.routing.replicas, {
        "name": "router",
        "args": router_args(owner, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, **PROBE_TIMING},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, **PROBE_TIMING},
    })
    auth = router_auth_volume(spec)
    if auth is not None:  # the clients' keys and the router's own, read-only files
        pod = deployment["spec"]["template"]["spec"]
        pod["volumes"].append(auth[0])
        pod["containers"][0]["volumeMounts"].append(auth[1])
    return deployment


def render_frontend_service(owner: Owner, spec: ServiceSpec) -> dict[str, Any]:
    """`<name>`: the router when routing is on, else the engines directly."""
    if spec.routing.enabled:
        component, selector, target = COMPONENT_ROUTER, selector_labels(
            owner, COMPONENT_ROUTER), ROUTER_PORT
    else:
        component, selector, target = COMPONENT_ENGINE, engine_selector(owner), ENGINE_PORT
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, owner.name, component),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": target,
                       "protocol": "TCP"}],
        },
    }


def render_router_rbac(owner: Owner, spec: ServiceSpec | None = None) -> list[dict[str, Any]]:
    objects = render_endpointslice_reader_rbac(owner, router_name(owner), COMPONENT_ROUTER)
    if spec is not None and scale_from_zero_args(owner, spec):
        objects[1]["rules"].append(capacity_request_rule(owner))
    return objects


def service_url(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local"
