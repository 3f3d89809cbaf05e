"""--kv-events-endpoint: the engine core publishes the blocks it caches, for precise routing."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq


@pytest.mark.slow
def test_the_engine_publishes_block_stored_events_for_a_prompt(start_server, free_tcp_port):
    endpoint = f"tcp://127.0.0.1:{free_tcp_port}"
    server = start_server("--kv-events-endpoint", endpoint, "--block-size", "16")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # let the subscription reach the publisher (PUB drops until then)
        prompt = list(range(100, 148))  # three full blocks
        response = httpx.post(server.v1 + "/completions", timeout=30,
                              json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200
        stored_tokens = 0
        deadline = time.monotonic() + 10
        while stored_tokens < 48 and time.monotonic() < deadline:
            if not sub.poll(200):
                continue
            topic, sequence, payload = sub.recv_multipart()
            _timestamp, events = msgspec.msgpack.decode(payload)
            stored_tokens += sum(e[3] for e in events if e[0] == "BlockStored")
        assert stored_tokens >= 48
    finally:
        sub.close(0)
        context.term()
