"""All children of one InferenceService, in apply order (dependencies first)."""

from __future__ import annotations

from typing import Any

from shoal.operator.names import Owner
from shoal.operator.render.engine import (
    render_engine_deployment,
    render_engine_headless_service,
)
from shoal.operator.render.extras import render_cache_pvc, render_pdb, render_service_monitor
from shoal.operator.render.pd import (
    ROLE_PREFILL,
    render_pd_sidecar_rbac,
    render_prefill_service,
    wants_pd_sidecar,
)
from shoal.operator.render.router import (
    render_frontend_service,
    render_router_deployment,
    render_router_rbac,
)
from shoal.operator.spec.service import ServiceSpec


def render_children(owner: Owner, spec: ServiceSpec, engine_replicas: int) -> list[dict[str, Any]]:
    children: list[dict[str, Any]] = []
    pvc = render_cache_pvc(owner, spec)
    if pvc is not None:
        children.append(pvc)
    children.append(render_engine_headless_service(owner))
    if wants_pd_sidecar(spec):  # the decode pods' account exists before their pods
        children += render_pd_sidecar_rbac(owner)
    children.append(render_engine_deployment(owner, spec, engine_replicas))
    children.append(render_pdb(owner))
    if spec.prefill is not None:
        children.append(render_prefill_service(owner))
        children.append(render_engine_deployment(owner, spec, spec.prefill.replicas,
                                                 ROLE_PREFILL))
    if spec.routing.enabled:
        children += render_router_rbac(owner, spec)
        children.append(render_router_deployment(owner, spec))
    children.append(render_frontend_service(owner, spec))
    if spec.service_monitor:
        children.append(render_service_monitor(owner))
    return children


def child_key(child: dict[str, Any]) -> tuple[str, str, str]:
    return child["apiVersion"], child["kind"], child["metadata"]["name"]
