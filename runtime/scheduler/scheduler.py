"""The scheduler: one token budget per step, running requests first, then admissions.

Per step (vLLM v1 style): every running request gets its share first (a decode 1 token, a
running prefill ``min(remaining, budget)``), so decode is never starved by prefill; a
running request that cannot get a block preempts the newest running request (or, under the
priority policy, the worst-priority one) by recompute. If nothing was preempted, waiting
requests are admitted while budget, ``max_num_seqs`` and blocks allow, prefix-cache hits
skipping their prefill (blocks an earlier row of the same step fills count: they are hashed
when scheduled, ``KVCacheManager.cache_blocks_ahead``). Chunked prefill is always on and
mixes with decodes in one step.

One path: the running requests are the rows of a persistent batch (``running_batch.py``),
so a step is decided with array operations over them whatever they do (decode, prefill,
both); only rows that need blocks the pool lacks are taken one by one, preempting. Outputs
are built in one place (``step_outputs.py``), whether a request stopped is decided in one
place (``stops.py``), and blocks reach the prefix cache one way (hashed when the step that
fills them is scheduled).

``schedule()`` returns a ``ScheduledStep`` (the plan plus its rows' requests); ``update()``
consumes the StepResult, skipping rows preempted or aborted while the step was in flight.
One step is in flight at a time: ``update()`` or, if it failed, ``revoke()`` ends it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import compress

import numpy as np
from shoal.runtime.kv.kv_manager import KVCacheManager
from shoal.runtime.scheduler.lora_admission import LoraGate, adapters_of
from shoal.runtime.scheduler.plan_builder import allot_budget, build_plan
from shoal.runtime.scheduler.request import Request, RequestStatus
from shoal.runtime.scheduler.running_batch import RunningBatch
from shoal.runtime.scheduler.step_outputs import (
    add_first_output_extras,
    add_logprobs,
    append_tokens,
    store_prompt_logprobs,
)
from shoal.runtime.scheduler.stops import check_stop, maybe_stopped
from shoal.runtime.scheduler.waiting_queue import make_waiting_queue
from shoal.runtime.wire.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from shoal.runtime.wire.plan import NewRequestData, StepPlan, StepResult

_NO_ROWS = np.zeros(0, np.int64)


@dataclass(kw_only=True)
class SchedulerConfig:
    """The engine's resolved settings the scheduler runs by. No defaults here: every value
    comes from ``EngineConfig`` (which holds each default once) as the engine core resolved
    it (``max_model_len`` and ``num_kv_blocks`` after sizing the KV cache)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    scheduling_policy: str
    model_revision: str
    max_loras: int  # LoRA adapter slots per step (0: LoRA off, no gate)
    # every attention layer's window (None: some layer attends to everything); with one,
    # blocks no window reaches go back to the pool while their request runs
    sliding_window: int | None
    # per KV cache group (``kv/kv_groups.py``), its window: a mixed model's sliding groups
    # free their blocks outside the window while the full group keeps them (empty: one group)
    kv_group_windows: tuple[int | None, ...] = ()


