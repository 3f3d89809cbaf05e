"""The engine client's routing rules, without an engine process: stale outputs are dropped,
a finished or aborted request gets nothing more, an engine death fails every live request."""

from __future__ import annotations

import asyncio

import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.frontend.engine_client import AsyncEngineClient, EngineDeadError
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)


@pytest.fixture
async def client():
    engine = AsyncEngineClient(EngineConfig(model="unused"))
    try:
        yield engine
    finally:
        await engine.shutdown()


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[1, 2],
                             sampling_params=SamplingParams())


def output(request_id: str, version: int, tokens: list[int],
           finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, version=version, new_token_ids=tokens,
                            finish_reason=finish)


def drain(stream) -> list[list[int]]:
    items = []
    while not stream.queue.empty():
        items.append(stream.queue.get_nowait().new_token_ids)
    return items


async def test_outputs_of_an_older_version_are_dropped(client):
    stream = client.add_request(request("a"))
    client._route(EngineCoreOutputs(outputs=[output("a", 0, [5]), output("a", 1, [6]),
                                             output("a", 0, [7]), output("a", 1, [8])]))
    assert drain(stream) == [[5], [6], [8]]  # [7] was computed before the preemption


async def test_nothing_reaches_a_request_after_it_finished_or_was_aborted(client):
    done = client.add_request(request("done"))
    gone = client.add_request(request("gone"))
    client.abort(["gone"])
    client._route(EngineCoreOutputs(outputs=[
        output("done", 0, [1], FinishReason.LENGTH), output("done", 0, [2]),
        output("gone", 0, [3]), output("never-added", 0, [4])]))
    assert drain(done) == [[1]]
    assert drain(gone) == []
    assert client.streams == {}


async def test_stats_arrive_with_outputs(client):
    seen = []
    client.on_stats = seen.append
    client._route(EngineCoreOutputs(stats=SchedulerStats(num_running=3)))
    assert client.stats.num_running == 3 and len(seen) == 1


async def test_an_engine_death_fails_every_live_request_and_refuses_new_ones(client):
    reasons = []
    client.on_dead = reasons.append
    streams = [client.add_request(request(str(i))) for i in range(3)]
    client._mark_dead("engine core process exited with code -9")
    for stream in streams:
        with pytest.raises(EngineDeadError, match="-9"):
            await asyncio.wait_for(stream.get(), 1)
    assert reasons == ["engine core process exited with code -9"]
    with pytest.raises(EngineDeadError):
        client.add_request(request("late"))
    assert client.is_dead and not client.is_ready
