"""LoRA affinity with two real engines (tiny llama, --enable-lora, one adapter slot each)
holding different adapters: the endpoint picker and the router's proxy pick only the engine
that serves a request's adapter, base requests may go anywhere, and each picked engine
answers the request (a replica without the adapter would answer 404)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def two_engines(tiny_llama, make_lora_adapter, tmp_path_factory):
    adapters = {
        "x": make_lora_adapter(tiny_llama, "rx", 4, 8, ["q_proj", "v_proj"], seed=11),
        "y": make_lora_adapter(tiny_llama, "ry", 8, 16, ["o_proj", "down_proj"], seed=12),
    }
    logs = tmp_path_factory.mktemp("lora-engines")
    procs, urls = [], {}
    try:
        for name, path in adapters.items():
            port = _free_port()
            log = (logs / f"{name}.log").open("wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "serve", "--model", str(tiny_llama),
                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "base",
                 "--num-kv-blocks", "128", "--log-level", "warning", "--enable-lora",
                 "--max-loras", "1", "--lora-modules", f"{name}={path}"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}))
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # two engines starting at once on a loaded machine
        for url in urls.values():
            while True:
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, (logs / "x.log").read_text()
                time.sleep(0.2)
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


async def test_picker_sends_each_adapter_to_the_engine_that_serves_it(two_engines):
    from shoal.runtime.router.epp.picker import EndpointPicker
    from shoal.runtime.router.policies.base import make_policy
    from shoal.runtime.router.policies.request_keys import KeyConfig
    from shoal.runtime.router.replicas.pool import ReplicaPool

    pool = ReplicaPool()
    pool.sync(two_engines.values())
    await pool.check_all(scrape=True)  # one probe and scrape, no background timing
    assert all(r.ready and r.lora is not None for r in pool.replicas.values())
    picker = EndpointPicker(pool, make_policy("cache-affinity"), KeyConfig())
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(6):
            for adapter, home in two_engines.items():
                body = {"model": adapter, "prompt": f"request {i} for {adapter}",
                        "max_tokens": 2, "temperature": 0}
                pick = await picker.pick("/v1/completions", json.dumps(body).encode(), None)
                assert pick.url == home, (adapter, pick)
                response = await http.post(pick.url + "/v1/completions", json=body)
                assert response.status_code == 200, response.text
                picker.release(pick.url)
        seen = set()
        for i in range(8):  # the base: both engines serve it, so both take some
            body = {"model": "base", "prompt": f"base {i} " * (i + 1), "max_tokens": 1}
            pick = await picker.pick("/v1/completions", json.dumps(body).encode(), None)
            seen.add(pick.url)
        assert seen == set(two_engines.values())
    await pool.stop()
