"""TP fixtures: engines over the tiny checkpoints, greedy runs, and process bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreOutput, EngineCoreRequest

from ..processes import free_port, kill_tree


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
    # shutting down (twice is fine) leaves no rank process behind, whatever the test did
    rank_pids = [pid for core in engines for pid in getattr(core.executor, "pids", [])]
    for core in engines:
        core.shutdown()
        core.shutdown()
    assert wait_until_gone(rank_pids, 10) == [], "rank processes outlived shutdown()"


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


@pytest.fixture
def tp2_equals_tp1(make_engine, run_to_completion
                   ) -> Callable[[Path, list[list[int]]], tuple[EngineCore, EngineCore, dict]]:
    """Greedy requests (request i: prompt i, 10 + 3i tokens) on a TP=1 and a TP=2 engine of
    the same checkpoint; asserts every request's tokens agree and returns (tp1, tp2, the TP=2
    outputs) for the caller's own checks of what each rank holds."""

    def run(model_dir: Path, prompts: list[list[int]]
            ) -> tuple[EngineCore, EngineCore, dict[str, list[EngineCoreOutput]]]:
        requests = [greedy_request(f"r{i}", p, max_tokens=10 + 3 * i)
                    for i, p in enumerate(prompts)]
        tp1 = make_engine(model_dir, tp=1, max_model_len=128)
        single = run_to_completion(tp1, requests)
        tp2 = make_engine(model_dir, tp=2, max_model_len=128)
        tensor_parallel = run_to_completion(tp2, requests)
        for req_id, outs in single.items():
            want = [t for o in outs for t in o.new_token_ids]
            got = [t for o in tensor_parallel[req_id] for t in o.new_token_ids]
            assert got == want, f"{req_id}: TP=2 diverged from TP=1"
        return tp1, tp2, tensor_parallel

    return run


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


# -- a real `shoal serve --tensor-parallel-size 2` ------------------------------------------

class TPServer:
    """One `shoal serve` process; knows its engine core and its rank processes."""

    HOST = "127.0.0.1"

    def __init__(self, model_dir: Path, log_path: Path, *flags: str,
                 env: dict[str, str] | None = None) -> None:
        import os
        import subprocess
        import sys

        self.port = free_port(self.HOST)
        self.base_url = f"http://{self.HOST}:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(model_dir),
               "--host", self.HOST, "--port", str(self.port), "--device", "cpu",
               "--tensor-parallel-size", "2", "--num-kv-blocks", "512", "--max-num-seqs", "8",
               "--served-model-name", "tp-test", "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> int | None:
        import httpx

        try:
            return httpx.get(self.base_url + "/health", timeout=1.0).status_code
        except httpx.HTTPError:
            return None

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def rank_pids(self) -> list[int]:
        """Rank processes in rank order (each command line ends with ``rank=R``)."""
        ranks = {}
        for proc in self.descendants():
            cmdline = proc.cmdline()
            if "shoal.runtime.worker.worker_proc" in cmdline:
                ranks[int(cmdline[-1].removeprefix("rank="))] = proc.pid
        return [ranks[r] for r in sorted(ranks)]

    def stop(self) -> None:
        kill_tree(self.proc)
        self._log.close()


@pytest.fixture
def tp_server(tiny_qwen3: Path, tmp_path: Path) -> Iterator[Callable[..., TPServer]]:
    """tp_server(*extra_flags, env=None, wait=True) -> a TPServer over tiny qwen3 (ready
    unless wait=False); stopped after the test."""
    servers: list[TPServer] = []

    def start(*flags: str, env: dict[str, str] | None = None, wait: bool = True) -> TPServer:
        server = TPServer(tiny_qwen3, tmp_path / f"serve{len(servers)}.log", *flags, env=env)
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
