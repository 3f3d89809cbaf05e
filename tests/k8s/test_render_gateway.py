"""spec.routing.gateway rendered (pure): the InferencePool and HTTPRoute validate against the
two CRDs' own v1 schemas (vendored under tests/k8s/data from the upstream repositories, CEL
rules included), the picker is `shoal route --epp` with the router's flags, the engines
export the vLLM names, and nothing is rendered unless a pool is asked for."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml
from shoal.operator.names import Owner
from shoal.operator.render.children import render_children
from shoal.operator.render.engine import engine_args
from shoal.operator.render.gateway import render_gateway_children
from shoal.operator.spec.service import SpecError, parse_spec

DATA = Path(__file__).parent / "data"
OWNER = Owner("chat", "serving", "uid-1")


def schema(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


def defaults(node: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and node.get("type") == "object":
        out = dict(value)
        for key, sub in (node.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = sub["default"]
            if key in out:
                out[key] = defaults(sub, out[key])
        return out
    if isinstance(value, list) and "items" in node:
        return [defaults(node["items"], v) for v in value]
    return value


def cel_errors(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Every x-kubernetes-validations rule on the value's path, arrays element by element."""
    import celpy

    env, errors = celpy.Environment(), []
    for rule in node.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            errors.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            errors += cel_errors(node["items"], item, f"{path}[{i}]")
    return errors


def admitted(obj: dict[str, Any], vendored: dict[str, Any]) -> list[str]:
    import jsonschema

    assert obj["apiVersion"] == f"{vendored['group']}/{vendored['version']}"
    assert obj["kind"] == vendored["kind"]
    root = vendored["openAPIV3Schema"]
    obj = defaults(root, obj)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft4Validator(root).iter_errors(obj)]
    return errors or cel_errors(root, obj)


def spec(**gateway: Any) -> Any:
    return parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                       "routing": {"gateway": gateway}})


def by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children}


def test_pool_and_route_are_valid_against_their_crds() -> None:
    children = by_kind(render_gateway_children(OWNER, spec(
        inferencePool=True, gatewayRef={"name": "inference-gw", "namespace": "gateways"})))
    pool, route = children["InferencePool"], children["HTTPRoute"]
    assert admitted(pool, schema("inferencepool.v1.schema.yaml")) == []
    assert admitted(route, schema("httproute.v1.schema.yaml")) == []
    assert pool["spec"]["selector"]["matchLabels"] == {
        "serving.shoal.dev/inference-service": "chat", "serving.shoal.dev/component": "engine"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "chat-epp", "port": {"number": 9002},
        "failureMode": "FailClose"}
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io",
                                            "kind": "Gateway", "name": "inference-gw",
                                            "namespace": "gateways"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}]
    for child in children.values():
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_the_vendored_schemas_reject_what_the_api_server_would() -> None:
    """The validation above can fail: a broken pool and route are refused."""
    pool = by_kind(render_gateway_children(OWNER, spec(inferencePool=True)))["InferencePool"]
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}] * 2}}
    assert any("unique" in e for e in admitted(broken, schema("inferencepool.v1.schema.yaml")))
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "x"}}}
    assert any("port is required" in e
               for e in admitted(no_port, schema("inferencepool.v1.schema.yaml")))
    route = by_kind(render_gateway_children(OWNER, spec(
        inferencePool=True, gatewayRef={"name": "gw"})))["HTTPRoute"]
    bad = {**route, "spec": {**route["spec"], "parentRefs": [{"name": ""}]}}
    assert admitted(bad, schema("httproute.v1.schema.yaml"))


