"""The LoRA admission gate over the fake executor: with one adapter slot, a request for a
second adapter waits (never fails) while base requests and requests for the running adapter
are admitted past it; the stats name the running and waiting adapters."""

from __future__ import annotations

from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest


def request(req_id: str, adapter: str | None, max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=[5, 6, 7, 8, 9],
                             sampling_params=SamplingParams(temperature=0.0,
                                                            max_tokens=max_tokens),
                             adapter_id=adapter)


def test_an_adapter_without_a_slot_waits_while_others_pass_it(fake_engine, run_to_completion):
    core, executor = fake_engine(enable_lora=True, max_loras=1)
    executor.add_lora = lambda name, path: None  # the fake model takes any adapter
    executor.remove_lora = lambda name: None
    core.add_lora("x", "/adapters/x")
    core.add_lora("y", "/adapters/y")
    for req_id, adapter in (("x1", "x"), ("y1", "y"), ("base", None), ("x2", "x")):
        core.add_request(request(req_id, adapter, max_tokens=6 if adapter == "x" else 2))
    first_tokens = {out.request_id: len(out.new_token_ids) for out in core.step()}
    first = executor.plans[-1]
    assert sorted(first.req_ids) == ["base", "x1", "x2"]  # y1 waits; the others pass it
    assert [n.lora_name for n in first.new_requests] == ["x", None, "x"]
    stats = core.stats()
    assert stats.running_lora_adapters == ["x"] and stats.waiting_lora_adapters == ["y"]
    tokens, _ = run_to_completion(core)  # checks at most max_loras adapters every step
    assert len(tokens["y1"]) == 2 and len(tokens["x1"]) + first_tokens["x1"] == 6
    started = {}
    for index, plan in enumerate(executor.plans):
        for new in plan.new_requests:
            started.setdefault(new.req_id, index)
    last_x = max(i for i, p in enumerate(executor.plans) if {"x1", "x2"} & set(p.req_ids))
    assert started["y1"] > last_x  # y ran only once x had left its slot


def test_unknown_adapters_are_refused_and_lora_off_has_no_gate(fake_engine):
    core, _ = fake_engine()
    try:
        core.add_request(request("r", "nope"))
    except ValueError as exc:
        assert "does not exist" in str(exc)
    else:
        raise AssertionError("an adapter the engine does not serve was accepted")
    assert core.scheduler.config.max_loras == 0
