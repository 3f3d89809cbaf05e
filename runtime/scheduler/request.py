"""A request as the engine core tracks it: tokens so far, progress, status and version."""

from __future__ import annotations

import enum
import time

from shoal.runtime.kv.block_hash import ExtraKeys
from shoal.runtime.wire.messages import EngineCoreRequest, TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, blocks revoked, outputs kept
    FINISHED = 3


class Request:
    __slots__ = (
        "req_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "stop_token_ids",
        "arrival_time", "priority", "arrival_seq", "all_token_ids", "output_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens", "status", "version",
        "block_hashes", "extra_digest", "max_tokens", "seen_by_worker", "ever_admitted",
        "logprobs_k", "queued_time", "scheduled_time", "prompt_logprobs", "lora_name",
        "park_kv", "kv_held", "external_tokens",
    )

    def __init__(self, request: EngineCoreRequest, arrival_seq: int, max_model_len: int,
                 model_revision: str = "", default_eos: list[int] | None = None) -> None:
        params = request.sampling_params
        self.req_id = request.request_id
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.sampling_params = params
        self.eos_token_ids = frozenset(request.eos_token_ids or default_eos or ())
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.arrival_time = request.arrival_time
        self.priority = request.priority
        self.arrival_seq = arrival_seq  # tie-break: the order add_request saw them
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.version = 0
        self.block_hashes: list[int] = []
        self.lora_name = request.adapter_id  # the LoRA adapter; None: the base model
        self.extra_digest = ExtraKeys(model_revision, request.adapter_id,
                                      request.cache_salt).digest()
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.seen_by_worker = False
        self.ever_admitted = False
        self.logprobs_k = params.logprobs
        # prompt_logprobs: filled chunk by chunk (index i: prompt token i + 1), sent with the
        # first output; such a request is never served from the prefix cache
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * (self.num_prompt_tokens - 1) if params.prompt_logprobs is not None
            else None)
        self.queued_time = time.monotonic()  # engine-side arrival, for the queue-time metric
        self.scheduled_time = 0.0  # set when first scheduled
        # KV transfer (runtime/kv_transfer): a prefill for a remote decode keeps its prompt's
        # blocks when it finishes; a decode holds the blocks it pulled until it is admitted,
        # and the pulled span of its prompt (start, end tokens) counts as external
        transfer = request.kv_transfer
        self.park_kv = transfer is not None and transfer.do_remote_decode
        self.kv_held = False
        self.external_tokens = (0, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def priority_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.arrival_seq)

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, v{self.version}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
