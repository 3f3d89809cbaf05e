"""What ``shoal route`` is told (its flags as one dataclass), checked, for both modes: the
proxy (proxy/wiring.py) and the Endpoint Picker (epp/app.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.runtime.router.edge_auth import EdgeAuth, read_key_file

from shoal.contract.kv import DEFAULT_BLOCK_SIZE


@dataclass
class RouterConfig:
    policy: str = "cache-affinity"
    backends: list[str] = field(default_factory=list)
    discovery: str = "static"  # static | kubernetes
    namespace: str = "default"
    service: str = ""
    engine_port: int | None = None
    engine_metrics_port: int | None = None  # scrape engines' /metrics there (no key)
    kube_api: str | None = None  # out-of-cluster API server (tests, kubectl proxy)
    tokenizer: str | None = None
    tokenizer_from_engine: bool = False  # fetch the tokenizer from the first ready engine
    block_size: int = DEFAULT_BLOCK_SIZE
    model_revision: str = ""
    chars_per_block: int = 64
    cache_sharing: str = "tenant"  # the engines' --cache-sharing
    kv_events: bool = False
    kv_events_port: int = 5557
    health_interval: float = 1.0
    scrape_interval: float = 1.0
    load_factor: float = 1.25
    load_headroom: float = 2.0  # requests above the mean a replica may always hold
    approx_capacity: int = 50_000  # prefix blocks remembered per replica (approximate mode)
    max_attempts: int = 3
    hold_timeout: float = 0.0  # scale from zero: seconds a request waits for a ready replica
    hold_queue: int = 256
    hold_queue_bytes: int = 256 << 20
    capacity_request: str = ""  # InferenceService to annotate for capacity (kubernetes)
    api_keys: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    upstream_api_key: str | None = None
    upstream_api_key_file: str | None = None
    enable_debug: bool = False
    connect_timeout: float = 5.0
    first_byte_timeout: float = 300.0
    idle_timeout: float = 60.0
    stream_stall_timeout: float = 30.0
    quarantine_window: float = 60.0
    # P/D disaggregation (runtime/router/proxy/pd.py): prefill replicas, and the uncached prompt
    # tokens above which one computes the prompt before the decode replica
    prefill_backends: list[str] = field(default_factory=list)
    # ... and/or the ready endpoints of this Service (the prefill pods, by their own IPs)
    prefill_service: str = ""
    pd_threshold: int = 256
    # the decode side of the Endpoint Picker's P/D (llm-d's routing sidecar): in front of one
    # decode engine, the prefill leg runs on the replica the picker's header names
    pd_sidecar: bool = False

    def edge_auth(self) -> EdgeAuth:
        keys = list(self.api_keys)
        if self.api_key_file:
            keys += read_key_file(self.api_key_file)
        if any(not key for key in keys):
            raise ValueError("an --api-key is empty")
        upstream = self.upstream_api_key or None
        if self.upstream_api_key_file:
            if upstream is not None:
                raise ValueError("give --upstream-api-key or --upstream-api-key-file, not both")
            lines = read_key_file(self.upstream_api_key_file)
            if len(lines) != 1:
                raise ValueError("--upstream-api-key-file must hold exactly one key")
            upstream = lines[0]
        return EdgeAuth(tuple(keys), upstream)

    @property
    def pd(self) -> bool:
        """P/D: prefill replicas are given (fixed URLs or a Service's endpoints)."""
        return bool(self.prefill_backends or self.prefill_service)

    def validate(self) -> None:
        if self.discovery == "static" and not self.backends:
            raise ValueError("give at least one --backend URL, or --discovery kubernetes")
        if self.discovery == "kubernetes" and not self.service:
            raise ValueError("--discovery kubernetes needs --service")
        if self.discovery not in ("static", "kubernetes"):
            raise ValueError(f"unknown discovery {self.discovery!r}")
        if self.approx_capacity < 1:
            raise ValueError("--approx-capacity must be >= 1")
        if self.load_headroom < 1:
            raise ValueError("--load-headroom must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be >= 1")
        if self.capacity_request and self.discovery != "kubernetes":
            raise ValueError("--capacity-request needs --discovery kubernetes")
        if self.tokenizer and self.tokenizer_from_engine:
            raise ValueError("give --tokenizer DIR or --tokenizer-from-engine, not both")
        for flag, value in (("--connect-timeout", self.connect_timeout),
                            ("--first-byte-timeout", self.first_byte_timeout),
                            ("--idle-timeout", self.idle_timeout)):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0")
        if self.stream_stall_timeout < 0 or self.quarantine_window < 0:
            raise ValueError("--stream-stall-timeout and --quarantine-window must be >= 0")
        if self.pd and self.policy != "cache-affinity":
            raise ValueError("--prefill-backend/--prefill-service needs --policy "
                             "cache-affinity (the decode replica's cached prefix decides)")
        if self.pd_threshold < 0:
            raise ValueError("--pd-threshold must be >= 0")
        if self.pd_sidecar and (self.discovery != "static" or len(self.backends) != 1
                                or not self.pd):
            raise ValueError("--pd-sidecar fronts one decode engine (one --backend) and "
                             "needs --prefill-backend or --prefill-service: the prefill "
                             "addresses the picker's header may name")
        if self.kv_events and self.policy != "cache-affinity":
            raise ValueError("--kv-events only applies to --policy cache-affinity")
