"""The running batch: every running request is a row of persistent arrays from which each
step is planned and its result processed, whatever the rows do (decode, prefill, both).
These tests pin down its plans, that outputs stay exact and with their row when batch mates
finish, join or are preempted, and when blocks reach the prefix cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest, FinishReason
from shoal.runtime.wire.plan import StepResult


def request(req_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
            **params) -> EngineCoreRequest:
    params.setdefault("temperature", 0.0)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, priority=priority,
                             sampling_params=SamplingParams(max_tokens=max_tokens, **params))


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def reference(executor, prompt: list[int], max_tokens: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(executor.expected_next(context))
        context.append(out[-1])
    return out


def test_decoding_requests_step_through_the_batch_and_finish_exactly(fake_engine,
                                                                     run_to_completion):
    core, executor = fake_engine(block_size=4)
    prompts = {f"r{i}": prompt_of(3 + 2 * i, i) for i in range(5)}
    lengths = {"r0": 2, "r1": 9, "r2": 5, "r3": 13, "r4": 5}  # finishes mid-batch, two at once
    for req_id, prompt in prompts.items():
        core.add_request(request(req_id, prompt, lengths[req_id]))
    tokens, reasons = run_to_completion(core)
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference(executor, prompt, lengths[req_id]), req_id
        assert reasons[req_id] == FinishReason.LENGTH
    decode_plans = executor.plans[1:]
    assert decode_plans[0].req_ids == list(prompts)  # r0 finishes on this step's token
    assert decode_plans[1].req_ids == ["r1", "r2", "r3", "r4"]
    assert decode_plans[1].finished_req_ids == ["r0"]  # the worker hears of it next step
    for prev, plan in zip(decode_plans, decode_plans[1:], strict=False):
        rows = [prev.req_ids.index(r) for r in plan.req_ids]
        assert plan.positions.tolist() == (prev.positions[rows] + 1).tolist()
        assert plan.query_start_loc.tolist() == list(range(plan.num_reqs + 1))


def test_an_arrival_prefills_in_chunks_beside_a_decode_then_decodes_with_it(
        fake_engine, run_to_completion):
    core, executor = fake_engine(block_size=4, max_num_batched_tokens=8)
    prompts = {"a": prompt_of(5, 1), "b": prompt_of(11, 2)}
    core.add_request(request("a", prompts["a"], 12))
    first = [out.new_token_ids[0] for _ in range(2) for out in core.step()]
    running = core.scheduler.running
    assert [r.req_id for r in running] == ["a"]
    core.add_request(request("b", prompts["b"], 4))  # chunked: 7 tokens, then 4
    outputs = core.step()
    core.check_invariants()
    assert [r.req_id for r in running] == ["a", "b"]
    assert executor.plans[-1].query_start_loc.tolist() == [0, 1, 8]
    assert executor.plans[-1].sample_rows.tolist() == [True, False]
    outputs += core.step()
    core.check_invariants()
    assert executor.plans[-1].query_start_loc.tolist() == [0, 1, 5]
    assert executor.plans[-1].sample_rows.tolist() == [True, True]
    tokens, _ = run_to_completion(core)
    for out in reversed(outputs):
        tokens[out.request_id].insert(0, out.new_token_ids[0])
    tokens["a"][:0] = first
    for req_id, max_tokens in (("a", 12), ("b", 4)):
        assert tokens[req_id] == reference(executor, prompts[req_id], max_tokens), req_id


def test_a_waiting_request_does_not_stop_the_decodes_and_is_admitted_when_blocks_free(
        fake_engine):
    core, executor = fake_engine(block_size=4, num_kv_blocks=8, max_num_seqs=4)
    prompts = {"a": prompt_of(10, 1), "b": prompt_of(10, 2), "c": prompt_of(10, 3)}
    lengths = {"a": 3, "b": 6, "c": 3}
    tokens: dict[str, list[int]] = {}
    core.add_request(request("a", prompts["a"], lengths["a"]))
    core.add_request(request("b", prompts["b"], lengths["b"]))
    sizes = []  # (batch rows, waiting) after each step
    while core.has_unfinished_requests():
        if len(executor.plans) == 1:
            core.add_request(request("c", prompts["c"], lengths["c"]))  # 3 blocks, 2 free
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        core.check_invariants()
        sizes.append((len(core.scheduler.running), len(core.scheduler.waiting)))
    # c waits while a and b decode; a finishes, freeing blocks; c is admitted next step,
    # its whole prompt in one chunk, in the row behind b
    assert sizes[:4] == [(2, 0), (2, 1), (1, 1), (2, 0)]
    assert executor.plans[3].req_ids == ["b", "c"] and executor.plans[3].new_requests
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference(executor, prompt, lengths[req_id]), req_id


class LogprobExecutor:
    """Wraps the context-hash executor: each sampled token's logprob is -token/1000 and its
    single top alternative is the token itself, so an output shows which row it came from."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, plan) -> StepResult:
        result = self.inner.execute(plan)
        tokens = result.sampled_token_ids
        result.logprobs = (-tokens / 1000).astype(np.float32)
        result.top_token_ids = tokens[:, None].copy()
        result.top_logprobs = result.logprobs[:, None].copy()
        return result


