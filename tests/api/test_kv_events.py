"""--kv-events-endpoint / vLLM's --kv-events-config: the engine core publishes the blocks it
caches, for precise routing."""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import pytest
import zmq


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["endpoint", "vllm-config"])
def test_the_engine_publishes_block_stored_events_for_a_prompt(start_server, free_tcp_port,
                                                               flag):
    endpoint = f"tcp://127.0.0.1:{free_tcp_port}"
    if flag == "endpoint":
        server = start_server("--kv-events-endpoint", endpoint, "--block-size", "16")
    else:  # as llm-d's deployments write it, with the topic spelled out
        server = start_server("--block-size", "16", "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "topic": "kv@10.0.0.7@shoal-test", "hwm": 1000}))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        # PUB drops everything until the subscription has reached it, which takes a moment
        # on a loaded machine: send distinct three-block prompts until one's events arrive
        stored_tokens = 0
        deadline = time.monotonic() + 60
        attempt = 0
        while stored_tokens < 48:
            assert time.monotonic() < deadline, "no BlockStored events within 60 s"
            # three full blocks; a new first token makes all three new (chained hashes)
            prompt = [200 + attempt % 100, *range(101, 148)]
            attempt += 1
            response = httpx.post(server.v1 + "/completions", timeout=30,
                                  json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200
            stored_tokens = 0
            seen: list[int] = []
            wait_until = time.monotonic() + 2
            while stored_tokens < 48 and time.monotonic() < wait_until:
                if not sub.poll(200):
                    continue
                topic, sequence, payload = sub.recv_multipart()
                assert topic.startswith(b"kv@") and topic.endswith(b"@shoal-test")
                if flag == "vllm-config":
                    assert topic == b"kv@10.0.0.7@shoal-test"
                _timestamp, events, dp_rank = msgspec.msgpack.decode(payload)  # vLLM's batch
                assert dp_rank == 0
                for event in events:
                    if event["type"] == "BlockStored":
                        tokens = event["token_ids"]
                        assert event["block_size"] == 16
                        assert len(tokens) == 16 * len(event["block_hashes"])
                        stored_tokens += len(tokens)
                        seen += tokens
        assert stored_tokens >= 48 and seen[:48] == prompt
    finally:
        sub.close(0)
        context.term()


@pytest.mark.parametrize("text,endpoint,topic", [
    ('{"enable_kv_cache_events": true}', "tcp://*:5557", None),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "t"}',
     "tcp://*:6000", "t"),
    ('{"enable_kv_cache_events": true, "publisher": "null"}', None, None),
    ('{"enable_kv_cache_events": false, "endpoint": "tcp://*:6000"}', None, None),
])
def test_vllm_kv_events_config_is_read_as_vllm_reads_it(text, endpoint, topic) -> None:
    from shoal.runtime.engine.kv_events_config import parse_kv_events_config

    settings = parse_kv_events_config(text)
    assert (settings.endpoint, settings.topic) == (endpoint, topic)


@pytest.mark.parametrize("text,message", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"replay_endpoint": "tcp://*:1"}', "replay"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"endpont": "x"}', "unknown key"),
])
def test_bad_kv_events_config_is_refused_naming_it(text, message) -> None:
    from shoal.runtime.engine.kv_events_config import parse_kv_events_config

    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(text)
