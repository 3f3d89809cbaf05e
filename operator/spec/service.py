"""InferenceService spec as typed dataclasses, parsed with the CRD's defaults and rules.

The API server already enforces the CRD schema and its CEL rules; parsing again here keeps the
operator honest against servers that do not (and gives each error the field's path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.operator.names import DEFAULT_RUNTIME_IMAGE
from shoal.operator.spec.adapters import LoraSpec, parse_adapters
from shoal.operator.spec.model_uri import ModelSource, ModelUriError, parse_model_uri
from shoal.operator.spec.reader import SpecError, SpecReader

from shoal.contract.kv import DEFAULT_BLOCK_SIZE
from shoal.contract.policies import DEFAULT_ROUTING_POLICY, ROUTING_POLICIES

DTYPES = ("auto", "float16", "bfloat16", "float32")
DEVICES = ("auto", "cuda", "cpu")
CACHE_SHARING = ("tenant", "global")


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    source: ModelSource
    served_name: str
    hf_token_secret: str | None = None


@dataclass(frozen=True)
class RuntimeSpec:
    image: str = DEFAULT_RUNTIME_IMAGE
    image_pull_policy: str = "IfNotPresent"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    max_queued_requests: int | None = None
    shutdown_timeout_seconds: int = 30
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1  # per replica = tensor-parallel size
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int = 1
    max_replicas: int = 1
    target_kv_cache_usage: float = 0.8
    target_waiting_requests: float = 4.0
    scale_down_delay_seconds: int = 300
    scale_to_zero_after_seconds: int = 300  # minReplicas 0: idle this long -> 0 replicas
    hold_timeout_seconds: int = 300  # minReplicas 0: the router holds requests this long

    @property
    def scales_to_zero(self) -> bool:
        return self.min_replicas == 0


ENDPOINT_PICKERS = ("shoal", "external")
FAILURE_MODES = ("FailClose", "FailOpen")


@dataclass(frozen=True)
class GatewaySpec:
    """spec.routing.gateway: serve through a Gateway API inference gateway (InferencePool)."""

    inference_pool: bool = False
    endpoint_picker: str = "shoal"  # shoal: the operator runs `shoal route --epp`
    picker_service: str | None = None  # external: the EPP's Service name ...
    picker_port: int = 9002  # ... and port
    failure_mode: str = "FailClose"
    gateway_name: str | None = None  # the Gateway an HTTPRoute attaches to (None: no route)
    gateway_namespace: str | None = None


@dataclass(frozen=True)
class RoutingSpec:
    enabled: bool = True
    policy: str = "cache-affinity"
    replicas: int = 1
    gateway: GatewaySpec = GatewaySpec()


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None


@dataclass(frozen=True)
class StorageSpec:
    claim_name: str | None = None  # an existing PVC
    size: str | None = None  # or: the operator creates <name>-model-cache of this size
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteMany"


@dataclass(frozen=True)
class SecretKey:
    name: str
    key: str


@dataclass(frozen=True)
class AuthSpec:
    """spec.auth: the clients' keys (one per line, each a tenant) and, with a router, the
    router's own key towards the engines (so the engines can trust its tenant header)."""
    api_keys: SecretKey
    upstream_key: SecretKey
    cache_sharing: str = "tenant"


DEFAULT_PD_THRESHOLD = 256  # the router's --pd-threshold default


@dataclass(frozen=True)
class PrefillSpec:
    """spec.prefill: a pool of prefill engines beside the decode pool (P/D disaggregation)."""
    replicas: int = 1
    resources: ResourcesSpec = ResourcesSpec()  # defaults to spec.resources
    threshold: int = DEFAULT_PD_THRESHOLD  # uncached prompt tokens above which prefill runs
    # the built-in autoscaler on the prefill pool's own queue and KV usage; None: fixed size
    autoscaling: AutoscalingSpec | None = None


