"""A step that raises fails the request that tripped it, alone: the engine core keeps its
other requests (exact outputs, blocks freed at the end) and its batch size."""

from __future__ import annotations

import pytest

from .test_scheduler import prompt_of, reference, request


class Tripwire:
    """Wraps the fake executor: any plan that holds ``culprit`` raises, as a request whose
    data the model cannot handle would."""

    def __init__(self, executor, culprit: str, error: Exception) -> None:
        self.executor = executor
        self.culprit = culprit
        self.error = error
        self.batch_sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, plan):
        self.batch_sizes.append(len(plan.req_ids))
        if self.culprit in plan.req_ids:
            raise self.error
        return self.executor.execute(plan)


def test_a_batched_step_that_raises_fails_only_its_culprit(fake_engine, run_to_completion):
    core, executor = fake_engine(max_num_seqs=8)
    tripwire = Tripwire(executor, "bad", IndexError("index 7 is out of bounds"))
    core.executor = tripwire
    prompts = {name: prompt_of(6, i) for i, name in enumerate(["a", "b", "bad", "c"])}
    for name, prompt in prompts.items():
        core.add_request(request(name, prompt, max_tokens=5))
    tokens, reasons = run_to_completion(core)
    failures = core.take_failures()
    assert [f.request_id for f in failures] == ["bad"]
    assert "bad" not in reasons
    for name in ("a", "b", "c"):  # outputs as if nothing happened (recomputed, not redone)
        assert tokens[name] == reference(executor, prompts[name], 5)
    assert tripwire.batch_sizes[0] == 4  # the failed batch, then suspects one at a time
    assert core.scheduler.config.max_num_seqs == 8  # restored once the suspects cleared
    assert not core.isolation.suspects


@pytest.mark.parametrize("fatal", [MemoryError(), type("OutOfMemoryError", (RuntimeError,), {})()])
def test_out_of_memory_is_still_fatal(fake_engine, fatal):
    core, executor = fake_engine()
    core.executor = Tripwire(executor, "a", fatal)
    core.add_request(request("a", prompt_of(6, 1)))
    with pytest.raises(type(fatal)):
        core.step()
