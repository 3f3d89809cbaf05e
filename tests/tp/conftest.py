"""TP fixtures: engines over the tiny checkpoints, greedy runs, and process bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.engine.messages import EngineCoreOutput, EngineCoreRequest
from shoal.runtime.sampling_params import SamplingParams


@pytest.fixture
def make_engine() -> Iterator[Callable[..., EngineCore]]:
    """EngineCore over a checkpoint with ``tensor_parallel_size``; shut down after the test."""
    engines: list[EngineCore] = []

    def make(model_dir: Path, tp: int, **overrides: object) -> EngineCore:
        settings: dict[str, object] = {"num_kv_blocks": 96, "max_num_seqs": 8,
                                       "max_num_batched_tokens": 48, "rank_timeout": 30.0}
        settings.update(overrides)
        config = EngineConfig.from_kwargs(str(model_dir), tensor_parallel_size=tp, **settings)
        core = EngineCore(config)
        engines.append(core)
        return core

    yield make
    for core in engines:
        core.shutdown()


def greedy_request(req_id: str, prompt: list[int], max_tokens: int,
                   logprobs: int | None = None) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params)


@pytest.fixture
def run_to_completion() -> Callable[..., dict[str, list[EngineCoreOutput]]]:
    """Add the requests, step until idle; outputs per request id in arrival order."""

    def run(core: EngineCore, requests: list[EngineCoreRequest]
            ) -> dict[str, list[EngineCoreOutput]]:
        for request in requests:
            core.add_request(request)
        outputs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
        while core.has_unfinished_requests():
            for out in core.step():
                outputs[out.request_id].append(out)
        return outputs

    return run


@pytest.fixture
def greedy() -> Callable[..., EngineCoreRequest]:
    return greedy_request


def wait_until_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Pids still alive (zombies count as gone) after waiting up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture
def alive_after() -> Callable[[list[int], float], list[int]]:
    return wait_until_gone