@dataclass(frozen=True)
class ServiceSpec:
    model: ModelSpec
    runtime: RuntimeSpec
    resources: ResourcesSpec
    replicas: int
    autoscaling: AutoscalingSpec | None
    routing: RoutingSpec
    startup_timeout_seconds: int
    scheduling: SchedulingSpec
    storage: StorageSpec | None
    auth: AuthSpec | None
    service_monitor: bool
    lora: LoraSpec | None = None  # spec.adapters / spec.lora; None: LoRA off
    prefill: PrefillSpec | None = None  # None: one pool computes prompts and decodes


def parse_spec(spec: dict[str, Any]) -> ServiceSpec:
    root = SpecReader(spec, "spec")
    model = _parse_model(root.sub("model"))
    runtime = _parse_runtime(root.sub("runtime"))
    resources = _parse_resources(root.sub("resources"), runtime)
    autoscaling, replicas = _parse_scaled_replicas(root)
    rt = root.sub("routing")
    routing = RoutingSpec(
        enabled=rt.boolean("enabled", True),
        policy=rt.string("policy", DEFAULT_ROUTING_POLICY, ROUTING_POLICIES)
        or DEFAULT_ROUTING_POLICY,
        replicas=rt.integer("replicas", 1, minimum=1) or 1,
        gateway=_parse_gateway(rt.sub("gateway")),
    )
    if autoscaling is not None and autoscaling.scales_to_zero and not routing.enabled:
        raise SpecError("spec.autoscaling.minReplicas",
                        "0 needs spec.routing.enabled: the router holds requests while no "
                        "engine runs and asks for one")
    startup = root.sub("startup").integer("timeoutSeconds", 1800, minimum=30, maximum=86400)
    sch = root.sub("scheduling")
    tolerations = sch.data.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise SpecError("spec.scheduling.tolerations", "must be a list of objects")
    node_selector = sch.data.get("nodeSelector") or {}
    if not isinstance(node_selector, dict):
        raise SpecError("spec.scheduling.nodeSelector", "must be a map of strings")
    scheduling = SchedulingSpec(
        node_selector={str(k): str(v) for k, v in node_selector.items()},
        tolerations=tuple(tolerations),
        affinity=sch.data.get("affinity"),
        priority_class_name=sch.string("priorityClassName", None),
    )
    storage = _parse_storage(root.sub("storage")) if root.has("storage") else None
    auth = _parse_auth(root.sub("auth")) if root.has("auth") else None
    lora = parse_adapters(spec.get("adapters"), spec.get("lora"), model.served_name)
    if lora is not None and resources.gpus > 1:
        raise SpecError("spec.adapters", "LoRA adapters need resources.gpus <= 1 (the engine "
                        "does not run adapters under tensor parallelism yet)")
    prefill = _parse_prefill(root.sub("prefill"), runtime, resources, routing, lora) \
        if root.has("prefill") else None
    return ServiceSpec(
        model=model, runtime=runtime, resources=resources, replicas=replicas, prefill=prefill,
        autoscaling=autoscaling, routing=routing, startup_timeout_seconds=startup or 1800,
        scheduling=scheduling, storage=storage, auth=auth,
        service_monitor=root.sub("monitoring").boolean("serviceMonitor", False),
        lora=lora,
    )


def _parse_resources(res: SpecReader, runtime: RuntimeSpec) -> ResourcesSpec:
    resources = ResourcesSpec(
        gpus=res.integer("gpus", 1, minimum=0, maximum=64) or 0,
        gpu_resource_name=res.string("gpuResourceName", "nvidia.com/gpu") or "nvidia.com/gpu",
        cpu=_quantity(res, "cpu"),
        memory=_quantity(res, "memory"),
    )
    if resources.gpus == 0 and runtime.device == "cuda":
        raise SpecError(f"{res.path}.gpus", "must be >= 1 when spec.runtime.device is cuda")
    return resources


