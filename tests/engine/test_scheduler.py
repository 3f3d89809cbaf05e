"""Scheduler and engine core over a fake executor that reads every context back through
the block tables: decode-first, one token budget, chunking, prefix hits, preemption,
priority, max_num_seqs, stale results, stops, and bad input."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest, FinishReason


def request(req_id: str, prompt: list[int], max_tokens: int = 8, priority: int = 0,
            arrival: float = 0.0, **params) -> EngineCoreRequest:
    params.setdefault("temperature", 0.0)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, priority=priority,
                             arrival_time=arrival,
                             sampling_params=SamplingParams(max_tokens=max_tokens, **params))


def reference(executor, prompt: list[int], max_tokens: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(max_tokens):
        token = executor.expected_next(context)
        context.append(token)
        out.append(token)
    return out


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def test_decodes_go_first_and_a_prefill_takes_what_is_left(fake_engine):
    core, executor = fake_engine(max_num_batched_tokens=8)
    core.add_request(request("a", prompt_of(3, 1)))
    core.add_request(request("b", prompt_of(4, 2)))
    core.step()  # both prefills fit: 3 + 4 tokens
    core.add_request(request("c", prompt_of(30, 3)))
    core.step()
    plan = executor.plans[-1]
    assert plan.req_ids == ["a", "b", "c"]
    assert plan.query_start_loc.tolist() == [0, 1, 2, 8]  # decode, decode, 6-token chunk
    assert plan.sample_rows.tolist() == [True, True, False]


def test_chunked_prefill_respects_the_budget_and_samples_only_at_the_end(fake_engine,
                                                                         run_to_completion):
    core, executor = fake_engine(max_num_batched_tokens=16)
    prompt = prompt_of(40, 4)
    core.add_request(request("a", prompt, max_tokens=3))
    tokens, _ = run_to_completion(core)
    chunks = [p.num_tokens for p in executor.plans]
    assert chunks == [16, 16, 8, 1, 1]
    assert [bool(p.sample_rows[0]) for p in executor.plans] == [False, False, True, True, True]
    assert tokens["a"] == reference(executor, prompt, 3)


def test_budget_and_max_num_seqs_hold_every_step(fake_engine, run_to_completion):
    core, executor = fake_engine(max_num_batched_tokens=20, max_num_seqs=3)
    prompts = {f"r{i}": prompt_of(5 + 7 * i, i) for i in range(8)}
    for req_id, prompt in prompts.items():
        core.add_request(request(req_id, prompt, max_tokens=5))
    tokens, _ = run_to_completion(
        core, on_step=lambda _: _check(core.stats().num_running <= 3))
    assert all(p.num_tokens <= 20 and p.num_reqs <= 3 for p in executor.plans)
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference(executor, prompt, 5)


def _check(ok: bool) -> None:
    assert ok


def test_prefix_cache_hits_skip_prefill_and_keep_outputs_exact(fake_engine, run_to_completion):
    core, executor = fake_engine()
    system = prompt_of(21, 7)
    core.add_request(request("first", system + [11, 12], max_tokens=4))
    first_token = [out.new_token_ids[0] for out in core.step()]
    core.add_request(request("second", system + [13], max_tokens=4))  # arrives while running
    tokens, _ = run_to_completion(core)
    tokens["first"] = first_token + tokens["first"]
    stats = core.stats()
    assert stats.prefix_cache_hits == 20  # 5 full blocks of 4 of the shared 21 tokens
    second_prefill = next(p for p in executor.plans if "second" in p.req_ids)
    row = second_prefill.req_ids.index("second")
    assert second_prefill.positions[second_prefill.query_start_loc[row]] == 20
    assert tokens["second"] == reference(executor, system + [13], 4)
    assert tokens["first"] == reference(executor, system + [11, 12], 4)


def test_requests_admitted_in_one_step_compute_their_shared_prefix_once(fake_engine,
                                                                        run_to_completion):
    core, executor = fake_engine()
    system = prompt_of(21, 12)
    prompts = {f"user{i}": system + prompt_of(3, 20 + i) for i in range(4)}
    for req_id, prompt in prompts.items():
        core.add_request(request(req_id, prompt, max_tokens=3))
    tokens, _ = run_to_completion(core)
    first = executor.plans[0]
    assert first.req_ids == list(prompts)  # all four admitted in one step
    query_lens = [int(n) for n in first.query_start_loc[1:] - first.query_start_loc[:-1]]
    assert query_lens == [24, 4, 4, 4]  # the others read user0's 5 blocks as it writes them
    assert core.stats().prefix_cache_hits == 3 * 20
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference(executor, prompt, 3)


def test_a_failed_step_forgets_the_blocks_it_hashed_ahead(fake_engine, run_to_completion):
    core, executor = fake_engine()
    system = prompt_of(21, 13)
    core.add_request(request("a", system + [11], max_tokens=3))
    core.add_request(request("b", system + [12], max_tokens=3))
    scheduler = core.scheduler
    scheduled = scheduler.schedule()  # b shares a's blocks before a's step has run
    assert scheduled is not None and scheduled.plan.req_ids == ["a", "b"]
    scheduler.revoke(["a", "b"], [])  # the step failed: none of its K/V can be trusted
    assert not scheduler.kv.pool.cached
    core.check_invariants()
    tokens, _ = run_to_completion(core)  # both recompute the prefix: the outputs are exact
    assert tokens["a"] == reference(executor, system + [11], 3)
    assert tokens["b"] == reference(executor, system + [12], 3)


def test_whole_prompt_in_cache_still_recomputes_its_last_token(fake_engine, run_to_completion):
    core, executor = fake_engine()
    prompt = prompt_of(16, 8)  # exactly 4 full blocks
    core.add_request(request("a", prompt, max_tokens=2))
    run_to_completion(core)
    core.add_request(request("b", prompt, max_tokens=2))
    tokens, _ = run_to_completion(core)
    plan = next(p for p in executor.plans if p.req_ids == ["b"])
    assert plan.num_tokens == 4 and plan.positions.tolist() == [12, 13, 14, 15]
    assert tokens["b"] == reference(executor, prompt, 2)


def test_preemption_takes_the_newest_and_recomputes_exactly(fake_engine, run_to_completion):
    core, executor = fake_engine(num_kv_blocks=10, max_model_len=40,
                                 enable_prefix_caching=False)
    prompts = {"old": prompt_of(6, 9), "mid": prompt_of(6, 10), "new": prompt_of(6, 11)}
    for req_id, prompt in prompts.items():
        core.add_request(request(req_id, prompt, max_tokens=10))
    preempted_first = []

    def watch(_step: int) -> None:
        if core.stats().num_preemptions and not preempted_first:
            waiting = [r.req_id for r in core.scheduler.waiting]
            preempted_first.extend(waiting)

    tokens, _ = run_to_completion(core, on_step=watch)
    assert core.stats().num_preemptions > 0
    assert preempted_first == ["new"]
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference(executor, prompt, 10)


def test_preempted_request_resumes_with_its_outputs_and_a_new_version(fake_engine):
    core, executor = fake_engine(num_kv_blocks=8, max_model_len=32)
    core.add_request(request("a", prompt_of(7, 12), max_tokens=20))
    core.add_request(request("b", prompt_of(7, 13), max_tokens=20))
    while not core.stats().num_preemptions:
        core.step()
        core.check_invariants()
    victim = core.scheduler.requests["b"]
    assert victim.version == 1 and victim.num_computed_tokens == 0 and victim.output_token_ids
    assert "b" in executor.plans[-1].finished_req_ids  # the worker drops its state
    outputs_at_preemption = list(victim.output_token_ids)
    seen = len(executor.plans)
    while victim.status.name != "RUNNING":
        core.step()
    resent = [new for plan in executor.plans[seen:] for new in plan.new_requests
              if new.req_id == "b"]
    assert len(resent) == 1
    assert resent[0].output_token_ids == outputs_at_preemption
    assert resent[0].generator_offset == len(outputs_at_preemption)


def test_priority_policy_admits_by_priority_then_arrival(fake_engine):
    core, executor = fake_engine(scheduling_policy="priority", max_num_seqs=1)
    core.add_request(request("late-low", prompt_of(3, 1), priority=5, arrival=1.0, max_tokens=1))
    core.add_request(request("high", prompt_of(3, 2), priority=0, arrival=2.0, max_tokens=1))
    core.add_request(request("early-low", prompt_of(3, 3), priority=5, arrival=0.5,
                             max_tokens=1))
    order = []
    while core.has_unfinished_requests():
        order.extend(out.request_id for out in core.step())
    assert order == ["high", "early-low", "late-low"]


def test_fcfs_admits_in_arrival_order(fake_engine):
    core, _ = fake_engine(max_num_seqs=1)
    for i, prio in enumerate([5, 0, 3]):
        core.add_request(request(f"r{i}", prompt_of(3, i), priority=prio, max_tokens=1))
    order = []
    while core.has_unfinished_requests():
        order.extend(out.request_id for out in core.step())
    assert order == ["r0", "r1", "r2"]


def test_results_for_a_preempted_or_aborted_version_are_discarded(fake_engine):
    core, executor = fake_engine()
    core.add_request(request("a", prompt_of(5, 1)))
    core.add_request(request("b", prompt_of(5, 2)))
    core.step()
    scheduled = core.scheduler.schedule()  # a step "in flight"
    result = executor.execute(scheduled.plan)
    core.scheduler._preempt(core.scheduler.requests["b"])
    core.abort_requests(["a"])
    assert core.scheduler.update(scheduled, result) == []
    assert core.scheduler.requests["b"].output_token_ids == [
        reference(executor, prompt_of(5, 2), 1)[0]]
    core.check_invariants()


def test_abort_frees_blocks_and_sends_nothing_more(fake_engine, run_to_completion):
    core, executor = fake_engine()
    core.add_request(request("a", prompt_of(9, 1), max_tokens=50))
    core.add_request(request("b", prompt_of(9, 2), max_tokens=3))
    core.step()
    core.abort_requests(["a", "unknown-id"])
    core.check_invariants()
    tokens, _ = run_to_completion(core)
    assert "a" not in tokens
    assert "a" in executor.plans[-1].finished_req_ids or any(
        "a" in p.finished_req_ids for p in executor.plans)


def test_stops_eos_stop_token_min_tokens_and_ignore_eos(fake_engine, run_to_completion):
    core, executor = fake_engine()
    executor.script = {"eos": [5, 0, 6], "early-eos": [0, 0, 7, 0], "stop": [5, 9],
                       "ignore": [0, 0, 0]}
    core.add_request(request("eos", prompt_of(3, 1)))
    core.add_request(request("early-eos", prompt_of(3, 2), min_tokens=2))
    core.add_request(request("stop", prompt_of(3, 3), stop_token_ids=[9]))
    core.add_request(request("ignore", prompt_of(3, 4), max_tokens=3, ignore_eos=True))
    outputs = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert [o.new_token_ids[0] for o in outputs["eos"]] == [5, 0]
    assert outputs["eos"][-1].finish_reason == FinishReason.STOP
    assert [o.new_token_ids[0] for o in outputs["early-eos"]] == [0, 0]  # 2nd EOS allowed
    assert outputs["stop"][-1].stop_reason == 9
    assert [o.new_token_ids[0] for o in outputs["ignore"]] == [0, 0, 0]
    assert outputs["ignore"][-1].finish_reason == FinishReason.LENGTH


def test_max_model_len_ends_generation(fake_engine):
    core, _ = fake_engine(max_model_len=12)
    core.add_request(request("a", prompt_of(9, 1), max_tokens=None))
    outs = []
    while core.has_unfinished_requests():
        outs.extend(core.step())
    assert len(outs) == 3 and outs[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt": list(range(3, 40))}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [3, 4, 9999]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"min_tokens": 30, "max_tokens": 40}, "min_tokens"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_input_is_rejected_naming_the_parameter_with_state_untouched(fake_engine, kwargs,
                                                                         param):
    core, _ = fake_engine(max_model_len=32)
    core.add_request(request("ok", prompt_of(5, 1)))
    core.step()
    before = (core.stats(), core.scheduler.kv.num_free_blocks, set(core.scheduler.requests))
    prompt = kwargs.pop("prompt", prompt_of(4, 2))
    with pytest.raises(InvalidParameter) as err:
        core.add_request(request("bad", prompt, **kwargs))
    assert err.value.param == param and param in str(err.value)
    assert (core.stats(), core.scheduler.kv.num_free_blocks, set(core.scheduler.requests)) \
        == before
    core.check_invariants()


def test_unknown_sampling_parameter_and_duplicate_id_are_errors(fake_engine):
    from shoal.runtime.sampling_params import sampling_params_from_kwargs

    with pytest.raises(InvalidParameter, match="bogus") as err:
        sampling_params_from_kwargs(temperature=0.0, bogus=1)
    assert err.value.param == "bogus"
    core, _ = fake_engine()
    core.add_request(request("a", prompt_of(4, 1)))
    with pytest.raises(ValueError, match="already"):
        core.add_request(request("a", prompt_of(4, 1)))


def test_random_workload_with_aborts_and_tight_memory_stays_exact(fake_engine,
                                                                  run_to_completion):
    rng = random.Random(0)
    core, executor = fake_engine(num_kv_blocks=24, max_model_len=64,
                                 max_num_batched_tokens=24, max_num_seqs=6)
    shared = prompt_of(12, 99)
    expected = {}
    aborted = set()
    tokens: dict[str, list[int]] = {}
    for i in range(40):
        prompt = (shared if rng.random() < 0.5 else []) + prompt_of(rng.randint(1, 20), i)
        max_tokens = rng.randint(1, 12)
        core.add_request(request(f"r{i}", prompt, max_tokens=max_tokens))
        expected[f"r{i}"] = reference(executor, prompt, max_tokens)
        for _ in range(rng.randint(0, 3)):
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            core.check_invariants()
        if rng.random() < 0.15:
            victim = rng.choice(sorted(core.scheduler.requests))
            core.abort_requests([victim])
            aborted.add(victim)
    rest, _ = run_to_completion(core)
    for req_id, toks in rest.items():
        tokens.setdefault(req_id, []).extend(toks)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for req_id, want in expected.items():
        if req_id in aborted:
            assert want[:len(tokens.get(req_id, []))] == tokens.get(req_id, [])
        else:
            assert tokens[req_id] == want, req_id
