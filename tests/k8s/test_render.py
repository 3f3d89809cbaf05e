"""Rendering is pure: spec in, manifests out. Each manifest must be valid Kubernetes and carry
the behaviour the issue asks for (readiness gate, probes, drain, security, weight fetch)."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from shoal.operator.names import ENGINE_READY_CONDITION, Owner
from shoal.operator.render.children import render_children
from shoal.operator.render.engine import render_engine_deployment
from shoal.operator.render.probes import STARTUP_PERIOD_SECONDS
from shoal.operator.render.router import router_args
from shoal.operator.spec.service import parse_spec

ROOT = Path(__file__).parents[2]
OWNER = Owner(name="qwen", namespace="ml", uid="0d7c5e1c-uid")


def example_spec(name: str) -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "examples" / name).read_text())
    return next(d for d in docs if d["kind"] == "InferenceService")["spec"]


def engine(spec: dict[str, Any], replicas: int = 2) -> dict[str, Any]:
    return render_engine_deployment(OWNER, parse_spec(spec), replicas)


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return pod_spec(deployment)["containers"][0]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("example", ["gpu-qwen.yaml", "cpu-demo.yaml"])
def test_every_child_is_valid_kubernetes(example: str) -> None:
    spec = parse_spec(example_spec(example))
    children = render_children(OWNER, spec, 3)
    for child in children:
        if child["kind"] == "ServiceMonitor":  # a CRD of the Prometheus Operator: no schema here
            assert child["spec"]["endpoints"][0]["path"] == "/metrics"
            continue
        kubernetes_validate.validate(child, "1.30.0", strict=True)
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
                         "name": "qwen", "uid": OWNER.uid, "controller": True,
                         "blockOwnerDeletion": True}]
        assert child["metadata"]["namespace"] == "ml"
    keys = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(keys) == len(set(keys)), "two children with one name"


def test_engine_pods_carry_the_readiness_gate_and_probes_sized_from_the_startup_budget() -> None:
    dep = engine(example_spec("gpu-qwen.yaml"))
    assert pod_spec(dep)["readinessGates"] == [{"conditionType": ENGINE_READY_CONDITION}]
    container = engine_container(dep)
    startup = container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert startup["periodSeconds"] == STARTUP_PERIOD_SECONDS
    assert 3600 <= budget < 3600 + STARTUP_PERIOD_SECONDS
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["periodSeconds"] <= 5  # aggressive
    assert container["livenessProbe"]["failureThreshold"] * \
        container["livenessProbe"]["periodSeconds"] >= 30  # lenient: restarts reload weights


def test_drain_on_termination() -> None:
    spec = example_spec("cpu-demo.yaml")
    spec["runtime"]["shutdownTimeoutSeconds"] = 90
    dep = engine(spec)
    container = engine_container(dep)
    assert flag(container["args"], "--shutdown-timeout") == "90"
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1].startswith("sleep ")
    assert pod_spec(dep)["terminationGracePeriodSeconds"] > 90 + 5


def test_engine_runs_unprivileged_with_a_read_only_root() -> None:
    dep = engine(example_spec("gpu-qwen.yaml"))
    pod = pod_spec(dep)
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"] + pod.get("initContainers", []):
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"]["drop"] == ["ALL"]
    writable = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/tmp", "/models", "/dev/shm"} <= writable


def test_hf_weights_are_fetched_into_the_cache_pvc_by_an_init_container() -> None:
    dep = engine(example_spec("gpu-qwen.yaml"))
    pod = pod_spec(dep)
    (fetch,) = pod["initContainers"]
    repo, revision, target = fetch["args"]
    assert (repo, revision) == ("Qwen/Qwen3-8B", "main")
    assert flag(pod["containers"][0]["args"], "--model") == target
    assert target.startswith("/models/")
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"]["claimName"] == "qwen-model-cache"
    assert {"name": "model-cache", "mountPath": "/models"} in fetch["volumeMounts"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"  # the engine never downloads itself


def test_pvc_model_is_mounted_read_only_and_needs_no_fetch() -> None:
    dep = engine({"model": {"uri": "pvc://weights/llama/8b"}})
    pod = pod_spec(dep)
    assert "initContainers" not in pod
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert flag(pod["containers"][0]["args"], "--model") == "/mnt/model/llama/8b"


def test_path_and_builtin_models() -> None:
    assert flag(engine_container(engine({"model": {"uri": "/opt/model"}}))["args"],
                "--model") == "/opt/model"
    assert "--model" not in engine_container(engine({"model": {"uri": "builtin://default"}}))[
        "args"]


def test_engine_flags_follow_the_spec() -> None:
    spec = {"model": {"uri": "hf://org/m", "servedName": "m"},
            "runtime": {"maxModelLen": 4096, "maxNumSeqs": 64, "maxNumBatchedTokens": 2048,
                        "gpuMemoryUtilization": 0.85, "blockSize": 32, "prefixCaching": False,
                        "dtype": "bfloat16", "enforceEager": True, "extraArgs": ["--seed", "7"]},
            "resources": {"gpus": 4, "memory": "80Gi"}}
    container = engine_container(engine(spec))
    args = container["args"]
    assert args[0] == "serve"
    expected = {"--served-model-name": "m", "--max-model-len": "4096", "--max-num-seqs": "64",
                "--max-num-batched-tokens": "2048", "--gpu-memory-utilization": "0.85",
                "--block-size": "32", "--dtype": "bfloat16", "--tensor-parallel-size": "4",
                "--port": "8000", "--host": "0.0.0.0"}
    assert {k: flag(args, k) for k in expected} == expected
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
    assert args[-2:] == ["--seed", "7"]
    assert container["resources"]["limits"] == {"memory": "80Gi", "nvidia.com/gpu": "4"}


def test_cpu_replicas_ask_for_no_gpu() -> None:
    container = engine_container(engine(example_spec("cpu-demo.yaml")))
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert flag(container["args"], "--device") == "cpu"


def test_engine_args_parse_with_the_real_shoal_serve() -> None:
    serve_cli = pytest.importorskip("shoal.runtime.api.cli",
                                    reason="shoal serve not in this checkout yet")
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers(dest="command"))
    args = engine_container(engine(example_spec("gpu-qwen.yaml")))["args"]
    parser.parse_args(args)


def test_router_args_parse_with_the_real_shoal_route() -> None:
    route_cli = pytest.importorskip("shoal.runtime.router.cli")
    parser = argparse.ArgumentParser()
    route_cli.register(parser.add_subparsers(dest="command"))
    spec = parse_spec({"model": {"uri": "hf://org/m@v2"}, "runtime": {"blockSize": 32},
                       "routing": {"policy": "least-load"}})
    parsed = parser.parse_args(router_args(OWNER, spec))
    assert (parsed.policy, parsed.discovery, parsed.namespace, parsed.service,
            parsed.engine_port, parsed.block_size, parsed.model_revision) == (
        "least-load", "kubernetes", "ml", "qwen-engine", 8000, 32, "v2")
    # the engines hash blocks with the same size and revision
    engine_args = engine_container(engine({"model": {"uri": "hf://org/m@v2"},
                                           "runtime": {"blockSize": 32}}))["args"]
    assert (flag(engine_args, "--block-size"), flag(engine_args, "--model-revision")) == (
        "32", "v2")


def route_parser() -> argparse.ArgumentParser:
    route_cli = pytest.importorskip("shoal.runtime.router.cli")
    parser = argparse.ArgumentParser()
    route_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_cache_affinity_deploys_the_precise_mode() -> None:
    """The default routing is the best one: the engines publish KV events on the port the
    router subscribes to, and the router takes the engines' tokenizer from them."""
    spec = {"model": {"uri": "hf://org/m"}}
    parsed = route_parser().parse_args(router_args(OWNER, parse_spec(spec)))
    assert (parsed.policy, parsed.kv_events, parsed.tokenizer_from_engine, parsed.tokenizer) \
        == ("cache-affinity", True, True, None)
    container = engine_container(engine(spec))
    assert flag(container["args"], "--kv-events-endpoint") == f"tcp://*:{parsed.kv_events_port}"
    assert {"name": "kv-events", "containerPort": parsed.kv_events_port,
            "protocol": "TCP"} in container["ports"]
    for off in ({"routing": {"policy": "least-load"}}, {"routing": {"enabled": False}},
                {"runtime": {"prefixCaching": False}}):
        other = {**spec, **off}
        assert "--kv-events-endpoint" not in engine_container(engine(other))["args"]
        assert "--kv-events" not in router_args(OWNER, parse_spec(other))


