"""Serving test helpers: real ``shoal serve`` processes on free loopback ports, always
stopped (and their engine-core child with them), plus probes into /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from ..processes import free_port, kill_tree, wait_until

API_KEY = "sk-shoal-test"


@pytest.fixture(autouse=True, scope="module")
def serving_tests_run_single_threaded(one_torch_thread):
    """(``one_torch_thread``: the references and offline engines here are small models.)"""


def assert_equal_up_to_a_near_tie(ours: list[int], want: list[int], margins: list[float],
                                  near_tie: float) -> None:
    """Token for token; a divergence is accepted only where the reference's top-2 margin is
    below ``near_tie`` (float rounding may flip such an argmax), and comparison stops there:
    later tokens follow a different prefix."""
    for pos, (got, expected) in enumerate(zip(ours, want, strict=True)):
        if got != expected:
            assert margins[pos] < near_tie, (pos, ours, want)
            return


def greedy_token_ids(server: Server, prompts: list[list[int]],
                     max_tokens: int) -> list[list[int]]:
    """One batched completions request through the openai client: each token-id prompt's
    greedy continuation (EOS ignored, exactly ``max_tokens``), in prompt order."""
    import openai

    client = openai.OpenAI(base_url=server.v1, api_key=server.api_key or "unused",
                           max_retries=0)
    batch = client.completions.create(
        model=server.model, prompt=prompts, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    outputs = [c.model_extra["token_ids"] for c in sorted(batch.choices, key=lambda c: c.index)]
    assert [len(ids) for ids in outputs] == [max_tokens] * len(prompts)
    return outputs


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model_dir: Path
    api_key: str | None
    log_path: Path
    stopped: bool = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def model(self) -> str:
        return "shoal-test"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=timeout)

    def engine_process(self) -> psutil.Process:
        children = psutil.Process(self.proc.pid).children(recursive=False)
        engines = [c for c in children if "shoal.runtime.engine.core_proc" in " ".join(c.cmdline())]
        assert len(engines) == 1, f"expected one engine-core child, found {children}"
        return engines[0]

    def metric(self, name: str) -> float:
        text = httpx.get(self.base_url + "/metrics", headers=self.headers(), timeout=5).text
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        assert match, f"metric {name} not exported"
        return float(match.group(1))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 240.0) -> None:
        """A start needs ~11 CPU-seconds (API + engine core, small_qwen3); on a shared 2-core
        machine at load 18 it got ~15% of a core and took 72-86 s, so the bound is generous.
        A server that exits fails at once; the message has the last phase reached."""
        last = {"ready": "no answer yet"}

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                response = self.get("/ready", timeout=2.0)
            except httpx.HTTPError as exc:
                last["ready"] = repr(exc)
                return False
            last["ready"] = response.text  # the startup phase and each phase's duration
            return response.status_code == 200

        try:
            wait_until(ready, timeout, 0.1, "/ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last /ready: {last['ready']}; load average "
                                 f"{os.getloadavg()}; log:\n{self.log()}") from None

    def stop(self) -> None:
        """Kill the server and its engine child, whatever state they are in (once: its pid
        may be another process's afterwards)."""
        if not self.stopped:
            self.stopped = True
            kill_tree(self.proc)


_STARTED: list[Server] = []  # every server this session, in start order


@pytest.fixture(autouse=True)
def stop_the_tests_own_servers() -> Iterator[None]:
    """A server a test function starts itself is stopped when that test ends. Fixtures of a
    wider scope are set up before this one, so what starts after it is the test's own."""
    first = len(_STARTED)
    yield
    for server in _STARTED[first:]:
        server.stop()


@pytest.fixture(scope="session")
def start_session_server(small_qwen3: Path,
                         tmp_path_factory) -> Iterator[Callable[..., Server]]:
    """start_session_server(*flags, api_key=None, wait=True, model_dir=None, new_session=False,
    env=None) -> Server, stopped at session end: for a server that modules share
    (``tiny_chat_server``); a module's own servers come from ``start_server``. ``env``:
    variables added to (or, as ``None`` values, removed from) the server's environment."""

    def start(*flags: str, api_key: str | None = None, wait: bool = True,
              model_dir: Path | None = None, new_session: bool = False,
              env: dict[str, str | None] | None = None) -> Server:
        port = free_port()
        model = model_dir or small_qwen3
        log_path = tmp_path_factory.mktemp("serve") / "serve.log"
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "shoal-test",
               "--num-kv-blocks", "512", "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        environ = {**os.environ, "OMP_NUM_THREADS": "1"}
        for name, value in (env or {}).items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        with open(log_path, "wb") as log:
            # new_session: a process group of its own, for signals sent to the whole group
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ,
                                    start_new_session=new_session)
        server = Server(proc, port, model, api_key, log_path)
        _STARTED.append(server)
        if wait:
            try:
                server.wait_ready()
            except BaseException:
                server.stop()
                raise
        return server

    yield from stopped_at_teardown(start)


@pytest.fixture(scope="module")
def start_server(start_session_server) -> Iterator[Callable[..., Server]]:
    """start_server(*flags, api_key=None, wait=True, model_dir=None, new_session=False,
    env=None) -> Server; each stopped when its module ends: an idle server holds ~600 MB and wakes every
    100 ms, and a session's worth of them kept to the end slowed every test after them."""
    yield from stopped_at_teardown(start_session_server)


def stopped_at_teardown(start: Callable[..., Server]) -> Iterator[Callable[..., Server]]:
    """For a fixture: yields ``start`` recording what it started, then stops all of it."""
    started: list[Server] = []

    def tracked(*flags: str, **kwargs) -> Server:
        server = start(*flags, **kwargs)
        started.append(server)
        return server

    try:
        yield tracked
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def server(start_session_server) -> Server:
    """One server (API key on, the integration-test model) shared by the functional tests
    of every module that asks for it (bad input, cancellation, greedy equivalence, the
    OpenAI client, schemathesis, slow clients): the same flags, so one start for all of them,
    as ``tiny_chat_server``. What they check is their own requests' answers, gauges (idle
    afterwards) and growth from their own baseline (RSS), never a fresh server's counters."""
    return start_session_server(api_key=API_KEY)


@pytest.fixture(scope="session")
def tokenizer(small_qwen3):
    from shoal.runtime.frontend.tokenizer import Tokenizer

    return Tokenizer.from_dir(small_qwen3)


@pytest.fixture
def free_tcp_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def tiny_chat_server(start_session_server, tiny_qwen2) -> Server:
    """One server on the tiny qwen2 checkpoint (ChatML template in tokenizer_config.json),
    no API key, shared by the third-party-client modules (structured outputs, tools,
    Responses, LangChain, LiteLLM): one start for all of them."""
    return start_session_server(model_dir=tiny_qwen2)