def _parse_prefill(p: SpecReader, runtime: RuntimeSpec, decode: ResourcesSpec,
                   routing: RoutingSpec, lora: LoraSpec | None) -> PrefillSpec:
    """The router picks the decode replica by its cached prefix, then sends long uncached
    prompts through a prefill engine whose blocks the decode engine pulls (one rank only)."""
    resources = _parse_resources(p.sub("resources"), runtime) if p.has("resources") else decode
    if not routing.enabled or routing.policy != "cache-affinity":
        raise SpecError("spec.prefill", "needs spec.routing.enabled with policy cache-affinity "
                        "(the router decides per request whether a prefill engine runs)")
    autoscaling, replicas = _parse_scaled_replicas(p)
    if autoscaling is not None and autoscaling.scales_to_zero and \
            routing.gateway.inference_pool and routing.gateway.endpoint_picker == "external":
        raise SpecError("spec.prefill.autoscaling.minReplicas",
                        "0 needs Shoal's router or Endpoint Picker: an external picker does "
                        "not ask for a prefill replica, so the pool would stay at 0")
    if decode.gpus > 1 or resources.gpus > 1:
        raise SpecError("spec.prefill", "KV transfer runs on one rank: resources.gpus <= 1 "
                        "in both pools")
    if lora is not None:
        raise SpecError("spec.prefill", "LoRA adapters with a prefill pool are not supported")
    return PrefillSpec(
        replicas=replicas, resources=resources, autoscaling=autoscaling,
        threshold=p.integer("threshold", DEFAULT_PD_THRESHOLD, minimum=0) or 0)


def _parse_scaled_replicas(pool: SpecReader) -> tuple[AutoscalingSpec | None, int]:
    """A pool's autoscaling and replicas (spec or spec.prefill): with autoscaling and no
    replicas yet, the pool starts at the minimum (the autoscaler writes replicas after)."""
    autoscaling = _parse_autoscaling(pool.sub("autoscaling")) if pool.has("autoscaling") \
        else None
    default_replicas = autoscaling.min_replicas if autoscaling is not None else 1
    replicas = pool.integer("replicas", default_replicas, minimum=0) or 0
    if autoscaling is not None and pool.has("replicas"):
        if not autoscaling.min_replicas <= replicas <= autoscaling.max_replicas:
            raise SpecError(f"{pool.path}.replicas",
                            "must lie within autoscaling min/max replicas")
    return autoscaling, replicas


def _secret_key(ref: SpecReader, at: str, default_name: str | None,
                default_key: str) -> SecretKey:
    name = ref.string("name", default_name)
    if not name:
        raise SpecError(f"{at}.name", "is required")
    return SecretKey(name, ref.string("key", default_key) or default_key)


def _parse_auth(a: SpecReader) -> AuthSpec:
    keys = _secret_key(a.sub("apiKeySecretRef"), "spec.auth.apiKeySecretRef", None, "api-key")
    # by default the router's key sits in the same Secret, under upstream-api-key
    upstream = _secret_key(a.sub("upstreamKeySecretRef"), "spec.auth.upstreamKeySecretRef",
                           keys.name, "upstream-api-key")
    if upstream == keys:
        raise SpecError("spec.auth.upstreamKeySecretRef",
                        "must differ from apiKeySecretRef: a client key must not be the "
                        "router's (it could claim any tenant at an engine)")
    return AuthSpec(api_keys=keys, upstream_key=upstream,
                    cache_sharing=a.string("cacheSharing", "tenant", CACHE_SHARING) or "tenant")


def _parse_model(m: SpecReader) -> ModelSpec:
    uri = m.string("uri", None)
    if not uri:
        raise SpecError("spec.model.uri", "is required")
    try:
        source = parse_model_uri(uri)
    except ModelUriError as exc:
        raise SpecError("spec.model.uri", str(exc)) from exc
    token = m.sub("hfTokenSecretRef").string("name", None)
    return ModelSpec(uri=uri, source=source,
                     served_name=m.string("servedName", None) or source.default_served_name,
                     hf_token_secret=token)


