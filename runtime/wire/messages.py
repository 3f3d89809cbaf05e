"""What crosses the API-process <-> engine-core boundary (msgspec, msgpack on ZeroMQ).

Inputs are one-byte typed frames (see ``RequestType``); outputs are batched per step.
Every output carries the request id and the request's version: the version bumps when
the engine revokes a request's state (preemption), so anything computed for an older
version is stale and is dropped, never streamed.
"""

from __future__ import annotations

import enum

import msgspec
from shoal.runtime.kv_transfer.params import KVTransferParams
from shoal.runtime.sampling_params import SamplingParams


class RequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"  # heartbeat, stats, reset-prefix-cache, ...


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None  # per-tenant isolation of the prefix cache
    adapter_id: str | None = None  # the LoRA adapter's name (None: the base); in cache identity
    kv_transfer: KVTransferParams | None = None  # vLLM's kv_transfer_params (P/D)


class FinishReason(str, enum.Enum):  # noqa: UP042 (msgspec-encoded by value)
    STOP = "stop"  # EOS, stop token id, or (set by the front end) stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the sampled token and the top-k alternatives at one position."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    version: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # on a request's first output when it asked for prompt_logprobs: prompt tokens 1..n-1
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # engine-side time.monotonic() stamps, set on a request's first output only (0 elsewhere):
    # when the engine core received it and when it was first scheduled (queue/prefill metrics)
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    pooled: bytes | None = None  # the pooling runner: the prompt's vector, float32
    # on a prefill's last output (do_remote_decode): where a decode engine pulls its blocks
    kv_transfer_params: KVTransferParams | None = None


class SchedulerStats(msgspec.Struct, kw_only=True):
    """Engine statistics for /metrics. Gauges are current; counters are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1, blocks in use (cached-but-free blocks not counted)
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # of prompt_tokens: found in the prefix cache (local or pulled)
    prompt_tokens_external: int = 0  # of prompt_tokens_cached: pulled from a prefill engine
    generation_tokens: int = 0
    # KV transfer (cumulative; vLLM's nixl_* metrics as counters)
    kv_transfer_bytes_received: int = 0
    kv_transfer_bytes_sent: int = 0
    kv_transfer_pulls: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_expired: int = 0
    kv_transfer_blocks_skipped: int = 0  # already cached on the decode side: not sent again
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)  # sorted names
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
