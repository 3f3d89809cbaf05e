"""The steady decode batch: once every running request decodes, steps are planned from
persistent arrays. These tests pin down when it applies, that its plans and outputs are the
general path's, and that rows keep their identity when batch mates finish."""

from __future__ import annotations

import random

import numpy as np
from shoal.runtime.engine.messages import EngineCoreRequest, FinishReason
from shoal.runtime.plan import StepResult
from shoal.runtime.sampling_params import SamplingParams


def request(req_id: str, prompt: list[int], max_tokens: int, **params) -> EngineCoreRequest:
    params.setdefault("temperature", 0.0)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
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
    in_batch = []
    tokens, reasons = run_to_completion(
        core, on_step=lambda _: in_batch.append(core.scheduler._batch is not None))
    assert in_batch[0] and all(in_batch[:-1]) and not in_batch[-1]  # built after the prefill
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


def test_an_arrival_leaves_the_batch_and_the_next_full_decode_builds_a_new_one(
        fake_engine, run_to_completion):
    core, executor = fake_engine(block_size=4, max_num_batched_tokens=8)
    core.add_request(request("a", prompt_of(5, 1), 12))
    core.step()
    core.step()
    assert core.scheduler._batch is not None
    core.add_request(request("b", prompt_of(11, 2), 4))  # chunked: two steps of prefill
    core.step()
    assert core.scheduler._batch is None
    core.step()
    assert core.scheduler._batch is not None
    assert [p.req_ids for p in executor.plans[-2:]] == [["a", "b"]] * 2
    tokens, _ = run_to_completion(core)
    assert len(tokens["a"]) == 12 - 4 and len(tokens["b"]) == 3


def test_a_waiting_request_keeps_the_general_path_while_it_could_join(fake_engine):
    core, _ = fake_engine(block_size=4, num_kv_blocks=8, max_num_seqs=4)
    core.add_request(request("a", prompt_of(10, 1), 30))
    core.add_request(request("b", prompt_of(10, 2), 30))
    core.step()
    core.add_request(request("c", prompt_of(10, 3), 3))  # no blocks for it yet
    for _ in range(3):
        core.step()
        core.check_invariants()
        assert core.scheduler._batch is None and len(core.scheduler.waiting) == 1


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


def test_logprobs_stay_with_their_row_when_batch_mates_finish(fake_engine):
    core, executor = fake_engine(block_size=4)
    core.executor = LogprobExecutor(executor)
    core.add_request(request("short", prompt_of(4, 1), 2))
    core.add_request(request("plain", prompt_of(5, 2), 6))
    core.add_request(request("lp", prompt_of(6, 3), 6, logprobs=1))
    core.add_request(request("lp0", prompt_of(7, 4), 4, logprobs=0))
    seen = {}
    while core.has_unfinished_requests():
        for out in core.step():
            seen.setdefault(out.request_id, []).append(out)
        core.check_invariants()
    assert all(o.new_logprobs is None for o in seen["plain"] + seen["short"])
    for out in seen["lp"]:
        token = out.new_token_ids[0]
        (lp,) = out.new_logprobs
        assert lp.top_token_ids == [token] and abs(lp.logprob + token / 1000) < 1e-6
    for out in seen["lp0"]:
        (lp,) = out.new_logprobs
        assert lp.top_token_ids == [] and abs(lp.logprob + out.new_token_ids[0] / 1000) < 1e-6