def _parse_runtime(r: SpecReader) -> RuntimeSpec:
    env = r.data.get("env") or []
    if not isinstance(env, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) for e in env
    ):
        raise SpecError("spec.runtime.env", "must be a list of {name, value}")
    return RuntimeSpec(
        image=r.string("image", DEFAULT_RUNTIME_IMAGE) or DEFAULT_RUNTIME_IMAGE,
        image_pull_policy=r.string("imagePullPolicy", "IfNotPresent",
                                   ("Always", "IfNotPresent", "Never")) or "IfNotPresent",
        max_model_len=r.integer("maxModelLen", None, minimum=16),
        max_num_seqs=r.integer("maxNumSeqs", None, minimum=1),
        max_num_batched_tokens=r.integer("maxNumBatchedTokens", None, minimum=16),
        gpu_memory_utilization=r.number("gpuMemoryUtilization", None, 0.0, 1.0, low_open=True),
        block_size=r.integer("blockSize", DEFAULT_BLOCK_SIZE, minimum=1, maximum=256)
        or DEFAULT_BLOCK_SIZE,
        prefix_caching=r.boolean("prefixCaching", True),
        dtype=r.string("dtype", "auto", DTYPES) or "auto",
        device=r.string("device", "auto", DEVICES) or "auto",
        enforce_eager=r.boolean("enforceEager", False),
        max_queued_requests=r.integer("maxQueuedRequests", None, minimum=1),
        shutdown_timeout_seconds=r.integer("shutdownTimeoutSeconds", 30, minimum=0,
                                           maximum=3600) or 0,
        extra_args=r.strings("extraArgs"),
        env=tuple((e["name"], str(e.get("value", ""))) for e in env),
    )


def _parse_autoscaling(a: SpecReader) -> AutoscalingSpec:
    low = a.integer("minReplicas", 1, minimum=0) or 0
    high = a.integer("maxReplicas", None, minimum=1)
    if high is None:
        raise SpecError(f"{a.path}.maxReplicas", "is required")
    if low > high:
        raise SpecError(f"{a.path}.minReplicas",
                        f"must be <= {a.path}.maxReplicas ({low} > {high})")
    return AutoscalingSpec(
        min_replicas=low, max_replicas=high,
        target_kv_cache_usage=a.number("targetKVCacheUsage", 0.8, 0.0, 1.0, low_open=True) or 0.8,
        target_waiting_requests=a.number("targetWaitingRequests", 4.0, 0.0, 1e6, low_open=True)
        or 4.0,
        scale_down_delay_seconds=a.integer("scaleDownDelaySeconds", 300, minimum=0) or 0,
        scale_to_zero_after_seconds=a.integer("scaleToZeroAfterSeconds", 300, minimum=0) or 0,
        hold_timeout_seconds=a.integer("holdTimeoutSeconds", 300, minimum=1) or 300,
    )


def _parse_gateway(g: SpecReader) -> GatewaySpec:
    picker = g.string("endpointPicker", "shoal", ENDPOINT_PICKERS) or "shoal"
    ref, gateway = g.sub("endpointPickerRef"), g.sub("gatewayRef")
    service = ref.string("name", None)
    if picker == "external" and g.boolean("inferencePool", False) and not service:
        raise SpecError("spec.routing.gateway.endpointPickerRef.name",
                        "is required when endpointPicker is external")
    gateway_name = gateway.string("name", None)
    if gateway.data and not gateway_name:
        raise SpecError("spec.routing.gateway.gatewayRef.name", "is required")
    return GatewaySpec(
        inference_pool=g.boolean("inferencePool", False), endpoint_picker=picker,
        picker_service=service,
        picker_port=ref.integer("port", 9002, minimum=1, maximum=65535) or 9002,
        failure_mode=ref.string("failureMode", "FailClose", FAILURE_MODES) or "FailClose",
        gateway_name=gateway_name, gateway_namespace=gateway.string("namespace", None))


def _parse_storage(s: SpecReader) -> StorageSpec:
    claim, size = s.string("claimName", None), _quantity(s, "size")
    if bool(claim) == bool(size):
        raise SpecError("spec.storage", "set exactly one of claimName and size")
    return StorageSpec(
        claim_name=claim, size=size, storage_class_name=s.string("storageClassName", None),
        access_mode=s.string("accessMode", "ReadWriteMany",
                             ("ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany")) or "ReadWriteMany",
    )


def _quantity(r: SpecReader, key: str) -> str | None:
    value = r.data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str) or value == "":
        raise SpecError(f"{r.path}.{key}", f"must be a quantity such as 8 or 16Gi, got {value!r}")
    return str(value)
