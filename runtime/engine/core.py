"""EngineCore: validation, the scheduler and the executor, one step at a time.

``add_request`` validates everything before any state changes (a rejected request leaves
the scheduler and KV cache exactly as they were); a request with a grammar then waits
outside the scheduler until its grammar is compiled on a background thread (never on the
step; over the compile budget or invalid: a 400 through ``take_failures``). ``step`` admits
the requests whose grammar is ready, runs one scheduler iteration and returns the outputs of
that step. A step that raises fails the request that caused it
(``isolation.py``; ``take_failures`` hands them to the loop); only engine faults propagate.
Tokenizing, detokenizing and I/O live elsewhere.
"""

from __future__ import annotations

import atexit
import gc
import logging

from shoal.runtime import debug_plugins
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.host_memory import describe, usable_memory
from shoal.runtime.engine.isolation import RequestFailure, StepIsolation, is_engine_fault
from shoal.runtime.engine.lora_registry import LoraRegistry
from shoal.runtime.engine.remote_kv import RemoteKV
from shoal.runtime.engine.validation import validate_request
from shoal.runtime.executor.base import Executor
from shoal.runtime.kv.events import KVEvent
from shoal.runtime.kv.kv_groups import KVGroups, plan_kv_groups
from shoal.runtime.kv.kv_manager import window_peak_blocks
from shoal.runtime.kv_transfer.params import KVTransferConfig
from shoal.runtime.log_limits import RateLimitedLog
from shoal.runtime.lora_modules import check_lora_limits
from shoal.runtime.sampling_params import InvalidParameter, RequestLimits
from shoal.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from shoal.runtime.structured.compiler import GrammarCompiler
from shoal.runtime.structured.spec import GrammarError, GrammarSpec, check_grammar
from shoal.runtime.wire.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats

logger = logging.getLogger("shoal.engine.core")

DEFAULT_KV_TOKENS_PER_SEQ = 1024  # default budget: room for max_num_seqs sequences of ~1k tokens
DEFAULT_KV_RAM_SHARE = 0.25  # ... capped at this share of the machine's memory
GRAMMAR_WAIT_S = 0.01  # an idle step waits this long for a compile (inputs are read between)


def default_kv_cache_bytes(max_num_seqs: int, kv_bytes_per_token: int,
                           memory_bytes: int) -> int:
    wanted = max_num_seqs * DEFAULT_KV_TOKENS_PER_SEQ * kv_bytes_per_token
    return min(wanted, int(memory_bytes * DEFAULT_KV_RAM_SHARE))


def resolve_num_kv_blocks(config: EngineConfig, kv_bytes_per_block: int,
                          num_groups: int = 1, host_memory: int | None = None) -> int:
    """``num_groups``: KV cache groups (``kv/kv_groups.py``); a token of a short request
    takes a block slot in each, so the default budget counts all of them per token.
    ``host_memory``: on a CPU, the memory one rank's cache lives in (``host_memory.py``,
    shared by the ranks): the default budget is a share of it and a cache that cannot fit
    in it is refused; None on a GPU (its budget is device memory)."""
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        budget = config.kv_cache_memory
        if budget is None:
            budget = default_kv_cache_bytes(
                config.max_num_seqs, kv_bytes_per_block * num_groups // config.block_size,
                usable_memory() if host_memory is None else host_memory)
        blocks = budget // kv_bytes_per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget holds no block ({kv_bytes_per_block} bytes each)")
    if host_memory is not None and blocks * kv_bytes_per_block > host_memory:
        flag = "--num-kv-blocks" if config.num_kv_blocks is not None else "--kv-cache-memory"
        raise ValueError(
            f"the KV cache ({blocks} blocks, {describe(blocks * kv_bytes_per_block)} per "
            f"rank) does not fit in memory ({describe(host_memory)} per rank: the machine's "
            f"or the container's limit, whichever is lower); lower {flag}")
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


