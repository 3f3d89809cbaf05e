"""Client disconnects, streaming or not, abort the request in the engine and free its KV."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

STORM = 50


def engine_idle(server) -> bool:
    return (server.metric("shoal:num_requests_running") == 0
            and server.metric("shoal:num_requests_waiting") == 0
            and server.metric("shoal:kv_cache_usage_perc") == 0.0)


def wait_idle_within(server, seconds: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if engine_idle(server):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(
        f"engine not idle {seconds} s after the disconnects: running="
        f"{server.metric('shoal:num_requests_running')} waiting="
        f"{server.metric('shoal:num_requests_waiting')} kv="
        f"{server.metric('shoal:kv_cache_usage_perc')}")


def long_request(server, i: int, stream: bool) -> dict:
    return {"model": server.model, "prompt": f"storm request {i}: ", "max_tokens": 1500,
            "temperature": 0.8, "ignore_eos": True, "stream": stream}


@pytest.mark.slow
async def test_a_storm_of_streaming_clients_that_hang_up_leaves_the_engine_idle(server):
    url = server.v1 + "/completions"
    mid_stream = asyncio.Event()
    reached = 0

    async def client_that_leaves(i: int) -> int:
        nonlocal reached
        chunks = 0
        async with httpx.AsyncClient(timeout=60, headers=server.headers()) as http:
            async with http.stream("POST", url, json=long_request(server, i, True)) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                    if chunks == 3:
                        reached += 1
                        if reached == STORM:
                            mid_stream.set()
                        await mid_stream.wait()  # everyone is mid-stream: leave together
                        return chunks
        return chunks

    results = await asyncio.gather(*(client_that_leaves(i) for i in range(STORM)))
    assert results == [3] * STORM  # each left mid-stream, none ran to the end
    assert server.metric("shoal:generation_tokens_total") < STORM * 1500 / 2
    await asyncio.to_thread(wait_idle_within, server, 2.0)


@pytest.mark.slow
async def test_non_streaming_clients_that_hang_up_are_aborted(server):
    url = server.v1 + "/completions"

    async def client_that_times_out(i: int) -> None:
        async with httpx.AsyncClient(timeout=60, headers=server.headers()) as http:
            await http.post(url, json=long_request(server, i, False))

    tasks = [asyncio.create_task(client_that_times_out(i)) for i in range(20)]
    deadline = time.monotonic() + 30
    while server.metric("shoal:num_requests_running") < 20:
        assert time.monotonic() < deadline, "the requests never ran"
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()  # closes each connection mid-request
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(wait_idle_within, server, 2.0)
    finished = httpx.get(server.base_url + "/metrics", headers=server.headers()).text
    assert 'request_success_total{finished_reason="abort"' in finished
