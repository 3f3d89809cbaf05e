"""EngineCore: validation, the scheduler and the executor, one step at a time.

``add_request`` validates everything before any state changes (a rejected request leaves
the scheduler and KV cache exactly as they were); ``step`` runs one scheduler iteration
and returns the outputs of that step. Tokenizing, detokenizing and I/O live elsewhere.
"""

from __future__ import annotations

import atexit
import gc

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from shoal.runtime.executor.base import Executor
from shoal.runtime.kv.events import KVEvent
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams
from shoal.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

DEFAULT_KV_TOKENS_PER_SEQ = 1024  # default budget: room for max_num_seqs sequences of ~1k tokens
DEFAULT_KV_RAM_SHARE = 0.25  # ... capped at this share of the machine's memory


def default_kv_cache_bytes(max_num_seqs: int, kv_bytes_per_token: int) -> int:
    import psutil

    wanted = max_num_seqs * DEFAULT_KV_TOKENS_PER_SEQ * kv_bytes_per_token
    return min(wanted, int(psutil.virtual_memory().total * DEFAULT_KV_RAM_SHARE))


def resolve_num_kv_blocks(config: EngineConfig, kv_bytes_per_block: int) -> int:
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        budget = config.kv_cache_memory
        if budget is None:
            budget = default_kv_cache_bytes(config.max_num_seqs,
                                            kv_bytes_per_block // config.block_size)
        blocks = budget // kv_bytes_per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget holds no block ({kv_bytes_per_block} bytes each)")
    return blocks


def freeze_gc_after_startup() -> None:
    """Call once an engine is built, in a process that owns it for its lifetime (offline
    LLM, the engine-core process, benchmarks). The block pool and the model are long-lived
    objects (one per KV block); left in the collected generations, every full cyclic-GC
    pass walks all of them and stalls a step for ~100 ms at 64k blocks. Garbage is collected
    first so only live objects are frozen; everything is unfrozen at exit so extension
    modules see their objects released."""
    global _UNFREEZE_AT_EXIT
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True


_UNFREEZE_AT_EXIT = False


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        if executor is None:  # in-process for one rank, a process per rank beyond
            from shoal.runtime.executor.factory import create_executor

            executor = create_executor(config)
        self.config = config
        self.executor = executor
        self.model_config = executor.model_config
        # on a GPU with no explicit size: what gpu_memory_utilization leaves after a profiled step
        profile = getattr(executor, "profile_num_kv_blocks", None)  # test fakes may lack it
        profiled = (profile() if profile is not None and config.num_kv_blocks is None
                    and config.kv_cache_memory is None else None)
        num_blocks = profiled or resolve_num_kv_blocks(config, executor.kv_bytes_per_block())
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        executor.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                num_kv_blocks=num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                scheduling_policy=config.scheduling_policy,
                model_revision=config.model_revision,
            ),
            default_eos=self.model_config.eos_token_ids,
        )

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        """config.json's limit unless set; one sequence must fit the whole KV cache, so a
        default is shrunk to it and an explicit value beyond it is an error."""
        model_limit = self.model_config.max_position_embeddings
        kv_limit = num_blocks * self.config.block_size
        asked = self.config.max_model_len
        if asked is None:
            return min(model_limit, kv_limit)
        if asked < 2:
            raise ValueError(f"max_model_len must be at least 2, got {asked}")
        if asked > model_limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's "
                             f"max_position_embeddings {model_limit}")
        if asked > kv_limit:
            raise ValueError(f"max_model_len {asked} does not fit the KV cache "
                             f"({num_blocks} blocks of {self.config.block_size} tokens)")
        return asked

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate(request)
        self.scheduler.add_request(request)

    def validate(self, request: EngineCoreRequest) -> None:
        """Raise InvalidParameter naming what is wrong; touches no state."""
        params: SamplingParams = request.sampling_params
        params.validate(self.config.max_logprobs)
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidParameter("prompt", "the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise InvalidParameter(
                "prompt", f"the prompt has {len(prompt)} tokens; max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate")
        if len(prompt) + params.min_tokens > self.max_model_len:
            raise InvalidParameter(
                "min_tokens", f"prompt ({len(prompt)} tokens) + min_tokens "
                f"({params.min_tokens}) exceeds max_model_len {self.max_model_len}")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise InvalidParameter("prompt", f"prompt token id {bad} is outside the vocabulary "
                                   f"[0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidParameter("stop_token_ids",
                                   f"stop token ids must be below the vocabulary size {vocab}")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        result = self.executor.execute(scheduled.plan)
        return self.scheduler.update(scheduled, result)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def drain_kv_events(self) -> list[KVEvent]:
        return self.scheduler.kv.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def shutdown(self) -> None:
        self.executor.shutdown()
