"""The gateway part of a round: apply the InferencePool (and the rest) only where the cluster
serves those kinds, and say so in the GatewayReady condition and an Event when it does not.

Discovery is the API server's own: GET /apis/<group>/<version> lists the resources it serves
(404 when the group is not installed), asked every round, so installing the CRDs later is
picked up without a restart. The decision and the condition are pure; this module's only I/O
is the discovery call and the applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from shoal.operator.names import Owner, epp_name
from shoal.operator.render.gateway import (
    POOL_API_VERSION,
    ROUTE_API_VERSION,
    pool_name,
    render_gateway_children,
    wants_pool,
    wants_route,
    wants_shoal_picker,
)
from shoal.operator.spec.service import ServiceSpec

GATEWAY_CONDITION = "GatewayReady"


class Discovery(Protocol):
    async def served_resources(self, group_version: str) -> set[str] | None: ...

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GatewayOutcome:
    condition: dict[str, Any] | None  # None: no pool asked for
    status: dict[str, Any] | None  # status.gateway
    event: tuple[str, str, str] | None  # (type, reason, message), only when it changed


def required_kinds(spec: ServiceSpec) -> list[tuple[str, str]]:
    """(group/version, plural) the spec needs served."""
    needed = [(POOL_API_VERSION, "inferencepools")]
    if wants_route(spec):
        needed.append((ROUTE_API_VERSION, "httproutes"))
    return needed


def gateway_outcome(owner: Owner, spec: ServiceSpec, missing: list[str],
                    previous_conditions: list[dict[str, Any]], now: datetime,
                    generation: int) -> GatewayOutcome:
    """Pure: the condition, status and Event for what discovery found."""
    if not wants_pool(spec):
        return GatewayOutcome(None, None, None)
    before = next((c for c in previous_conditions if c.get("type") == GATEWAY_CONDITION), {})
    if missing:
        reason = "GatewayAPINotInstalled"
        message = (f"not served by the API server: {', '.join(missing)}; install the Gateway "
                   "API Inference Extension CRDs (and Gateway API for the HTTPRoute); the "
                   "service stays reachable through its own router")
        ok, status_block = False, None
    else:
        reason, ok = "InferencePoolRendered", True
        status_block = {"inferencePool": pool_name(owner),
                        "endpointPicker": epp_name(owner) if wants_shoal_picker(spec)
                        else str(spec.routing.gateway.picker_service),
                        "httpRoute": pool_name(owner) if wants_route(spec) else None}
        message = f"InferencePool {pool_name(owner)} -> picker {status_block['endpointPicker']}"
    status_text = "True" if ok else "False"
    since = before.get("lastTransitionTime") if before.get("status") == status_text else None
    condition = {"type": GATEWAY_CONDITION, "status": status_text, "reason": reason,
                 "message": message,
                 "lastTransitionTime": since or now.isoformat().replace("+00:00", "Z"),
                 "observedGeneration": generation}
    changed = before.get("reason") != reason or before.get("message") != message
    event = (("Normal" if ok else "Warning"), reason, message) if changed else None
    return GatewayOutcome(condition, status_block, event)


async def missing_kinds(kube: Discovery, spec: ServiceSpec) -> list[str]:
    missing = []
    for group_version, plural in required_kinds(spec):
        served = await kube.served_resources(group_version)
        if served is None or plural not in served:
            missing.append(f"{plural}.{group_version}")
    return missing


async def reconcile_gateway(kube: Discovery, owner: Owner, spec: ServiceSpec,
                            previous_conditions: list[dict[str, Any]], now: datetime,
                            generation: int) -> GatewayOutcome:
    if not wants_pool(spec):
        return GatewayOutcome(None, None, None)
    missing = await missing_kinds(kube, spec)
    if not missing:
        for child in render_gateway_children(owner, spec):
            await kube.apply(child)
    return gateway_outcome(owner, spec, missing, previous_conditions, now, generation)
