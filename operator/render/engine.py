"""Pure rendering of the engine: Deployment (pods with the readiness gate) and headless Service."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from shoal.operator.names import (
    ANNOTATION_TEMPLATE_HASH,
    COMPONENT_ENGINE,
    ENGINE_CONTAINER,
    ENGINE_METRICS_PORT,
    ENGINE_PORT,
    ENGINE_READY_CONDITION,
    FETCH_CONTAINER,
    KV_EVENTS_PORT,
    KV_TRANSFER_PORT,
    LABEL_ROLE,
    Owner,
    cache_claim_name,
    child_metadata,
    engine_name,
    engine_selector,
    pd_sidecar_name,
    prefill_name,
    selector_labels,
)
from shoal.operator.render.auth import engine_auth_args, engine_auth_volume
from shoal.operator.render.pd import (
    ROLE_DECODE,
    ROLE_PREFILL,
    kv_transfer_args,
    pod_ip_env,
    pool_component,
    pool_spec,
    render_pd_sidecar,
    wants_pd_sidecar,
)
from shoal.operator.render.probes import (
    PRESTOP_SLEEP_SECONDS,
    liveness_probe,
    readiness_probe,
    startup_probe,
    termination_grace_seconds,
)
from shoal.operator.spec.adapters import adapter_volumes, lora_engine_args, lora_engine_env
from shoal.operator.spec.service import ServiceSpec

CACHE_MOUNT = "/models"  # weight cache (PVC or emptyDir): the runtime image's SHOAL_CACHE_DIR
PVC_MODEL_MOUNT = "/mnt/model"  # a pvc:// model's claim, read-only
RUN_AS_USER = 10001

# The init container fetches an hf:// snapshot once per (repo, revision) into the cache; a
# snapshot already complete there is not downloaded again.
_FETCH_SCRIPT = (
    "import os, sys\n"
    "from huggingface_hub import snapshot_download\n"
    "repo, revision, target = sys.argv[1:4]\n"
    "snapshot_download(repo_id=repo, revision=revision or None, local_dir=target,\n"
    "                  token=os.environ.get('HF_TOKEN') or None)\n"
    "print('fetched', repo, revision or 'main', 'into', target)\n"
)


def engine_model_path(spec: ServiceSpec) -> str | None:
    """The --model value inside the pod (None: the runtime's embedded demo model)."""
    source = spec.model.source
    if source.scheme == "hf":
        return f"{CACHE_MOUNT}/models/{source.cache_dir_name}"
    if source.scheme == "pvc":
        return f"{PVC_MODEL_MOUNT}/{source.path}".rstrip("/")
    if source.scheme == "path":
        return source.path
    return None


def engine_args(spec: ServiceSpec, role: str = ROLE_DECODE) -> list[str]:
    """`shoal serve` flags (vLLM names) for one engine replica of the given pool."""
    rt = spec.runtime
    args = ["serve", "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
            "--metrics-port", str(ENGINE_METRICS_PORT),
            "--served-model-name", spec.model.served_name]
    model = engine_model_path(spec)
    if model is not None:
        args += ["--model", model]
    if spec.model.source.revision:  # part of every block hash: a new revision reuses no KV
        args += ["--model-revision", spec.model.source.revision]
    optional: list[tuple[str, object | None]] = [
        ("--max-model-len", rt.max_model_len),
        ("--max-num-seqs", rt.max_num_seqs),
        ("--max-num-batched-tokens", rt.max_num_batched_tokens),
        ("--gpu-memory-utilization", rt.gpu_memory_utilization),
        ("--max-queued-requests", rt.max_queued_requests),
    ]
    args += [item for flag, value in optional if value is not None for item in (flag, str(value))]
    args += ["--block-size", str(rt.block_size)]
    args.append("--enable-prefix-caching" if rt.prefix_caching else "--no-enable-prefix-caching")
    if rt.dtype != "auto":
        args += ["--dtype", rt.dtype]
    if rt.device != "auto":
        args += ["--device", rt.device]
    elif spec.resources.gpus == 0:
        args += ["--device", "cpu"]
    if spec.resources.gpus > 1:
        args += ["--tensor-parallel-size", str(spec.resources.gpus)]
    if rt.enforce_eager:
        args.append("--enforce-eager")
    args += engine_auth_args(spec)
    args += ["--shutdown-timeout", str(rt.shutdown_timeout_seconds)]
    if spec.routing.gateway.inference_pool:  # the metric names inference-gateway pickers read
        args += ["--metrics-compat", "vllm"]
    # the router follows the decode engines' real caches (it never picks a prefill engine so)
    if publishes_kv_events(spec) and role == ROLE_DECODE:
        args += ["--kv-events-endpoint", f"tcp://*:{KV_EVENTS_PORT}"]
    # without spec.auth the adapters are loaded into running engines (adapters.py) and a
    # change of spec.adapters never changes the pod template; with it they are flags here
    args += lora_engine_args(spec.lora, spec.auth is not None)
    args += kv_transfer_args(spec, role)
    return args + list(rt.extra_args)


def publishes_kv_events(spec: ServiceSpec) -> bool:
    """Precise cache affinity: the engines publish KV events and the router (render/router.py)
    follows them, hashing prompts with the engines' own tokenizer. Without prefix caching
    there is nothing to follow."""
    return spec.routing.enabled and spec.routing.policy == "cache-affinity" \
        and spec.runtime.prefix_caching


def _resources(spec: ServiceSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu is not None:
        requests["cpu"] = res.cpu
    if res.memory is not None:
        requests["memory"] = limits["memory"] = res.memory
    if res.gpus > 0:
        requests[res.gpu_resource_name] = limits[res.gpu_resource_name] = str(res.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _volumes(owner: Owner, spec: ServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if spec.storage is None:
        cache: dict[str, Any] = {"name": "model-cache", "emptyDir": {}}
    else:
        claim = spec.storage.claim_name or cache_claim_name(owner)
        cache = {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}
    volumes = [
        cache,
        {"name": "tmp", "emptyDir": {}},
        # NCCL and torch worker processes exchange tensors through /dev/shm
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": CACHE_MOUNT},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if spec.model.source.scheme == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": spec.model.source.claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": PVC_MODEL_MOUNT, "readOnly": True})
    adapter_vols, adapter_mounts = adapter_volumes(spec.lora, None)
    return volumes + adapter_vols, mounts + adapter_mounts


def _engine_container_mounts(spec: ServiceSpec, mounts: list[dict[str, Any]]
                             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(extra volumes, the engine container's mounts): the key file is the engine's alone,
    the weight fetcher does not see it."""
    auth = engine_auth_volume(spec)
    if auth is None:
        return [], mounts
    return [auth[0]], mounts + [auth[1]]


def _env(spec: ServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "SHOAL_CACHE_DIR", "value": CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},  # weights are fetched by the init container
    ]
    env += lora_engine_env(spec.lora, spec.auth is not None)
    env += [{"name": name, "value": value} for name, value in spec.runtime.env]
    return env


def _fetch_init_container(spec: ServiceSpec, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    source = spec.model.source
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
    ]
    if spec.model.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": spec.model.hf_token_secret, "key": "token"}}})
    return {
        "name": FETCH_CONTAINER,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["python", "-c", _FETCH_SCRIPT],
        "args": [source.repo, source.revision, engine_model_path(spec)],
        "env": env,
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }


def template_hash(pod_spec: dict[str, Any]) -> str:
    canonical = json.dumps(pod_spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def render_engine_deployment(owner: Owner, spec: ServiceSpec, replicas: int,
                             role: str = ROLE_DECODE) -> dict[str, Any]:
    """One pool's engines: the decode pool (the only one without spec.prefill) or the
    prefill pool (its own name, selector and resources; it serves KV blocks on its pod IP)."""
    prefill = role == ROLE_PREFILL
    spec = pool_spec(spec, role)
    selector = selector_labels(owner, pool_component(role))
    volumes, mounts = _volumes(owner, spec)
    auth_volumes, engine_mounts = _engine_container_mounts(spec, mounts)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["shoal"],
        "args": engine_args(spec, role),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ENGINE_METRICS_PORT,
                   "protocol": "TCP"}] + (
            [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}]
            if publishes_kv_events(spec) and not prefill else []) + (
            [{"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"}]
            if prefill else []),
        "env": ([pod_ip_env()] if prefill else []) + _env(spec),
        "resources": _resources(spec),
        "startupProbe": startup_probe(spec.startup_timeout_seconds),
        "livenessProbe": liveness_probe(),
        "readinessProbe": readiness_probe(),
        "lifecycle": {"preStop": {"exec": {
            "command": ["/bin/sh", "-c", f"sleep {PRESTOP_SLEEP_SECONDS}"]}}},
        "securityContext": container_security_context(),
        "volumeMounts": engine_mounts,
        # The engine's last log lines ("engine core process exited ...") become the
        # termination message the operator reports as the replica's lastFailure.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "readinessGates": [{"conditionType": ENGINE_READY_CONDITION}],
        "terminationGracePeriodSeconds": termination_grace_seconds(
            spec.runtime.shutdown_timeout_seconds),
        "securityContext": pod_security_context(),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes + auth_volumes,
    }
    if not prefill and wants_pd_sidecar(spec):
        sidecar, sidecar_volumes = render_pd_sidecar(owner, spec)
        pod_spec["containers"].append({**sidecar,
                                       "securityContext": container_security_context()})
        pod_spec["volumes"] += sidecar_volumes
        # its EndpointSlice reader; the token is mounted in the sidecar alone (above)
        pod_spec["serviceAccountName"] = pd_sidecar_name(owner)
    if spec.model.source.scheme == "hf":
        pod_spec["initContainers"] = [_fetch_init_container(spec, mounts)]
    sch = spec.scheduling
    if sch.node_selector:
        pod_spec["nodeSelector"] = dict(sch.node_selector)
    if sch.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in sch.tolerations]
    if sch.affinity:
        pod_spec["affinity"] = sch.affinity
    if sch.priority_class_name:
        pod_spec["priorityClassName"] = sch.priority_class_name
    name = prefill_name(owner) if prefill else engine_name(owner)
    metadata = child_metadata(owner, name, pool_component(role))
    pod_labels = dict(metadata["labels"])
    if spec.prefill is not None:
        pod_labels[LABEL_ROLE] = role
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # A new replica must be ready before an old one goes: no capacity dip on rollout.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 120,
            "template": {
                "metadata": {"labels": pod_labels,
                             "annotations": {ANNOTATION_TEMPLATE_HASH: template_hash(pod_spec)}},
                "spec": pod_spec,
            },
        },
    }


def render_engine_headless_service(owner: Owner) -> dict[str, Any]:
    """Per-pod DNS and EndpointSlices the router discovers engines from."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, engine_name(owner), COMPONENT_ENGINE),
        "spec": {
            "clusterIP": "None",
            "selector": engine_selector(owner),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http",
                       "protocol": "TCP"},
                      {"name": "metrics", "port": ENGINE_METRICS_PORT, "targetPort": "metrics",
                       "protocol": "TCP"}],
        },
    }