def test_logprobs_stay_with_their_row_when_batch_mates_finish_or_join(fake_engine):
    core, executor = fake_engine(block_size=4)
    core.executor = LogprobExecutor(executor)
    core.add_request(request("short", prompt_of(4, 1), 2))
    core.add_request(request("plain", prompt_of(5, 2), 6))
    core.add_request(request("lp", prompt_of(6, 3), 6, logprobs=1))
    core.add_request(request("lp0", prompt_of(7, 4), 4, logprobs=0))
    seen = {}
    while core.has_unfinished_requests():
        if len(executor.plans) == 2:  # sampled beside the batch's rows, then joins them
            core.add_request(request("late", prompt_of(9, 5), 4, logprobs=1))
        for out in core.step():
            seen.setdefault(out.request_id, []).append(out)
        core.check_invariants()
    assert executor.plans[2].req_ids == ["plain", "lp", "lp0", "late"]  # short is done
    assert all(o.new_logprobs is None for o in seen["plain"] + seen["short"])
    assert len(seen["late"]) == 4
    for out in seen["lp"] + seen["late"]:
        token = out.new_token_ids[0]
        (lp,) = out.new_logprobs
        assert lp.top_token_ids == [token] and abs(lp.logprob + token / 1000) < 1e-6
    for out in seen["lp0"]:
        (lp,) = out.new_logprobs
        assert lp.top_token_ids == [] and abs(lp.logprob + out.new_token_ids[0] / 1000) < 1e-6


