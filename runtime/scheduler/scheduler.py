"""The scheduler: one token budget per step, running requests first, then admissions.

Per step (vLLM v1 style): every running request gets its share first (a decode 1 token, a
running prefill ``min(remaining, budget)``), so decode is never starved by prefill; a
running request that cannot get a block preempts the newest running request (or, under the
priority policy, the worst-priority one) by recompute. If nothing was preempted, waiting
requests are admitted while budget, ``max_num_seqs`` and blocks allow, prefix-cache hits
skipping their prefill (blocks an earlier row of the same step computes count: they are
hashed when scheduled, ``KVCacheManager.cache_blocks_ahead``). Chunked prefill is always on
and mixes with decodes in one step.

``schedule()`` returns a ``ScheduledStep`` (the plan plus the version of every row);
``update()`` consumes the StepResult and drops rows whose version moved on (preempted or
aborted while the step was in flight).

The leading running requests that decode form the decode batch (``decode_batch.py``):
their rows are planned and their outputs processed with array operations; the general
per-row path handles only the rest (prefills, admissions) and any step that preempts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shoal.runtime.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    SchedulerStats,
    TokenLogprobs,
)
from shoal.runtime.kv.kv_manager import KVCacheManager
from shoal.runtime.plan import NewRequestData, StepPlan, StepResult
from shoal.runtime.scheduler.decode_batch import DecodeBatch
from shoal.runtime.scheduler.lora_admission import LoraGate, adapters_of
from shoal.runtime.scheduler.plan_builder import StepRows, build_plan
from shoal.runtime.scheduler.request import Request, RequestStatus
from shoal.runtime.scheduler.row_logprobs import row_logprobs, store_prompt_logprobs
from shoal.runtime.scheduler.stops import check_stop
from shoal.runtime.scheduler.waiting_queue import make_waiting_queue


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 1024
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    model_revision: str = ""
    max_loras: int = 0  # LoRA adapter slots per step (0: LoRA off, no gate)


@dataclass
class ScheduledStep:
    plan: StepPlan
    rows: StepRows  # the rows after the decode batch's
    batch: DecodeBatch  # supplied the leading rows, one token each (maybe none)


class Scheduler:
    def __init__(self, config: SchedulerConfig, default_eos: list[int] | None = None) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        self.config = config
        self.default_eos = list(default_eos or [])
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.max_num_seqs,
                                 config.max_model_len, config.enable_prefix_caching)
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_for_worker: list[str] = []
        self._batch = DecodeBatch(config.max_model_len)  # always a prefix of running
        self._batch_in_flight = False
        self._step_id = 0
        self._arrivals = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

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
        aborted = False
        for req_id in request_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                aborted = True
                self._leave_batch(req)
            else:
                self.waiting.remove(req)
            self._retire(req)
        if aborted:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def revoke(self, req_ids: list[str], finished_for_worker: list[str]) -> None:
        """A step failed: preempt its running rows (recomputed later, outputs kept) and
        re-send the drop list the failed plan carried (dropping is idempotent)."""
        self._finished_for_worker.extend(finished_for_worker)
        self.kv.forget_unwritten()
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self._preempt(req)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        budget = self.config.max_num_batched_tokens
        block_size = self.config.block_size
        batch = self._batch
        if batch and (self._batch_in_flight or not batch.reserve_slots(self.kv, block_size)):
            # scheduled again before its update, or a row needs a block the pool lacks: the
            # general path takes every row (and decides who is preempted)
            batch = self._new_batch()
        rows, new_requests = self._schedule_rows(budget - len(batch), len(batch))
        if not batch and not rows.reqs:
            return None
        self._step_id += 1
        plan = build_plan(self._step_id, batch, rows, self.kv.block_table_array, block_size,
                          new_requests, self._finished_for_worker)
        self._finished_for_worker = []
        if batch:
            batch.advance()
            self._batch_in_flight = True
        return ScheduledStep(plan, rows, batch)

    def _new_batch(self) -> DecodeBatch:
        self._batch = DecodeBatch(self.config.max_model_len)
        self._batch_in_flight = False
        return self._batch

    def _leave_batch(self, req: Request) -> None:
        """``req`` stops running: if it is one of the batch's rows, start a new batch."""
        num_rows = len(self._batch)
        if num_rows and any(r is req for r in self.running[:num_rows]):
            self._new_batch()

    def _schedule_rows(self, budget: int, first: int
                       ) -> tuple[StepRows, list[NewRequestData]]:
        """The general path: running requests from index ``first`` on, row by row, then
        admissions."""
        block_size = self.config.block_size
        rows = StepRows()
        preempted = False
        kv = self.kv
        tables, table_rows = kv.tables, kv.rows
        running = self.running
        # the hot loop: StepRows.add inlined, list appends bound once
        add_req, add_id, add_count = rows.reqs.append, rows.req_ids.append, rows.counts.append
        add_start, add_row, add_sample = rows.starts.append, rows.table_rows.append, \
            rows.sample.append
        add_version, add_input, extend_input = rows.versions.append, rows.input_ids.append, \
            rows.input_ids.extend
        i = first
        while i < len(running) and budget > 0:
            req = running[i]
            req_id = req.req_id
            computed = req.num_computed_tokens
            tokens = req.all_token_ids
            num_tokens = len(tokens)
            count = num_tokens - computed
            if count > budget:
                count = budget
            table = tables.get(req_id)
            # fast path: the step's tokens fit the blocks it already holds
            if (table is None or computed + count > len(table) * block_size) \
                    and not kv.allocate_slots(req, computed, count):
                preempted = True
                if not self._preempt_until_allocated(req, i, count):
                    continue  # it preempted itself; running[i] is now the next request
            if count == 1:
                add_input(tokens[computed])
            else:
                extend_input(tokens[computed:computed + count])
                kv.cache_blocks_ahead(req, computed + count)  # shareable by admissions below
            add_req(req)
            add_id(req_id)
            add_count(count)
            add_start(computed)
            add_row(table_rows[req_id])
            add_sample(computed + count >= num_tokens)
            add_version(req.version)
            req.num_computed_tokens = computed + count
            budget -= count
            i += 1
        new_requests: list[NewRequestData] = []
        if not preempted:
            self._admit(budget, rows, new_requests)
        return rows, new_requests

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

    def _admit(self, budget: int, rows: StepRows, new_requests: list[NewRequestData]) -> None:
        kv, waiting = self.kv, self.waiting
        gate = LoraGate(self.config.max_loras, self.running) if self.config.max_loras else None
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = waiting.peek()
            if gate is not None and not gate.fits(req):  # its adapter waits for a slot
                found = gate.first_fitting(waiting)
                if found is None:
                    break
                req = found
            # prompt logprobs need every prompt position computed: no prefix-cache reads
            hits = kv.find_cached_prefix(req) if req.prompt_logprobs is None \
                or req.output_token_ids else []
            computed = len(hits) * self.config.block_size
            count = min(req.num_tokens - computed, budget)
            if not kv.allocate_slots(req, computed, count, hits):
                break
            kv.cache_blocks_ahead(req, computed + count)
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
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            req.seen_by_worker = True
            self.running.append(req)
            new_requests.append(NewRequestData(
                req_id=req.req_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                generator_offset=len(req.output_token_ids),
                lora_name=req.lora_name,
            ))
            rows.add(req, count, kv.rows[req.req_id])
            budget -= count

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """Among running requests not yet scheduled this step (the asking one included):
        the newest under FCFS, the worst (priority, arrival) under the priority policy."""
        if self.config.scheduling_policy == "priority":
            return max(self.running[first_unscheduled:], key=Request.priority_key)
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self._leave_batch(req)
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.version += 1
        req.status = RequestStatus.PREEMPTED
        if req.seen_by_worker:
            req.seen_by_worker = False
            self._finished_for_worker.append(req.req_id)
        self.waiting.push_preempted(req)
        self.num_preemptions += 1

    def _retire(self, req: Request) -> None:
        self.kv.free(req.req_id)
        req.status = RequestStatus.FINISHED
        req.version += 1
        if req.seen_by_worker:
            req.seen_by_worker = False
            self._finished_for_worker.append(req.req_id)

    # -- results ------------------------------------------------------------------------
    def update(self, step: ScheduledStep, result: StepResult) -> list[EngineCoreOutput]:
        self.kv.written()
        batch = step.batch
        if not batch:
            outputs = self._update_rows(step.plan, step.rows, result, 0)
        elif batch is not self._batch:  # its rows were revoked while the step was in flight
            rows = StepRows.of_step(batch, step.plan, step.rows)
            outputs = self._update_rows(step.plan, rows, result, 0)
        else:
            self._batch_in_flight = False
            num_rows = len(batch)  # before finished rows leave it
            outputs = self._update_batch(batch, result)
            if step.rows.reqs:
                outputs += self._update_rows(step.plan, step.rows, result, num_rows)
        if len(self.running) > len(self._batch):
            self._join_batch()
        if result.pooled:  # the pooling runner: each prompt's vector with its only output
            for output in outputs:
                output.pooled = result.pooled.get(output.request_id)
        return outputs

    def _update_batch(self, batch: DecodeBatch, result: StepResult) -> list[EngineCoreOutput]:
        """Output processing of the decode batch's rows (the result's leading rows)."""
        num_rows = len(batch)
        if result.req_ids[:num_rows] != batch.req_ids:
            raise ValueError(f"step {result.step_id}: result rows {result.req_ids} do not "
                             f"start with the decode batch's rows {batch.req_ids}")
        outputs, maybe_done = batch.absorb(result, self.kv, self.config.block_size)
        self.generation_tokens += num_rows
        finished = []
        for i in maybe_done:
            req, output = batch.reqs[i], outputs[i]
            output.finish_reason, output.stop_reason = check_stop(
                req, output.new_token_ids[0], self.config.max_model_len)
            if output.finish_reason is not None:
                finished.append(i)
                del self.requests[req.req_id]
                self._retire(req)
        if finished:
            batch.drop(finished)
            self.running = batch.reqs + self.running[num_rows:]
        return outputs

    def _join_batch(self) -> None:
        """Running requests after the batch that decode now join it, in running order (so
        the batch stays a prefix of running), as many as one step's token budget holds."""
        batch, running = self._batch, self.running
        start = end = len(batch)
        limit = min(len(running), self.config.max_num_batched_tokens)
        while end < limit and DecodeBatch.is_decoding(running[end]):
            end += 1
        if end > start:
            joining = running[start:end]
            batch.extend(joining, [self.kv.rows[r.req_id] for r in joining])

    def _update_rows(self, plan: StepPlan, rows: StepRows, result: StepResult,
                     first_result: int) -> list[EngineCoreOutput]:
        """Output processing row by row, stale rows skipped; their sampled tokens are the
        result's rows from ``first_result`` on."""
        sample_flags = rows.sample
        expected = rows.req_ids if all(sample_flags) else [
            rid for rid, s in zip(rows.req_ids, sample_flags, strict=True) if s]
        got = result.req_ids[first_result:] if first_result else result.req_ids
        if got != expected:
            raise ValueError(f"step {plan.step_id}: result rows {result.req_ids} do not match "
                             f"the plan's sampled rows {expected}")
        sampled = result.sampled_token_ids.tolist()
        prompt_chunks = result.prompt_logprobs
        outputs: list[EngineCoreOutput] = []
        kv = self.kv
        block_size = self.config.block_size
        max_model_len = self.config.max_model_len
        running_status = RequestStatus.RUNNING
        sample_index = first_result
        num_generated = 0
        any_finished = False
        for req, version, sample, count in zip(rows.reqs, rows.versions, sample_flags,
                                               rows.counts, strict=True):
            index = sample_index
            sample_index += sample
            if req.version != version or req.status is not running_status:
                continue  # preempted or aborted since it was scheduled: stale
            computed = req.num_computed_tokens
            if count == 1 and computed % block_size == 0:  # a decode filled a block
                kv.cache_full_blocks(req, computed)  # (longer chunks: hashed when scheduled)
            if prompt_chunks and req.req_id in prompt_chunks:
                store_prompt_logprobs(req, prompt_chunks[req.req_id])
            if not sample:
                continue
            token = sampled[index]
            req.all_token_ids.append(token)
            req.output_token_ids.append(token)
            num_generated += 1
            finish = stop_reason = None
            if (token in req.maybe_stop_ids or len(req.output_token_ids) >= req.max_tokens
                    or len(req.all_token_ids) >= max_model_len):
                finish, stop_reason = check_stop(req, token, max_model_len)
            output = EngineCoreOutput(request_id=req.req_id, version=version,
                                      new_token_ids=[token],
                                      num_cached_tokens=req.num_cached_tokens)
            if req.logprobs_k is not None:
                output.new_logprobs = row_logprobs(result, index, req.logprobs_k)
            if len(req.output_token_ids) == 1:  # its first output carries the phase stamps
                output.queued_time = req.queued_time
                output.scheduled_time = req.scheduled_time
                if req.prompt_logprobs is not None:
                    output.prompt_logprobs = [lp or TokenLogprobs(float("nan"), [], [])
                                              for lp in req.prompt_logprobs]
            outputs.append(output)
            if finish is not None:
                output.finish_reason = finish
                output.stop_reason = stop_reason
                any_finished = True
                del self.requests[req.req_id]
                self._retire(req)
        self.generation_tokens += num_generated
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        return outputs

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
            generation_tokens=self.generation_tokens,
            running_lora_adapters=adapters_of(self.running) if self.config.max_loras else [],
            waiting_lora_adapters=adapters_of(self.waiting) if self.config.max_loras else [],
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self._batch.check(self.running, self.kv.rows)
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