def test_shoal_picker_runs_the_router_as_an_epp_with_its_own_account() -> None:
    children = render_gateway_children(OWNER, spec(inferencePool=True))
    kinds = [c["kind"] for c in children]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service",
                     "InferencePool"]  # no gatewayRef: no HTTPRoute
    deployment = by_kind(children)["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    from shoal.cli import build_parser

    args = build_parser().parse_args(container["args"])
    assert isinstance(args, argparse.Namespace)
    assert (args.epp, args.port, args.discovery, args.service, args.engine_port) == (
        True, 9002, "kubernetes", "chat-engine", 8000)
    # the picker's /metrics (P/D decisions, queues by role) where the extension's EPP has it
    assert args.epp_metrics_port == 9090
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    # the picker builds from exactly these flags (precise mode, the engine's tokenizer ...)
    from shoal.runtime.router.cli import config_from_args
    from shoal.runtime.router.epp.app import build_picker

    local = build_parser().parse_args([*container["args"], "--kube-api", "http://127.0.0.1:9"])
    picker, _ = build_picker(config_from_args(local), None)
    assert picker.policy.name == "cache-affinity"
    service = by_kind(children)["Service"]
    assert service["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    assert service["spec"]["ports"][1]["targetPort"] == "metrics"
    assert by_kind(children)["Role"]["rules"][0]["resources"] == ["endpointslices"]


def test_external_picker_and_the_engines_metric_names() -> None:
    external = spec(inferencePool=True, endpointPicker="external",
                    endpointPickerRef={"name": "llm-d-epp", "port": 9100,
                                       "failureMode": "FailOpen"})
    children = render_gateway_children(OWNER, external)
    assert [c["kind"] for c in children] == ["InferencePool"]
    assert children[0]["spec"]["endpointPickerRef"]["name"] == "llm-d-epp"
    assert children[0]["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert admitted(children[0], schema("inferencepool.v1.schema.yaml")) == []
    args = engine_args(external)
    assert args[args.index("--metrics-compat") + 1] == "vllm"
    with pytest.raises(SpecError, match="endpointPickerRef.name"):
        spec(inferencePool=True, endpointPicker="external")


def test_no_pool_asked_for_renders_nothing_new() -> None:
    plain = spec()
    assert render_gateway_children(OWNER, plain) == []
    assert "--metrics-compat" not in engine_args(plain)
    assert all(c["kind"] not in ("InferencePool", "HTTPRoute")
               for c in render_children(OWNER, plain, 1))


def test_pd_through_the_gateway_puts_a_sidecar_on_the_decode_pods_and_the_picker_on_it() -> None:
    """spec.prefill with a pool: the picker gets the prefill Service and threshold (the
    router's flags) and picks the decode pods' sidecars; each decode pod runs
    `shoal route --pd-sidecar` in front of its engine; the prefill pods do not."""
    from shoal.runtime.router.cli import config_from_args
    from shoal.runtime.router.epp.app import build_picker

    from shoal.cli import build_parser

    pd = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                     "prefill": {"replicas": 1, "threshold": 128},
                     "routing": {"gateway": {"inferencePool": True}}})
    gateway = by_kind(render_gateway_children(OWNER, pd))
    assert gateway["InferencePool"]["spec"]["targetPorts"] == [{"number": 8001}]
    assert admitted(gateway["InferencePool"], schema("inferencepool.v1.schema.yaml")) == []
    picker_args = gateway["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    args = build_parser().parse_args([*picker_args, "--kube-api", "http://127.0.0.1:9"])
    prefill_url = "http://chat-prefill.serving.svc.cluster.local:8000"
    assert (args.epp, args.engine_port, args.engine_metrics_port, args.prefill_service,
            args.pd_threshold) == (True, 8001, 8002, "chat-prefill", 128)
    picker, _ = build_picker(config_from_args(args), None)
    assert picker.prefill_pool is not None and picker.pd_threshold == 128

    deployments = {c["metadata"]["name"]: c for c in render_children(OWNER, pd, 1)
                   if c["kind"] == "Deployment"}
    decode = deployments["chat-engine"]["spec"]["template"]["spec"]
    assert [c["name"] for c in decode["containers"]] == ["engine", "pd-sidecar"]
    sidecar = decode["containers"][1]
    parsed = build_parser().parse_args(sidecar["args"])
    assert (parsed.pd_sidecar, parsed.port, parsed.backend, parsed.prefill_backend,
            parsed.prefill_service, parsed.namespace) == (
        True, 8001, ["http://127.0.0.1:8000"], [prefill_url], "chat-prefill", "serving")
    config_from_args(parsed).validate()
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8001}
    assert {"name": "pd-sidecar-tmp", "emptyDir": {}} in decode["volumes"]
    # the sidecar watches the prefill Service's EndpointSlices as the decode pods' own account,
    # whose token only the sidecar's container mounts (the engine's gets none)
    assert decode["serviceAccountName"] == "chat-pd-sidecar"
    assert decode["automountServiceAccountToken"] is False
    token = next(v for v in decode["volumes"] if v["name"] == "pd-sidecar-token")
    assert {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}} in \
        token["projected"]["sources"]
    mounts = {c["name"]: [m["mountPath"] for m in c.get("volumeMounts") or []]
              for c in decode["containers"]}
    sa_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert sa_dir in mounts["pd-sidecar"] and sa_dir not in mounts["engine"]
    rbac = {(c["kind"], c["metadata"]["name"]): c for c in render_children(OWNER, pd, 1)
            if c["metadata"]["name"] == "chat-pd-sidecar"}
    assert set(rbac) == {("ServiceAccount", "chat-pd-sidecar"), ("Role", "chat-pd-sidecar"),
                         ("RoleBinding", "chat-pd-sidecar")}
    assert rbac[("Role", "chat-pd-sidecar")]["rules"] == [{
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"]}]
    prefill = deployments["chat-prefill"]["spec"]["template"]["spec"]
    assert [c["name"] for c in prefill["containers"]] == ["engine"]
    # without a pool the router does P/D itself: no sidecar
    plain = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                        "prefill": {"replicas": 1}})
    engines = [c for c in render_children(OWNER, plain, 1) if c["kind"] == "Deployment"
               and c["metadata"]["name"] == "chat-engine"]
    assert [c["name"] for c in engines[0]["spec"]["template"]["spec"]["containers"]] == ["engine"]


def test_a_picker_over_a_prefill_pool_that_scales_to_zero_may_ask_for_it() -> None:
    """spec.prefill.autoscaling.minReplicas 0 through the gateway: Shoal's picker keeps
    --capacity-request (it holds nothing: --hold-timeout stays the proxy's) and its Role may
    patch this one InferenceService; with a fixed prefill pool it gets neither."""
    base = {"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
            "routing": {"gateway": {"inferencePool": True}}}

    def picker(spec: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
        children = render_gateway_children(OWNER, parse_spec(spec))
        deployment = next(c for c in children if c["kind"] == "Deployment")
        role = next(c for c in children if c["kind"] == "Role")
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"], role["rules"]

    args, rules = picker({**base, "prefill": {"autoscaling": {"minReplicas": 0,
                                                               "maxReplicas": 2}}})
    assert args[args.index("--capacity-request") + 1] == "chat"
    assert "--hold-timeout" not in args
    assert {"apiGroups": ["serving.shoal.dev"], "resources": ["inferenceservices"],
            "resourceNames": ["chat"], "verbs": ["get", "patch"]} in rules
    args, rules = picker({**base, "prefill": {"replicas": 1}})
    assert "--capacity-request" not in args and len(rules) == 1
