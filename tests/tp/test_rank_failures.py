"""A dead, hung or failing rank is fatal, reported with the rank's own story, and no rank
process outlives the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from shoal.runtime.executor.multiproc import RankFailure

from tests.plugins import FAULTS

pytestmark = pytest.mark.slow


def start_decoding(core, greedy, count: int = 2) -> None:
    """Requests long enough to still be running when a rank is hurt."""
    for i in range(count):
        core.add_request(greedy(f"long{i}", [5 + i, 6, 7, 8], max_tokens=200))
    for _ in range(3):
        core.step()


def step_until_failure(core, limit_s: float) -> tuple[RankFailure, float]:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        while time.monotonic() - start < limit_s:
            core.step()
    return info.value, time.monotonic() - start


def test_a_killed_rank_fails_the_next_step_at_once(tiny_qwen3, make_engine, greedy,
                                                    alive_after):
    core = make_engine(tiny_qwen3, tp=2)
    pids = core.executor.pids
    start_decoding(core, greedy)
    os.kill(pids[1], signal.SIGKILL)
    failure, elapsed = step_until_failure(core, limit_s=25)
    assert failure.rank == 1 and "SIGKILL" in str(failure)
    assert elapsed < 20  # not the 30 s rank timeout; the slack is for a loaded machine
    assert alive_after(pids, 5) == []
    with pytest.raises(RankFailure):  # fatal: every later call fails the same way
        core.step()
    with pytest.raises(RankFailure):
        core.executor.check_health()


def test_a_stopped_rank_is_declared_hung_after_the_rank_timeout(tiny_qwen3, make_engine,
                                                                 greedy, alive_after):
    core = make_engine(tiny_qwen3, tp=2, rank_timeout=2.0)
    pids = core.executor.pids
    start_decoding(core, greedy)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        failure, elapsed = step_until_failure(core, limit_s=30)
    finally:
        for pid in pids:  # never leave a stopped process behind, whatever the outcome
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert failure.rank == 1, failure  # the stopped rank, not rank 0 waiting on it
    assert "no progress for 2 s" in str(failure)
    assert 2.0 <= elapsed < 20  # the 2 s timeout, plus slack for a loaded machine
    assert alive_after(pids, 5) == []


def test_a_long_step_that_computes_is_not_a_hang(tiny_llama, make_engine, greedy,
                                                 monkeypatch):
    """On CPU the rank timeout is time without progress, not a step's length: a rank that
    computes for 3 CPU-seconds in one step, against a 1 s rank timeout, finishes it (at load
    10 on 2 cores a real prefill step runs past 30 s), and the request gets its tokens. The
    stopped-rank test above is the other half: no CPU, declared hung after the timeout."""
    monkeypatch.setenv("SHOAL_DEBUG_PLUGINS", FAULTS)
    monkeypatch.setenv("SHOAL_TEST_RANK_SLOW_STEP", "1:3")
    core = make_engine(tiny_llama, tp=2, rank_timeout=1.0)
    core.add_request(greedy("r", [5, 6, 7, 8], max_tokens=4))
    start = time.monotonic()
    tokens = [t for out in core.step() for t in out.new_token_ids]
    assert time.monotonic() - start >= 3.0  # the slow step ran, past three timeouts
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert len(tokens) == 4
    core.executor.check_health()


def test_an_idle_stopped_rank_fails_the_health_check(tiny_llama, make_engine, alive_after):
    core = make_engine(tiny_llama, tp=2, rank_timeout=3.0)
    core.executor.check_health()  # healthy ranks answer
    pids = core.executor.pids
    os.kill(pids[0], signal.SIGSTOP)
    try:
        # seen stopped at once; the ping's timeout is the fallback if the probe raced the signal
        with pytest.raises(RankFailure,
                           match="rank 0: (is stopped|made no progress.*health check)"):
            core.executor.check_health()
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert alive_after(pids, 5) == []


def test_an_exception_inside_a_rank_step_carries_its_message(tiny_llama, make_engine, greedy,
                                                              monkeypatch, alive_after):
    monkeypatch.setenv("SHOAL_DEBUG_PLUGINS", FAULTS)
    monkeypatch.setenv("SHOAL_TEST_RANK_FAULT", "1:step")
    # rank 0 never reports (it waits in the collective rank 1 left): the engine fails once
    # the other ranks' grace (min(STEP_FAILURE_GRACE_S, rank_timeout)) is over, 2 s here
    core = make_engine(tiny_llama, tp=2, rank_timeout=2.0)
    pids = core.executor.pids
    core.add_request(greedy("r", [1, 2, 3], max_tokens=4))
    with pytest.raises(RankFailure, match="rank 1.*injected step fault on rank 1"):
        core.step()
    assert alive_after(pids, 5) == []


def test_a_request_that_fails_the_step_on_every_rank_fails_alone(tiny_llama, make_engine,
                                                                  greedy, monkeypatch):
    """The content fault of a request trips every rank alike: the ranks live on, the engine
    isolates the request (a 4xx-shaped failure) and serves the others to the end, greedy
    tokens as the same request gets alone afterwards."""
    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.wire.messages import EngineCoreRequest

    monkeypatch.setenv("SHOAL_DEBUG_PLUGINS", FAULTS)
    monkeypatch.setenv("SHOAL_TEST_RANK_POISON_STOP", "poison-9c1")
    core = make_engine(tiny_llama, tp=2)
    pids = core.executor.pids
    poison = EngineCoreRequest(request_id="poison", prompt_token_ids=[9, 8, 7],
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=6,
                                                              stop=["poison-9c1"]))
    core.add_request(greedy("good", [5, 6, 7, 8], max_tokens=10))
    core.add_request(poison)
    tokens: list[int] = []
    failures = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() if out.request_id == "good"
                   for t in out.new_token_ids]
        failures += core.take_failures()
    assert [(f.request_id, f.param) for f in failures] == [("poison", "request")]
    assert core.executor.pids == pids and all(psutil.pid_exists(p) for p in pids)
    core.executor.check_health()
    assert core.stats().kv_cache_usage == 0.0
    core.add_request(greedy("again", [5, 6, 7, 8], max_tokens=10))
    alone = [t for out in core.step() for t in out.new_token_ids]
    while core.has_unfinished_requests():
        alone += [t for out in core.step() for t in out.new_token_ids]
    assert len(tokens) == 10 and tokens == alone


def test_a_rank_whose_checkpoint_is_unreadable_fails_startup_with_its_error(
        tiny_llama, tmp_path, make_engine):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in tiny_llama.iterdir():
        if path.suffix != ".safetensors":
            (model_dir / path.name).write_bytes(path.read_bytes())
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    with pytest.raises(RankFailure, match="failed to load its shard") as info:
        make_engine(model_dir, tp=2)
    assert "SafetensorError" in str(info.value)  # the rank's own error, not a summary


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.executor.multiproc import MultiprocExecutor
    config = EngineConfig(model=sys.argv[1], tensor_parallel_size=2)
    executor = MultiprocExecutor(config)
    print(" ".join(map(str, executor.pids)), flush=True)
    time.sleep(600)
""")


def test_no_rank_survives_an_engine_killed_with_sigkill(tiny_llama, alive_after):
    engine = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_llama)],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = engine.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"engine printed {line!r}"
        engine.kill()
        engine.wait()
        assert alive_after(pids, 5) == []
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_ranks_die_with_an_engine_whose_construction_fails(tiny_llama):
    import gc

    import psutil
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore

    def is_live_rank(process: psutil.Process) -> bool:
        try:  # a rank of an earlier test may turn zombie (or be reaped) while we look
            return (process.status() != psutil.STATUS_ZOMBIE
                    and "shoal.runtime.worker.worker_proc" in " ".join(process.cmdline()))
        except psutil.Error:
            return False

    def our_ranks() -> list[psutil.Process]:
        return [p for p in psutil.Process().children() if is_live_rank(p)]

    assert our_ranks() == []
    config = EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, num_kv_blocks=64,
                          max_model_len=5000)  # beyond the model's 4096: the core refuses
    try:  # not pytest.raises: its traceback would keep the half-built engine alive
        EngineCore(config)
    except ValueError as exc:
        assert "max_model_len" in str(exc)
    else:
        raise AssertionError("the engine core accepted max_model_len beyond the model's")
    gc.collect()
    assert our_ranks() == []
