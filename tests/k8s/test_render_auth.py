"""spec.auth rendered: which process reads which key file, and the flags the real CLIs parse."""

from __future__ import annotations

import argparse
from typing import Any

import kubernetes_validate
import pytest
from shoal.operator.names import ENGINE_METRICS_PORT, Owner
from shoal.operator.render.auth import API_KEYS_FILE, AUTH_MOUNT, UPSTREAM_KEY_FILE
from shoal.operator.render.children import render_children
from shoal.operator.render.engine import render_engine_deployment
from shoal.operator.render.router import render_router_deployment, router_args
from shoal.operator.spec.service import parse_spec
from shoal.runtime.api import cli as serve_cli
from shoal.runtime.router import cli as route_cli
from shoal.runtime.router.config import RouterConfig

OWNER = Owner(name="qwen", namespace="ml", uid="0d7c5e1c-uid")
AUTH = {"apiKeySecretRef": {"name": "keys"}, "cacheSharing": "global"}


def service(**changes: Any) -> dict[str, Any]:
    return {"model": {"uri": "hf://org/m"}, **changes}


def parsed(command: Any, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(args)


def engine_pod(spec: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = render_engine_deployment(OWNER, parse_spec(spec), 2)["spec"][
        "template"]["spec"]
    return pod


def router_pod(spec: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = render_router_deployment(OWNER, parse_spec(spec))["spec"][
        "template"]["spec"]
    return pod


def secret_items(pod: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(secret, key, file) of the auth volume; its mount must be read-only."""
    volume = next(v for v in pod["volumes"] if v["name"] == "auth")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "auth")
    assert mount == {"name": "auth", "mountPath": AUTH_MOUNT, "readOnly": True}
    return [(s["secret"]["name"], item["key"], item["path"])
            for s in volume["projected"]["sources"] for item in s["secret"]["items"]]


def test_behind_the_router_clients_keys_stop_at_the_router() -> None:
    spec = service(auth=AUTH)
    route = parsed(route_cli, router_args(OWNER, parse_spec(spec)))
    assert (route.api_key_file, route.upstream_api_key_file, route.cache_sharing, route.api_key,
            route.upstream_api_key) == (API_KEYS_FILE, UPSTREAM_KEY_FILE, "global", [], None)
    assert secret_items(router_pod(spec)) == [("keys", "api-key", "api-keys"),
                                              ("keys", "upstream-api-key", "upstream-api-key")]
    pod = engine_pod(spec)
    serve = parsed(serve_cli, pod["containers"][0]["args"])
    # the engines accept only the router's key, and so may trust its tenant header
    assert (serve.api_key_file, serve.tenant_header, serve.cache_sharing, serve.api_key) == (
        UPSTREAM_KEY_FILE, "x-shoal-tenant", "global", [])
    assert secret_items(pod) == [("keys", "upstream-api-key", "upstream-api-key")]
    assert "secretKeyRef" not in str(pod["containers"][0]["env"])  # no key in the env
    for init in pod["initContainers"]:  # the weight fetcher never sees a key
        assert "auth" not in [m["name"] for m in init["volumeMounts"]]


def test_a_separate_upstream_secret_and_the_children_stay_valid() -> None:
    spec = service(auth={"apiKeySecretRef": {"name": "clients", "key": "k"},
                         "upstreamKeySecretRef": {"name": "router", "key": "u"}})
    assert secret_items(router_pod(spec)) == [("clients", "k", "api-keys"),
                                              ("router", "u", "upstream-api-key")]
    assert secret_items(engine_pod(spec)) == [("router", "u", "upstream-api-key")]
    for child in render_children(OWNER, parse_spec(spec), 2):
        kubernetes_validate.validate(child, "1.30.0", strict=True)


@pytest.mark.parametrize("routing", [{"enabled": False},
                                     {"gateway": {"inferencePool": True}}],
                         ids=["routing-off", "inference-gateway"])
def test_engines_facing_clients_check_the_clients_keys_and_trust_no_header(
        routing: dict[str, Any]) -> None:
    spec = service(auth=AUTH, routing=routing)
    pod = engine_pod(spec)
    serve = parsed(serve_cli, pod["containers"][0]["args"])
    assert (serve.api_key_file, serve.tenant_header, serve.cache_sharing) == (
        API_KEYS_FILE, None, "global")
    assert secret_items(pod) == [("keys", "api-key", "api-keys")]
    if routing.get("enabled", True):  # the router passes the client's key through
        route = parsed(route_cli, router_args(OWNER, parse_spec(spec)))
        assert (route.api_key_file, route.upstream_api_key_file, route.cache_sharing) == (
            None, None, "global")
        assert "auth" not in [v["name"] for v in router_pod(spec)["volumes"]]


def test_without_auth_nothing_is_rendered() -> None:
    spec = service()
    serve = parsed(serve_cli, engine_pod(spec)["containers"][0]["args"])
    route = parsed(route_cli, router_args(OWNER, parse_spec(spec)))
    assert (serve.api_key_file, serve.tenant_header, serve.cache_sharing) == (
        None, None, "tenant")
    assert (route.api_key_file, route.upstream_api_key_file) == (None, None)
    for pod in (engine_pod(spec), router_pod(spec)):
        assert "auth" not in [v["name"] for v in pod["volumes"]]


def test_probes_and_the_operators_own_checks_need_no_key() -> None:
    """Kubelet probes hit /health and /ready, which no key guards. With keys, an engine's
    /metrics on the serving port needs one (prefix-cache counters tell tenants about each
    other), so the operator and the router read /ready and /metrics on the engines'
    --metrics-port, which stays open."""
    pod = engine_pod(service(auth=AUTH))
    container = pod["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in ("/health", "/ready")
    serve = parsed(serve_cli, container["args"])
    assert serve.metrics_port == ENGINE_METRICS_PORT and serve.metrics_auth is None
    from shoal.operator import cli as operator_cli

    assert parsed(operator_cli, ["operator"]).engine_port == ENGINE_METRICS_PORT
    route = parsed(route_cli, router_args(OWNER, parse_spec(service(auth=AUTH))))
    assert route.engine_metrics_port == ENGINE_METRICS_PORT
    router = router_pod(service(auth=AUTH))["containers"][0]
    assert {router["readinessProbe"]["httpGet"]["path"],
            router["livenessProbe"]["httpGet"]["path"]} == {"/ready", "/health"}


def test_upstream_key_file_holds_exactly_one_key(tmp_path: Any) -> None:
    path = tmp_path / "upstream-api-key"
    path.write_text("# the router's key\nsk-router\n")
    auth = RouterConfig(upstream_api_key_file=str(path)).edge_auth()
    assert auth.scrape_headers() == {"Authorization": "Bearer sk-router"}
    path.write_text("sk-a\nsk-b\n")
    with pytest.raises(ValueError, match="exactly one"):
        RouterConfig(upstream_api_key_file=str(path)).edge_auth()
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(upstream_api_key="x", upstream_api_key_file=str(path)).edge_auth()
