"""P/D disaggregation rendering (spec.prefill), pure: two engine pools with their KV-transfer
roles, the prefill pool's Service, and the router in P/D mode pointing at it."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
from shoal.operator.names import LABEL_COMPONENT, LABEL_ROLE, Owner
from shoal.operator.render.children import render_children
from shoal.operator.render.router import router_args
from shoal.operator.spec.service import parse_spec

OWNER = Owner(name="chat", namespace="ml", uid="uid-1")
BASE = {"model": {"uri": "hf://org/m"}, "replicas": 2, "resources": {"gpus": 1, "cpu": "8"}}


def children(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    parsed = parse_spec(spec)
    return {(c["kind"], c["metadata"]["name"]): c
            for c in render_children(OWNER, parsed, parsed.replicas)}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_without_prefill_nothing_changes() -> None:
    plain = children(BASE)
    assert ("Deployment", "chat-prefill") not in plain and ("Service", "chat-prefill") not in plain
    engine = plain[("Deployment", "chat-engine")]
    assert "--kv-transfer-config" not in container(engine)["args"]
    assert LABEL_ROLE not in engine["spec"]["template"]["metadata"]["labels"]
    assert "--prefill-service" not in router_args(OWNER, parse_spec(BASE))


def test_two_pools_with_their_roles_selectors_and_resources() -> None:
    rendered = children({**BASE, "prefill": {"replicas": 3, "threshold": 512,
                                             "resources": {"gpus": 1, "cpu": "16"}}})
    for child in rendered.values():
        kubernetes_validate.validate(child, "1.30.0", strict=True)
    decode, prefill = rendered[("Deployment", "chat-engine")], rendered[("Deployment",
                                                                         "chat-prefill")]
    assert (decode["spec"]["replicas"], prefill["spec"]["replicas"]) == (2, 3)
    # disjoint selectors: neither Deployment adopts the other's pods, and the headless Service
    # the router discovers decode engines from never lists a prefill engine
    assert decode["spec"]["selector"]["matchLabels"][LABEL_COMPONENT] == "engine"
    assert prefill["spec"]["selector"]["matchLabels"][LABEL_COMPONENT] == "prefill"
    assert rendered[("Service", "chat-engine")]["spec"]["selector"][LABEL_COMPONENT] == "engine"
    assert rendered[("Service", "chat-prefill")]["spec"]["selector"] == \
        prefill["spec"]["selector"]["matchLabels"]
    assert [decode["spec"]["template"]["metadata"]["labels"][LABEL_ROLE],
            prefill["spec"]["template"]["metadata"]["labels"][LABEL_ROLE]] == ["decode", "prefill"]
    assert container(decode)["resources"]["requests"]["cpu"] == "8"
    assert container(prefill)["resources"]["requests"]["cpu"] == "16"

    producer = json.loads(flag(container(prefill)["args"], "--kv-transfer-config") or "{}")
    consumer = json.loads(flag(container(decode)["args"], "--kv-transfer-config") or "{}")
    assert consumer == {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}
    # the producer serves on, and names in kv_transfer_params, its own pod IP (expanded by the
    # kubelet from the downward API), on the port its container declares
    assert producer == {"kv_connector": "TcpConnector", "kv_role": "kv_producer",
                        "kv_ip": "$(POD_IP)", "kv_port": 14579}
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in container(prefill)["env"]
    assert {"name": "kv-transfer", "containerPort": 14579, "protocol": "TCP"} \
        in container(prefill)["ports"]
    # only decode engines publish KV events: the router follows the caches it picks from
    assert "--kv-events-endpoint" in container(decode)["args"]
    assert "--kv-events-endpoint" not in container(prefill)["args"]
    # both pools are engines gated on /ready
    assert prefill["spec"]["template"]["spec"]["readinessGates"] == \
        decode["spec"]["template"]["spec"]["readinessGates"]


def test_the_router_runs_in_pd_mode_against_the_prefill_service() -> None:
    spec = parse_spec({**BASE, "prefill": {"threshold": 1024}})
    args = router_args(OWNER, spec)
    # the prefill pods by their own IPs, from the prefill Service's EndpointSlices (its RBAC:
    # the router's EndpointSlice reader)
    assert flag(args, "--prefill-service") == "chat-prefill"
    assert "--prefill-backend" not in args
    assert flag(args, "--pd-threshold") == "1024"
    assert flag(args, "--policy") == "cache-affinity"
    # the router's default threshold when none is given; the pool's resources are the decode's
    default = parse_spec({**BASE, "prefill": {}})
    assert flag(router_args(OWNER, default), "--pd-threshold") == "256"
    assert default.prefill is not None and default.prefill.resources == default.resources
    assert default.prefill.replicas == 1
