"""The API process's state: settings, the engine client, tokenizer, metrics, live requests.

The readiness phase is the engine's startup phase ("starting", "loading", "profiling",
"capturing", "ready"), "draining" after SIGTERM, "dead" once the engine is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from msgspec.structs import replace
from shoal.runtime.config import DEFAULT_MAX_NUM_SEQS
from shoal.runtime.frontend.engine_client import AsyncEngineClient
from shoal.runtime.frontend.prompts import PromptRenderer
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.http_listener import RETRY_SAFE_HEADER
from shoal.runtime.lora_modules import LoraModule
from shoal.runtime.pooling_config import PoolerConfig
from shoal.runtime.sampling_params import DEFAULT_LIMITS, RequestLimits

from .admission import CompletionRate, decide
from .errors import APIError, bad_request, engine_unavailable
from .generation import Generation
from .metrics import ServerMetrics


@dataclass
class ServerSettings:
    model_dir: str
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    max_queued_requests: int = 1024
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 64
    limits: RequestLimits = DEFAULT_LIMITS  # the engine's vocabulary and length added when ready
    cache_sharing: str = "tenant"  # tenant | global
    tenant_header: str | None = None  # trusted header naming the tenant (set by the router)
    stream_stall_timeout: float = 30.0  # seconds one SSE write may block before the abort
    metrics_auth: bool = False  # /metrics on the main port requires the API key
    # request defaults from generation_config.json (--generation-config): temperature, ...
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: the <think> span split off
    enable_lora: bool = False  # the load/unload endpoints answer only with it
    # and with this: SHOAL_/VLLM_ALLOW_RUNTIME_LORA_UPDATING (lora_adapters.py)
    allow_runtime_lora_updating: bool = False
    lora_modules: list[LoraModule] = field(default_factory=list)  # served from the start
    pooler: PoolerConfig | None = None  # --runner pooling: /v1/embeddings only
    tool_call_parser: str | None = None  # --tool-call-parser; None: hermes and Llama 3 JSON
    model_type: str = ""  # config.json's (gpt_oss: harmony is read without the flags too)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass
class ServerState:
    settings: ServerSettings
    client: AsyncEngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    renderer: PromptRenderer
    draining: bool = False
    exit_code: int = 0
    live: set[Generation] = field(default_factory=set)
    completions: CompletionRate = field(default_factory=CompletionRate)
    adapters: dict[str, LoraModule] = field(default_factory=dict)  # name -> module

    def __post_init__(self) -> None:
        self.adapters.update({m.name: m for m in self.settings.lora_modules})
        if self.adapters:
            self.metrics.set_adapters(list(self.adapters))

    @property
    def phase(self) -> str:
        if self.client.is_dead:
            return "dead"
        if self.draining:
            return "draining"
        return self.client.phase

    @property
    def max_model_len(self) -> int:
        info = self.client.ready_info
        return info.max_model_len if info is not None else 0

    @property
    def quantization(self) -> str | None:
        """The served checkpoint's quantization method; None: full precision (or not ready)."""
        info = self.client.ready_info
        return (info.quantization or None) if info is not None else None

    @property
    def block_size(self) -> int:
        return self.client.config.block_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of tokens the KV cache holds for admission's estimate: with several KV
        cache groups a token block takes one block in each (at least: a sliding group holds
        fewer for a long request), so the pool's count over the groups."""
        info = self.client.ready_info
        return info.num_kv_blocks // max(info.kv_cache_groups, 1) if info is not None else 0

    @property
    def request_limits(self) -> RequestLimits:
        info = self.client.ready_info
        return replace(self.settings.limits,
                       vocab_size=info.vocab_size if info is not None else 0,
                       max_model_len=info.max_model_len if info is not None else 0,
                       max_tokens_within_context=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes one token stands for (its vocabulary entry's
        length: a byte-level or byte-fallback entry spells a byte with one or more
        characters), so a text of B bytes has at least B / max_token_bytes tokens."""
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        return max((len(piece.encode("utf-8", "replace")) for piece in vocab), default=1) or 1

    @property
    def eos_token_ids(self) -> list[int]:
        info = self.client.ready_info
        return list(info.eos_token_ids) if info is not None else []

    def check_available(self) -> None:
        """503 unless the engine is ready and we are not draining."""
        if self.client.is_dead:
            raise engine_unavailable(f"the engine is dead: {self.client.dead_reason}")
        if self.draining:
            raise engine_unavailable("the server is shutting down")
        if not self.client.is_ready:
            raise engine_unavailable(f"the engine is not ready yet (phase {self.phase})")

    def check_generates(self) -> None:
        """A pooling runner has no logits: the generation endpoints are refused, naming why."""
        if self.settings.pooler is not None:
            raise bad_request(f"Model {self.settings.model_name!r} is served with --runner "
                              "pooling: it answers /v1/embeddings only", "model")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names \
                and name not in self.adapters:
            raise APIError(404, f"The model `{name}` does not exist.", "model",
                           "model_not_found")

    def adapter_for(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects; None: the base model."""
        if name is None or name in self.settings.served_model_names:
            return None
        return name if name in self.adapters else None

    def response_model(self, name: str | None) -> str:
        """The ``model`` a response names: the adapter asked for, else the base's name."""
        adapter = self.adapter_for(name)
        return adapter if adapter is not None else self.settings.model_name

    def admit(self, num_engine_requests: int, kv_blocks: int) -> None:
        """Bounded queue: engine requests beyond what one batch holds (by max_num_seqs and
        by the KV cache, see admission.py) count as queued; past the limit, 429."""
        now = time.monotonic()
        decision = decide(
            in_flight=sum(len(g.requests) for g in self.live),
            in_flight_blocks=sum(g.kv_blocks for g in self.live),
            new=num_engine_requests, new_blocks=kv_blocks,
            max_num_seqs=self.settings.max_num_seqs, num_kv_blocks=self.num_kv_blocks,
            max_queued=self.settings.max_queued_requests,
            completions_per_s=self.completions.per_second(now))
        if not decision.admit:
            limit = self.settings.max_queued_requests
            raise APIError(429, f"too many queued requests: {decision.queued_after} would "
                           f"wait beyond the batch of {decision.batch} that max_num_seqs and "
                           f"the KV cache allow (limit {limit}); retry later", None,
                           "queue_full", headers={"Retry-After": str(decision.retry_after_s),
                                                  RETRY_SAFE_HEADER: "1"})

    def release(self, generation: Generation) -> None:
        """A generation leaves (finished, failed or aborted): its slots are free again."""
        if generation in self.live:
            self.live.discard(generation)
            self.completions.record(len(generation.requests), time.monotonic())