def kv_groups_of(model_config, disable_hybrid: bool = False) -> KVGroups:
    """The model's KV cache groups; a hybrid linear-attention model keeps one (its state
    slots are per layer, not per group), and so does ``--disable-hybrid-kv-cache-manager``.
    The worker's ``ModelRunner`` plans the same."""
    return plan_kv_groups(getattr(model_config, "layer_windows", ()),
                          split=not disable_hybrid
                          and getattr(model_config, "linear_attn", None) is None)


def hybrid_token_limit(groups: KVGroups, num_blocks: int, block_size: int,
                       max_step_tokens: int, model_limit: int) -> int:
    """The longest request (at most ``model_limit``) that ``num_blocks`` hold alone with
    several KV cache groups: ``n`` tokens take ``ceil(n / block_size)`` blocks in each full
    group and, in each sliding group, no more than its window's peak with steps of at most
    ``min(max_step_tokens, n)`` tokens."""
    def blocks_for(n: int) -> int:
        covered = -(-n // block_size)
        return sum(covered if w is None else
                   min(covered, window_peak_blocks(w, min(max_step_tokens, n), block_size))
                   for w in groups.windows)

    lo, hi = 0, model_limit  # blocks_for grows with n: the largest n that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for(mid) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        check_lora_limits(config.enable_lora, config.lora_modules, config.max_loras,
                          config.max_lora_rank, config.max_cpu_loras,
                          config.tensor_parallel_size)
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
        # sliding and full layers: a block table per group (the worker plans the same groups)
        self.kv_groups = kv_groups_of(self.model_config, config.disable_hybrid_kv_cache_manager)
        from shoal.runtime.worker.worker import resolve_device  # torch: only where a core runs

        on_cpu = resolve_device(config.device).type == "cpu"
        num_blocks = profiled or resolve_num_kv_blocks(
            config, executor.kv_bytes_per_block(), self.kv_groups.num_groups,
            usable_memory() // config.tensor_parallel_size if on_cpu else None)
        logger.info("KV cache: %d blocks of %d tokens, %d bytes per token per rank%s", num_blocks,
                    config.block_size, executor.kv_bytes_per_block() // config.block_size,
                    " (latent + rotary key: multi-head latent attention)"
                    if getattr(self.model_config, "mla", None) is not None else
                    f" per KV cache group ({self.kv_groups.describe()})"
                    if self.kv_groups.hybrid else "")
        self._log_linear_state(config)
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        executor.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                num_kv_blocks=num_blocks,
                enable_prefix_caching=config.enable_prefix_caching and not self._hybrid,
                scheduling_policy=config.scheduling_policy,
                model_revision=config.model_revision,
                max_loras=config.max_loras if config.enable_lora else 0,
                sliding_window=self.model_config.sliding_window,
                kv_group_windows=self.kv_groups.windows if self.kv_groups.hybrid else (),
            ),
            default_eos=self.model_config.eos_token_ids,
        )
        # KV events exist for a publisher to drain each step; with none (the default), a
        # list that grew with every block stored or evicted was the engine core's memory
        # growth under load (issue 36)
        self.scheduler.kv.pool.record_events = config.kv_events_endpoint is not None
        self.limits = RequestLimits(max_logprobs=config.max_logprobs,
                                    max_n=2**31, max_stop_strings=2**31,
                                    max_stop_string_chars=2**31, max_stop_token_ids=2**31,
                                    max_cache_salt_chars=2**31,
                                    vocab_size=self.model_config.vocab_size,
                                    max_model_len=self.max_model_len)
        self.isolation = StepIsolation(self.scheduler)
        self._failures: list[RequestFailure] = []
        # An engine fault (a dead rank) is fatal: the failed step stays in flight, and every
        # later step raises the same fault instead of scheduling again.
        self._fatal: BaseException | None = None
        self._fault_log = RateLimitedLog(logger)
        self._grammars: GrammarCompiler | None = None  # made at the first grammar
        self._awaiting_grammar: dict[str, EngineCoreRequest] = {}
        self.adapters = LoraRegistry(executor)
        for module in config.lora_modules:  # a bad one fails the startup, naming why
            try:
                self.adapters.add(module.name, module.path)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {module.name}: {exc}") from None
        self.remote: RemoteKV | None = None
        self._ignored_transfer_log = RateLimitedLog(logger)
        if config.kv_transfer_config is not None:
            self.remote = self._start_kv_transfer(config.kv_transfer_config)
        debug_plugins.load_plugins()
        self._hooks = debug_plugins.hooks()

    @property
    def _hybrid(self) -> bool:
        return getattr(self.model_config, "linear_attn", None) is not None

    def _log_linear_state(self, config: EngineConfig) -> None:
        """A hybrid model: its per-request state, and prefix caching turned off (a cached
        prefix's KV blocks exist, but not the linear layers' state at its end)."""
        lin = getattr(self.model_config, "linear_attn", None)
        if lin is None:
            return
        per_request = self.executor.state_bytes_per_request()
        logger.info("linear-attention state: %d slots (max_num_seqs) of %d bytes per request "
                    "(%d Gated DeltaNet layers: conv window + float32 recurrent state); the KV "
                    "cache holds the %d full-attention layers only", config.max_num_seqs,
                    per_request, lin.num_linear_layers,
                    self.model_config.num_layers - lin.num_linear_layers)
        if config.enable_prefix_caching:
            logger.info("prefix caching disabled for %s: its linear-attention layers keep no "
                        "state checkpoint for a cached prefix to resume from",
                        self.model_config.architecture)

    def _start_kv_transfer(self, transfer: KVTransferConfig) -> RemoteKV:
        """The connector of ``--kv-transfer-config``, serving or pulling this engine's KV
        blocks (one rank: a KV transfer per tensor-parallel rank is not done yet)."""
        from shoal.runtime.kv_transfer.tcp_connector import TcpConnector

        if self.config.tensor_parallel_size != 1:
            raise ValueError("--kv-transfer-config needs --tensor-parallel-size 1 (KV transfer "
                             "between tensor-parallel engines is not supported yet)")
        if self._hybrid:  # blocks move, but not the linear layers' per-request state
            raise ValueError(f"--kv-transfer-config: {self.model_config.architecture} keeps "
                             "linear-attention state outside the KV blocks; moving it between "
                             "engines is not supported")
        if transfer.consumes and not self.config.enable_prefix_caching:
            raise ValueError(f"--kv-transfer-config kv_role {transfer.kv_role} needs prefix "
                             "caching: pulled blocks enter the prefix cache")
        connector = TcpConnector(transfer.engine_id, transfer.kv_ip, transfer.kv_port,
                                 transfer.transfer_timeout)
        connector.start(self.executor.kv_block_io())
        logger.info("KV transfer: %s %s on %s:%d (engine id %s)", transfer.kv_connector,
                    transfer.kv_role, connector.host, connector.port, connector.engine_id)
        return RemoteKV(transfer, connector, self.scheduler.kv, self.config.model_revision)

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        """config.json's limit unless set; one sequence must fit the whole KV cache, so a
        default is shrunk to it and an explicit value beyond it is an error. A model windowed
        on every layer needs only its window's blocks at once (the rest are freed as it
        runs): when the cache holds that, any length the model takes fits."""
        model_limit = self.model_config.max_position_embeddings
        kv_limit = num_blocks * self.config.block_size
        window = self.model_config.sliding_window
        if self.kv_groups.hybrid:
            kv_limit = hybrid_token_limit(self.kv_groups, num_blocks, self.config.block_size,
                                          self.config.max_num_batched_tokens, model_limit)
            logger.info("KV cache groups: %s; a request holds its length in each full group "
                        "and at most its window in each sliding group: one request fits %d "
                        "tokens", self.kv_groups.describe(), kv_limit)
        elif window is not None:
            peak = window_peak_blocks(window, self.config.max_num_batched_tokens,
                                      self.config.block_size)
            logger.info("KV cache: every layer attends to the last %d positions, so a "
                        "request holds at most %d blocks however long it grows%s", window,
                        peak, "" if num_blocks >= peak else
                        f"; the cache has {num_blocks}, so max_model_len stays within it")
            if num_blocks >= peak:
                kv_limit = model_limit
        elif any(self.model_config.layer_windows):
            windowed = sum(1 for w in self.model_config.layer_windows if w)
            logger.info("KV cache: %d of %d layers are windowed; the others attend to every "
                        "position, so a request keeps all its blocks", windowed,
                        len(self.model_config.layer_windows))
        asked = self.config.max_model_len
        if asked is None:
            return min(model_limit, kv_limit)
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
        if request.kv_transfer is not None and self.remote is None:
            self._ignored_transfer_log.log(
                logging.WARNING, "no connector", "kv_transfer_params of %s ignored: this "
                "engine has no --kv-transfer-config", request.request_id)
            request.kv_transfer = None
        spec = request.sampling_params.structured
        compiler = self._grammar_compiler() if spec is not None else None
        if spec is not None and compiler is not None and not compiler.backend.cached(spec):
            failure = compiler.submit(request.request_id, spec)
            if failure is not None:
                raise InvalidParameter(failure.param, failure.message)
            self._awaiting_grammar[request.request_id] = request
            return
        if spec is not None and compiler is None:
            check_structured(spec)
        self._schedule(request)

    def _schedule(self, request: EngineCoreRequest) -> None:
        if self.remote is not None and self.remote.begin(request):
            return  # it enters when its prompt's blocks are pulled (or the pull failed)
        self._enter(request)

    def _enter(self, request: EngineCoreRequest, held: bool = False,
               external_tokens: tuple[int, int] = (0, 0)) -> None:
        req = self.scheduler.add_request(request)
        req.kv_held, req.external_tokens = held, external_tokens
        for hook in self._hooks:
            hook.request_added(request)

    def poll_transfers(self) -> bool:
        """Pulls that ended enter the scheduler; offered blocks pulled or expired go back to
        the pool. True when anything changed (the loop calls it while idle too)."""
        if self.remote is None:
            return False
        ready, changed = self.remote.poll()
        for item in ready:
            self._enter(item.request, item.held, item.external_tokens)
        return changed

    def validate(self, request: EngineCoreRequest) -> None:
        """Raise InvalidParameter naming what is wrong (the same checks as the API
        process's, ``validation.py``: a grammar's size is bounded there, and whether it
        parses is decided when it compiles); touches no state."""
        validate_request(request, self.limits)
        if request.adapter_id is not None and not self.adapters.serves(request.adapter_id):
            raise InvalidParameter("model", f"The model `{request.adapter_id}` does not exist.")
        if (request.request_id in self.scheduler.requests
                or request.request_id in self._awaiting_grammar
                or (self.remote is not None and self.remote.is_pending(request.request_id))):
            raise ValueError(f"request id {request.request_id!r} is already in the engine")

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._grammars is not None:
            self._grammars.cancel(request_ids)
        for request_id in request_ids:
            self._awaiting_grammar.pop(request_id, None)
        if self.remote is not None:
            self.remote.abort(request_ids)
        self.scheduler.abort_requests(request_ids)
        self.isolation.forget(request_ids)
        for hook in self._hooks:
            hook.requests_gone(request_ids)

    def _grammar_compiler(self) -> GrammarCompiler | None:
        """None where the executor has no backend here (test fakes): then the spec is
        parsed now and the worker compiles it on the step, as before."""
        if self._grammars is None:
            get_backend = getattr(self.executor, "grammar_backend", None)
            backend = get_backend() if get_backend is not None else None
            if backend is None:
                return None
            self._grammars = GrammarCompiler(backend, self.config.grammar_compile_timeout)
        return self._grammars

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled enter the scheduler; failed ones become 400s."""
        if self._grammars is None or not self._awaiting_grammar:
            return
        ready, failed = self._grammars.poll()
        for request_id in ready:
            request = self._awaiting_grammar.pop(request_id, None)
            if request is not None:
                self._schedule(request)
        for failure in failed:
            if self._awaiting_grammar.pop(failure.request_id, None) is not None:
                self._failures.append(RequestFailure(failure.request_id, failure.message,
                                                     param=failure.param))

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self._fatal is not None:
            raise self._fatal
        self._admit_compiled()
        self.poll_transfers()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            if self._grammars is not None and self._awaiting_grammar:
                self._grammars.wait(GRAMMAR_WAIT_S)  # nothing to run but compiles: no spin
            elif self.remote is not None and self.remote.pending:
                self.remote.connector.wait(GRAMMAR_WAIT_S)  # nothing to run but pulls
            return []
        plan = scheduled.plan
        try:
            for hook in self._hooks:
                hook.before_step(plan)
            result = self.executor.execute(plan)
            outputs = self.scheduler.update(scheduled, result)
        except Exception as exc:
            if is_engine_fault(exc):
                self._fatal = exc
                raise
            try:
                self.executor.check_health()  # a dead rank behind the error: fatal
            except Exception as fault:
                self._fatal = fault
                raise
            self._fault_log.log(logging.ERROR, f"{type(exc).__name__}: {exc}"[:200],
                                "step %d failed with %d request(s) in it; isolating",
                                plan.step_id, len(plan.req_ids), exc_info=exc)
            failed = self.isolation.step_failed(list(plan.req_ids), plan.finished_req_ids)
            for hook in self._hooks:
                hook.requests_gone([f.request_id for f in failed])
            self._failures.extend(failed)
            return []
        self.isolation.step_succeeded(plan.req_ids)
        parked = self.scheduler.take_parked()
        if parked:
            self._offer(parked, outputs)
        if self.adapters.retiring:
            self._retire_unused_adapters()
        return outputs

    def _offer(self, parked, outputs: list[EngineCoreOutput]) -> None:
        """Finished prefills for remote decodes: their blocks are offered, their last
        output says where (the response's kv_transfer_params)."""
        if self.remote is None:  # cannot happen: add_request drops the params without one
            for req, _ in parked:
                self.scheduler.kv.release_hold(req.req_id)
            return
        answers = self.remote.park(parked)
        for output in outputs:
            params = answers.get(output.request_id)
            if params is not None:
                output.kv_transfer_params = params

    # -- LoRA adapters ------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Load an adapter at run time (ValueError naming why a bad one is refused)."""
        self.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        """New requests for it are refused now; it leaves the worker once the requests
        already holding it finish (KeyError: not loaded)."""
        self.adapters.retire(name)
        self._retire_unused_adapters()

    def _retire_unused_adapters(self) -> None:
        awaiting = [_Named(r.adapter_id) for r in self._awaiting_grammar.values()]
        self.adapters.retire_unused([*self.scheduler.requests.values(), *awaiting])

    def take_failures(self) -> list[RequestFailure]:
        """Requests failed by isolated step errors since the last call (already removed)."""
        failures, self._failures = self._failures, []
        return failures

    def has_unfinished_requests(self) -> bool:
        return (bool(self._awaiting_grammar) or self.scheduler.has_unfinished_requests()
                or (self.remote is not None and bool(self.remote.pending)))

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_waiting += len(self._awaiting_grammar)  # waiting for their grammar
        remote = self.remote
        if remote is not None:
            stats.num_waiting += len(remote.pending)  # waiting for their prompt's blocks
            counters = remote.connector.counters
            stats.kv_transfer_bytes_received = counters.bytes_received
            stats.kv_transfer_bytes_sent = counters.bytes_sent
            stats.kv_transfer_pulls = counters.pulls
            stats.kv_transfer_failures = counters.pulls_failed
            stats.kv_transfer_seconds = counters.pull_seconds
            stats.kv_transfer_expired = counters.offers_expired
            stats.kv_transfer_blocks_skipped = remote.blocks_skipped
        return stats

    def drain_kv_events(self) -> list[KVEvent]:
        return self.scheduler.kv.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown()
        if self.remote is not None:
            self.remote.shutdown()
        self.executor.shutdown()


class _Named:
    """A request waiting for its grammar, seen as the adapter it holds."""

    __slots__ = ("lora_name",)

    def __init__(self, lora_name: str | None) -> None:
        self.lora_name = lora_name


def check_structured(spec: GrammarSpec) -> None:
    try:
        check_grammar(spec)
    except GrammarError as exc:
        raise InvalidParameter(spec.param, str(exc)) from exc
