"""Serving test helpers: real ``shoal serve`` processes on free loopback ports, always
stopped (and their engine-core child with them), plus probes into /metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

API_KEY = "sk-shoal-test"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05,
               what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (exactly ``max_tokens``, no EOS stop)
    and the reference's top-2 logit margin at each step."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    margins = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1])
               for step in out.logits]
    return out.sequences[0, len(prompt):].tolist(), margins


def assert_equal_up_to_a_near_tie(ours: list[int], want: list[int], margins: list[float],
                                  near_tie: float) -> None:
    """Token for token; a divergence is accepted only where the reference's top-2 margin is
    below ``near_tie`` (float rounding may flip such an argmax), and comparison stops there:
    later tokens follow a different prefix."""
    for pos, (got, expected) in enumerate(zip(ours, want, strict=True)):
        if got != expected:
            assert margins[pos] < near_tie, (pos, ours, want)
            return


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model_dir: Path
    api_key: str | None
    log_path: Path

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
        """Kill the server and its engine child, whatever state they are in."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for proc in children:
            try:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="session")
def start_server(small_qwen3: Path, tmp_path_factory) -> Iterator[Callable[..., Server]]:
    """start_server(*flags, api_key=None, wait=True, env=None) -> Server; all stopped at
    session end. ``env``: variables added to (or, as ``None`` values, removed from) the
    server's environment."""
    started: list[Server] = []

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
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def server(start_server) -> Server:
    """One shared server (API key on) for the functional tests of a module."""
    return start_server(api_key=API_KEY)


@pytest.fixture(scope="session")
def tokenizer(small_qwen3):
    from shoal.runtime.frontend.tokenizer import Tokenizer

    return Tokenizer.from_dir(small_qwen3)


@pytest.fixture
def free_tcp_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def tiny_chat_server(start_server, tiny_qwen2) -> Server:
    """One server on the tiny qwen2 checkpoint (ChatML template in tokenizer_config.json),
    no API key, shared by the third-party-client modules (structured outputs, tools,
    Responses, LangChain, LiteLLM): one start for all of them."""
    return start_server(model_dir=tiny_qwen2)
