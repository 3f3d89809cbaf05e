"""The pruning decision (pure): desired set vs the children observed, by kind + name."""

from __future__ import annotations

import copy
from typing import Any

from shoal.operator.kube.api import Resource
from shoal.operator.loop.prune import is_owned, served_prunable, stale_children
from shoal.operator.names import Owner
from shoal.operator.render.children import render_children
from shoal.operator.render.gateway import render_gateway_children
from shoal.operator.spec.service import parse_spec

OWNER = Owner(name="chat", namespace="ml", uid="uid-1")
POOL = Resource("inference.networking.k8s.io/v1", "InferencePool")
ROUTE = Resource("gateway.networking.k8s.io/v1", "HTTPRoute")
DEPLOYMENT = Resource("apps/v1", "Deployment")


def rendered(spec: dict[str, Any]) -> list[dict[str, Any]]:
    parsed = parse_spec({"model": {"uri": "hf://org/m"}, **spec})
    return render_children(OWNER, parsed, 1) + render_gateway_children(OWNER, parsed)


def as_listed(children: list[dict[str, Any]]) -> list[tuple[Resource, dict[str, Any]]]:
    """As a list call returns them: items without kind/apiVersion, paired with what was listed."""
    out = []
    for child in children:
        item = copy.deepcopy(child)
        resource = Resource(item.pop("apiVersion"), item.pop("kind"))
        out.append((resource, item))
    return out


GATEWAY = {"routing": {"gateway": {"inferencePool": True, "gatewayRef": {"name": "gw"}}}}


def test_removing_the_gateway_block_prunes_pool_route_and_picker() -> None:
    before = as_listed(rendered(GATEWAY))
    stale = stale_children(OWNER, rendered({}), before)
    assert [(r.kind, name) for r, name in stale] == [
        ("Deployment", "chat-epp"), ("HTTPRoute", "chat"), ("InferencePool", "chat"),
        ("Role", "chat-epp"), ("RoleBinding", "chat-epp"), ("Service", "chat-epp"),
        ("ServiceAccount", "chat-epp")]
    assert stale_children(OWNER, rendered(GATEWAY), before) == []  # nothing changed: nothing


def test_an_external_picker_keeps_pool_and_route_and_drops_shoals_picker() -> None:
    external = {"routing": {"gateway": {**GATEWAY["routing"]["gateway"],
                                        "endpointPicker": "external",
                                        "endpointPickerRef": {"name": "vendor-epp"}}}}
    stale = stale_children(OWNER, rendered(external), as_listed(rendered(GATEWAY)))
    assert {name for _, name in stale} == {"chat-epp"}
    assert {r.kind for r, _ in stale} == {"Deployment", "Service", "ServiceAccount", "Role",
                                          "RoleBinding"}


def test_routing_off_prunes_the_router_but_keeps_the_frontend_service() -> None:
    stale = stale_children(OWNER, rendered({"routing": {"enabled": False}}),
                           as_listed(rendered({})))
    assert [(r.kind, name) for r, name in stale] == [
        ("Deployment", "chat-router"), ("Role", "chat-router"), ("RoleBinding", "chat-router"),
        ("ServiceAccount", "chat-router")]


def test_only_what_this_service_owns_is_pruned() -> None:
    (pool,) = [(r, o) for r, o in as_listed(rendered(GATEWAY)) if r == POOL]
    foreign_owner = copy.deepcopy(pool)
    foreign_owner[1]["metadata"]["ownerReferences"][0]["uid"] = "uid-of-a-recreated-chat"
    no_owner = copy.deepcopy(pool)
    no_owner[1]["metadata"]["ownerReferences"] = []
    other_labels = copy.deepcopy(pool)
    other_labels[1]["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "helm"
    not_controller = copy.deepcopy(pool)
    not_controller[1]["metadata"]["ownerReferences"][0]["controller"] = False
    terminating = copy.deepcopy(pool)
    terminating[1]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    for obj in (foreign_owner, no_owner, other_labels, not_controller, terminating):
        assert stale_children(OWNER, rendered({}), [obj]) == []
    assert stale_children(OWNER, rendered({}), [pool]) == [(POOL, "chat")]
    # without a uid (never from a real API server) nothing can be proved ours
    assert not is_owned(Owner("chat", "ml", ""), pool[1])


async def test_custom_kinds_are_listed_only_when_served() -> None:
    class Discovery:
        def __init__(self, served: dict[str, set[str]]) -> None:
            self.served, self.asked = served, []  # type: list[str]

        async def served_resources(self, group_version: str) -> set[str] | None:
            self.asked.append(group_version)
            return self.served.get(group_version)

        async def list(self, *_: Any, **__: Any) -> list[dict[str, Any]]:
            raise AssertionError("not listed here")

        async def delete(self, *_: Any) -> bool:
            raise AssertionError("not deleted here")

    bare = Discovery({})
    kinds = await served_prunable(bare)
    assert POOL not in kinds and ROUTE not in kinds and DEPLOYMENT in kinds
    assert len(bare.asked) == len(set(bare.asked))  # one discovery call per group/version
    gateway = Discovery({POOL.api_version: {"inferencepools"},
                         ROUTE.api_version: {"httproutes", "gateways"}})
    assert {POOL, ROUTE} <= set(await served_prunable(gateway))