def test_routing_off_points_the_service_at_the_engines() -> None:
    spec = parse_spec({"model": {"uri": "hf://org/m"}, "routing": {"enabled": False}})
    children = render_children(OWNER, spec, 1)
    assert not [c for c in children if c["metadata"]["name"] == "qwen-router"]
    frontend = next(c for c in children if c["kind"] == "Service"
                    and c["metadata"]["name"] == "qwen")
    assert frontend["spec"]["selector"]["serving.shoal.dev/component"] == "engine"
    assert frontend["spec"]["ports"][0]["targetPort"] == 8000


def test_router_has_read_only_endpointslice_access_in_its_namespace() -> None:
    children = render_children(OWNER, parse_spec({"model": {"uri": "hf://org/m"}}), 1)
    role = next(c for c in children if c["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    router = next(c for c in children if c["kind"] == "Deployment"
                  and c["metadata"]["name"] == "qwen-router")
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "qwen-router"


def test_headless_service_and_pdb_select_the_engine_pods() -> None:
    children = render_children(OWNER, parse_spec({"model": {"uri": "hf://org/m"}}), 2)
    engine_labels = next(c for c in children if c["kind"] == "Deployment")["spec"][
        "template"]["metadata"]["labels"]
    headless = next(c for c in children if c["kind"] == "Service"
                    and c["metadata"]["name"] == "qwen-engine")
    pdb = next(c for c in children if c["kind"] == "PodDisruptionBudget")
    assert headless["spec"]["clusterIP"] == "None"
    for selector in (headless["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= engine_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_template_hash_tracks_the_pod_spec_only() -> None:
    base = {"model": {"uri": "hf://org/m"}}
    changed = copy.deepcopy(base) | {"runtime": {"maxNumSeqs": 8}}

    def hash_of(spec: dict[str, Any], replicas: int) -> str:
        return engine(spec, replicas)["spec"]["template"]["metadata"]["annotations"][
            "serving.shoal.dev/template-hash"]
    assert hash_of(base, 1) == hash_of(base, 5)  # scaling is not a rollout
    assert hash_of(base, 1) != hash_of(changed, 1)


def test_scheduling() -> None:
    dep = engine(example_spec("gpu-qwen.yaml"))
    pod = pod_spec(dep)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_engine_metrics_are_scraped_on_their_own_port() -> None:
    """Prometheus needs no API key: it scrapes the engines' --metrics-port, named metrics."""
    from shoal.operator.render.extras import render_service_monitor

    container = engine_container(engine({"model": {"uri": "hf://org/m"}}))
    port = flag(container["args"], "--metrics-port")
    assert {"name": "metrics", "containerPort": int(port or 0), "protocol": "TCP"} \
        in container["ports"]
    children = render_children(OWNER, parse_spec({"model": {"uri": "hf://org/m"}}), 2)
    headless = next(c for c in children if c["kind"] == "Service"
                    and c["metadata"]["name"] == "qwen-engine")
    assert "metrics" in [p["name"] for p in headless["spec"]["ports"]]
    monitor = render_service_monitor(OWNER)
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