@dataclass
class ScheduledStep:
    """A step between ``schedule()`` and ``update()``: its plan, the requests of its rows
    (the running batch's leading rows when it was planned) and the batch's revision then
    (unchanged at update: no row left meanwhile, so the rows are still the leading ones)."""

    plan: StepPlan
    reqs: list[Request]
    revision: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, default_eos: list[int] | None = None) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        self.config = config
        self.default_eos = list(default_eos or [])
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.max_num_seqs,
                                 config.max_model_len, config.enable_prefix_caching,
                                 config.sliding_window, config.kv_group_windows)
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self._batch = RunningBatch(config.max_num_seqs, config.max_model_len)
        self._in_flight: ScheduledStep | None = None
        self._finished_for_worker: list[str] = []
        self._step_id = 0
        self._arrivals = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0  # found in the local prefix cache at first admission
        self.prompt_tokens_external = 0  # ... of which a KV transfer brought
        self.generation_tokens = 0
        self._parked: list[tuple[Request, list[int]]] = []  # finished, blocks held (take_parked)

    @property
    def running(self) -> list[Request]:
        """The running requests, in running order (the batch's rows; do not mutate)."""
        return self._batch.reqs

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> Request:
        """The caller validated it; this only records it."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self._arrivals += 1
        req = Request(request, self._arrivals, self.config.max_model_len,
                      self.config.model_revision, self.default_eos)
        self.requests[req.req_id] = req
        self.waiting.push(req)
        return req

    def abort_requests(self, request_ids: list[str]) -> None:
        """Free their blocks now; any result still in flight for them is stale."""
        rows = []
        for req_id in request_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                rows.append(self._batch.index_of(req))
            else:
                self.waiting.remove(req)
            self._retire(req)
        if rows:
            self._batch.remove(sorted(rows))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def revoke(self, req_ids: list[str], finished_for_worker: list[str]) -> None:
        """A step failed: preempt its running rows (recomputed later, outputs kept) and
        re-send the drop list the failed plan carried (dropping is idempotent)."""
        self._in_flight = None
        self._finished_for_worker.extend(finished_for_worker)
        self.kv.forget_unwritten()
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self._preempt(req)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.plan.step_id} is in flight: update() "
                               "or revoke() it before scheduling another")
        budget = self.config.max_num_batched_tokens
        counts, num_scheduled, decode_only, preempted = self._schedule_running(budget)
        budget -= num_scheduled
        new_requests: list[NewRequestData] = []
        if not preempted and budget > 0:
            admitted = self._admit(budget, new_requests)
            if admitted:
                counts = np.concatenate([counts, np.asarray(admitted, np.int64)])
                decode_only = False
        if not counts.size:
            return None
        self._step_id += 1
        batch = self._batch
        plan = build_plan(self._step_id, batch, counts, self.kv.group_arrays,
                          self.config.block_size, new_requests, self._finished_for_worker)
        self._finished_for_worker = []
        batch.advance(len(counts), counts, decode_only, plan.sample_rows)
        step = self._in_flight = ScheduledStep(plan, batch.reqs[:len(counts)], batch.revision)
        return step

    def _schedule_running(self, budget: int) -> tuple[np.ndarray, int, bool, bool]:
        """Tokens for the running rows (the leading ones the budget reaches) and their
        blocks; the blocks they fill are offered to the cache. Returns the counts, their
        sum, whether every running row decodes one token, whether a row had to preempt."""
        batch, kv, block_size = self._batch, self.kv, self.config.block_size
        num_rows = len(batch)
        if not num_rows:
            return _NO_ROWS, 0, False, False
        computed = batch.computed[:num_rows]
        if kv.frees_blocks:  # before growing tables: the freed blocks serve
            kv.free_outside_window(batch.req_ids, computed, batch.table_rows[:num_rows])
        counts = batch.num_tokens[:num_rows] - computed
        wanted = int(counts.sum())
        decode_only = wanted == num_rows  # one token each (the steady state)
        if wanted <= budget:
            ends = batch.num_tokens[:num_rows]  # every row computes all it knows
        else:
            counts = allot_budget(counts, budget)
            num_rows = int(np.count_nonzero(counts))  # the budget reaches a prefix of the rows
            counts, computed = counts[:num_rows], computed[:num_rows]
            wanted, decode_only = budget, False
            ends = computed + counts
        short = np.flatnonzero(ends > batch.capacity[:num_rows])
        preempted = False
        if short.size:
            req_ids = batch.req_ids
            if kv.extend_tables([req_ids[i] for i in short.tolist()], ends[short].tolist()):
                if decode_only:  # one new block each
                    batch.capacity[short] += block_size
                else:
                    batch.capacity[short] = (ends[short] + block_size - 1) // block_size \
                        * block_size
            else:
                counts = self._schedule_rows_preempting(budget)
                preempted, decode_only = True, False
                num_rows = len(counts)
                wanted = int(counts.sum())
                ends = batch.computed[:num_rows] + counts
        if kv.enable_prefix_caching:
            if decode_only and block_size > 1:  # a row's blocks hold exactly its tokens,
                filling = np.flatnonzero(ends == batch.capacity[:num_rows])  # so: it is full
            else:
                filling = np.flatnonzero(ends % block_size < counts)  # the step fills a block
            if filling.size:
                reqs = batch.reqs
                kv.cache_blocks_ahead([reqs[i] for i in filling.tolist()],
                                      ends[filling].tolist())
        return counts, wanted, decode_only, preempted

    def _schedule_rows_preempting(self, budget: int) -> np.ndarray:
        """The same decision row by row, when the pool cannot cover every row's blocks: a
        row that cannot get its blocks preempts until it can (or is itself preempted)."""
        batch, kv, block_size = self._batch, self.kv, self.config.block_size
        counts: list[int] = []
        i = 0
        while i < len(batch) and budget > 0:
            req = batch.reqs[i]
            computed = int(batch.computed[i])
            count = min(int(batch.num_tokens[i]) - computed, budget)
            if computed + count > batch.capacity[i] \
                    and not kv.allocate_slots(req, computed, count) \
                    and not self._preempt_until_allocated(req, i, count):
                continue  # it preempted itself; row i is now the next request
            batch.capacity[i] = kv.num_blocks_of(req.req_id) * block_size
            counts.append(count)
            budget -= count
            i += 1
        return np.asarray(counts, np.int64)

    def _preempt_until_allocated(self, req: Request, first_unscheduled: int,
                                 count: int) -> bool:
        """Preempt victims until ``req`` gets its slots (True) or is itself the victim."""
        while True:
            victim = self._pick_victim(first_unscheduled)
            self._preempt(victim)
            if victim is req:
                return False
            if self.kv.allocate_slots(req, req.num_computed_tokens, count):
                return True

    def _admit(self, budget: int, new_requests: list[NewRequestData]) -> list[int]:
        """Waiting requests join the batch while budget, ``max_num_seqs`` and blocks allow;
        the tokens each computes this step."""
        kv, waiting, batch = self.kv, self.waiting, self._batch
        block_size = self.config.block_size
        counts: list[int] = []
        gate = LoraGate(self.config.max_loras, batch.reqs) if self.config.max_loras else None
        while waiting and budget > 0 and len(batch) < self.config.max_num_seqs:
            req = waiting.peek()
            if gate is not None and not gate.fits(req):  # its adapter waits for a slot
                found = gate.first_fitting(waiting)
                if found is None:
                    break
                req = found
            # prompt logprobs need every prompt position computed: no prefix-cache reads
            hits = kv.find_cached_prefix(req) if req.prompt_logprobs is None \
                or req.output_token_ids else []
            computed = len(hits) * block_size
            count = min(req.num_tokens - computed, budget)
            if not kv.allocate_slots(req, computed, count, hits):
                break
            if req.kv_held:  # the pulled blocks are in its table now
                kv.release_hold(req.req_id)
                req.kv_held = False
            kv.cache_blocks_ahead((req,), (computed + count,))  # shareable by the next one
            if req is waiting.peek():
                waiting.pop()
            else:
                waiting.remove(req)
            if gate is not None:
                gate.admitted(req)
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += computed
            if not req.ever_admitted:
                req.ever_admitted = True
                req.scheduled_time = time.monotonic()  # request_queue_time_seconds ends here
                req.num_cached_tokens = computed
                self.prompt_tokens += req.num_prompt_tokens
                self.prompt_tokens_cached += computed
                start, end = req.external_tokens
                self.prompt_tokens_external += max(0, min(computed, end) - start)
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            req.seen_by_worker = True
            batch.append(req, kv.rows[req.req_id], kv.num_blocks_of(req.req_id) * block_size)
            new_requests.append(NewRequestData(
                req_id=req.req_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                generator_offset=len(req.output_token_ids),
                lora_name=req.lora_name,
            ))
            counts.append(count)
            budget -= count
        return counts

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """Among running requests not yet scheduled this step (the asking one included):
        the newest under FCFS, the worst (priority, arrival) under the priority policy."""
        if self.config.scheduling_policy == "priority":
            return max(self.running[first_unscheduled:], key=Request.priority_key)
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self._batch.remove([self._batch.index_of(req)])
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.version += 1
        req.status = RequestStatus.PREEMPTED
        if req.seen_by_worker:
            req.seen_by_worker = False
            self._finished_for_worker.append(req.req_id)
        self.waiting.push_preempted(req)
        self.num_preemptions += 1

    def _retire(self, req: Request, park: bool = False) -> None:
        """A finished or aborted request lets go (the caller removes its batch row). ``park``:
        it finished a prefill for a remote decode; its prompt's full blocks (all but the
        block of the last token, which the decode side computes to sample) stay held until
        ``take_parked``'s taker releases them."""
        if park:
            keep = (req.num_prompt_tokens - 1) // self.config.block_size
            held = self.kv.hold_table(req.req_id, keep)
            if held:
                self._parked.append((req, [b.block_id for b in held]))
        else:
            self.kv.free(req.req_id)
        if req.kv_held:
            self.kv.release_hold(req.req_id)
            req.kv_held = False
        req.status = RequestStatus.FINISHED
        req.version += 1
        if req.seen_by_worker:
            req.seen_by_worker = False
            self._finished_for_worker.append(req.req_id)

    # -- results ------------------------------------------------------------------------
    def update(self, step: ScheduledStep, result: StepResult) -> list[EngineCoreOutput]:
        """Output processing: every live sampled row gets its token and one output; rows
        that stopped leave. Rows preempted or aborted in flight are skipped."""
        if step is not self._in_flight:
            raise ValueError(f"step {step.plan.step_id} is not the step in flight")
        self._in_flight = None
        self.kv.written()
        plan, batch = step.plan, self._batch
        sample = plan.sample_rows
        all_sampled = bool(sample.all())
        expected = plan.req_ids if all_sampled else list(compress(plan.req_ids, sample.tolist()))
        if result.req_ids != expected:
            raise ValueError(f"step {plan.step_id}: result rows {result.req_ids} do not match "
                             f"the plan's sampled rows {expected}")
        if result.prompt_logprobs:
            for req_id, chunk in result.prompt_logprobs.items():
                req = self.requests.get(req_id)
                if req is not None and req.status is RequestStatus.RUNNING:
                    store_prompt_logprobs(req, chunk)
        tokens = result.sampled_token_ids
        if batch.revision == step.revision:  # the step's rows are still the leading rows
            if all_sampled:
                rows: slice | np.ndarray = slice(0, len(step.reqs))
                reqs = step.reqs
            else:
                rows = np.flatnonzero(sample)
                reqs = [step.reqs[i] for i in rows.tolist()]
            result_rows = None
        else:  # rows left while it was in flight: their results are stale
            rows, result_rows, reqs = self._live_rows(step, sample)
            tokens = tokens[result_rows]
        token_list = tokens.tolist()
        outputs = append_tokens(reqs, token_list)
        if batch.num_wanting_logprobs:
            for k in np.flatnonzero(batch.wants_logprobs[rows]).tolist():
                add_logprobs(outputs[k], result,
                             k if result_rows is None else int(result_rows[k]),
                             reqs[k].logprobs_k)
        if batch.num_fresh:
            for k in np.flatnonzero(batch.fresh[rows]).tolist():
                add_first_output_extras(outputs[k], reqs[k])
        if result.pooled:  # the pooling runner: each prompt's vector with its only output
            for output in outputs:
                output.pooled = result.pooled.get(output.request_id)
        batch.append_tokens(rows, tokens)
        self.generation_tokens += len(reqs)
        finished = []
        max_model_len = self.config.max_model_len
        for k in maybe_stopped(tokens, batch.steps_left[rows], batch.stop_ids).tolist():
            req, output = reqs[k], outputs[k]
            output.finish_reason, output.stop_reason = check_stop(req, token_list[k],
                                                                  max_model_len)
            if output.finish_reason is not None:
                del self.requests[req.req_id]
                self._retire(req, park=req.park_kv and output.finish_reason is FinishReason.LENGTH)
                finished.append(k if isinstance(rows, slice) else int(rows[k]))
        if finished:
            batch.remove(sorted(finished))
        return outputs

    def _live_rows(self, step: ScheduledStep, sample: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, list[Request]]:
        """The step's sampled rows still running: their batch rows, their indices in the
        result, their requests (a request that left cannot have come back: scheduling
        waits for this update)."""
        where = {id(req): i for i, req in enumerate(self._batch.reqs)}
        rows, result_rows, reqs = [], [], []
        for k, i in enumerate(np.flatnonzero(sample).tolist()):
            req = step.reqs[i]
            if req.status is RequestStatus.RUNNING:
                rows.append(where[id(req)])
                result_rows.append(k)
                reqs.append(req)
        return np.asarray(rows, np.int64), np.asarray(result_rows, np.int64), reqs

    def take_parked(self) -> list[tuple[Request, list[int]]]:
        """Prefills that finished since the last call with their blocks held, and the held
        block ids (released with ``kv.release_hold``)."""
        parked, self._parked = self._parked, []
        return parked

    # -- observability ------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_kv_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_cached=self.prompt_tokens_cached,
            prompt_tokens_external=self.prompt_tokens_external,
            generation_tokens=self.generation_tokens,
            running_lora_adapters=adapters_of(self.running) if self.config.max_loras else [],
            waiting_lora_adapters=adapters_of(self.waiting) if self.config.max_loras else [],
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self._batch.check(self.kv.rows, {r: len(t) for r, t in self.kv.tables.items()},
                          self.config.block_size)
        holders = set(self.kv.tables)
        running = {r.req_id for r in self.running}
        if not holders <= running:
            raise AssertionError(f"requests hold blocks but are not running: {holders - running}")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")
        if self.config.max_loras and len(adapters_of(self.running)) > self.config.max_loras:
            raise AssertionError("more distinct LoRA adapters running than max_loras")
        if set(self.requests) != running | {r.req_id for r in self.waiting}:
            raise AssertionError("request registry disagrees with the running/waiting queues")