def test_blocks_filled_while_decoding_are_cached_under_their_chained_hash(fake_engine):
    from shoal.runtime.kv.block_hash import hash_prefix_blocks

    core, _ = fake_engine(block_size=4)
    for i in range(3):
        core.add_request(request(f"r{i}", prompt_of(5 + 3 * i, i), 20))
    kv = core.scheduler.kv
    checked = 0
    while core.has_unfinished_requests():
        core.step()
        for req in core.scheduler.running:
            full = req.num_computed_tokens // 4
            want = hash_prefix_blocks(req.all_token_ids, 4, req.extra_digest)[:full]
            assert req.block_hashes[:full] == want, req.req_id
            table = kv.tables[req.req_id]
            assert all(kv.pool.cached[h] is table[i] for i, h in enumerate(want)), req.req_id
            checked += full
    assert checked > 50


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_arrivals_aborts_in_flight_and_preemption_stay_exact(fake_engine, policy):
    """Steps driven by hand so aborts and preemptions also land between schedule and
    update; every finished request's tokens must equal the reference."""
    rng = random.Random(7)
    core, executor = fake_engine(block_size=4, num_kv_blocks=24, max_model_len=64,
                                 max_num_batched_tokens=20, max_num_seqs=10,
                                 scheduling_policy=policy)
    executor.script = {}
    scheduler = core.scheduler
    expected, tokens, reasons = {}, {}, {}
    preempted_by_hand = 0
    for i in range(60):
        prompt = prompt_of(rng.randint(1, 24), 100 + i)
        max_tokens = rng.randint(1, 20)
        req_id = f"r{i}"
        stop = rng.random() < 0.2
        core.add_request(request(req_id, prompt, max_tokens, priority=rng.randint(0, 3),
                                 stop_token_ids=[1] if stop else []))
        want = reference(executor, prompt, max_tokens)
        if stop:  # the script makes it emit the stop token at a random point
            cut = rng.randint(1, max_tokens)
            executor.script[req_id] = want[:cut - 1] + [1]
            want = executor.script[req_id]
        expected[req_id] = want
        for _ in range(rng.randint(0, 4)):
            scheduled = scheduler.schedule()
            if scheduled is None:
                break
            result = executor.execute(scheduled.plan)
            if rng.random() < 0.1 and scheduler.running:  # revoked while in flight
                victim = rng.choice(scheduler.running)
                if rng.random() < 0.5:
                    core.abort_requests([victim.req_id])
                else:
                    scheduler._preempt(victim)
                    preempted_by_hand += 1
            for out in scheduler.update(scheduled, result):
                assert out.request_id not in reasons
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
            core.check_invariants()
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        core.check_invariants()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert core.stats().num_preemptions > preempted_by_hand > 0  # memory preempted too
    for req_id, want in expected.items():
        got = tokens.get(req_id, [])
        if req_id in reasons:
            assert got == want, req_id
        else:  # aborted: a prefix of what it would have said
            assert got == want[:len(got)], req_id


def test_one_step_in_flight_at_a_time(fake_engine, run_to_completion):
    core, executor = fake_engine(block_size=4)
    core.add_request(request("a", prompt_of(6, 1), 5))
    scheduler = core.scheduler
    scheduled = scheduler.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.schedule()  # its rows' tokens are not known yet
    result = executor.execute(scheduled.plan)
    scheduler.update(scheduled, result)
    with pytest.raises(ValueError, match="not the step in flight"):
        scheduler.update(scheduled, result)  # once only
    scheduled = scheduler.schedule()
    scheduler.revoke(scheduled.plan.req_ids, [])  # a failed step ends too
    core.check_invariants()
    tokens, _ = run_to_completion(core)
    assert tokens["a"] == reference(executor, prompt_of(6, 1), 5)[1:]


def test_a_decode_offers_the_block_it_fills_when_scheduled_and_a_failed_step_unoffers_it(
        fake_engine):
    core, executor = fake_engine(block_size=4)
    core.add_request(request("a", prompt_of(6, 1), 8))
    scheduler, kv = core.scheduler, core.scheduler.kv
    core.step()  # the prompt: block 0 full and cached, block 1 holds positions 4-5
    core.step()  # position 6 decoded (its input was the first sampled token)
    assert len(kv.pool.cached) == 1
    scheduled = scheduler.schedule()  # position 7 fills block 1: hashed now, for sharers
    assert scheduled.plan.positions.tolist() == [7]
    assert len(kv.pool.cached) == 2
    scheduler.revoke(scheduled.plan.req_ids, [])  # its K/V may never have been written
    assert len(kv.pool.cached) == 1
    core.check_invariants()
    scheduled = scheduler.schedule()  # a recomputes after its cached block 0
    assert scheduled.plan.positions.tolist() == [4, 5, 6, 7]  # block 0 still cached
    scheduler.update(scheduled, executor.execute(scheduled.plan))
    assert len(kv.pool.cached) == 2
    core.check_invariants()
