"""The Responses store: stored conversations are immutable (a follow-up, accepted or
rejected, never changes them), belong to the tenant that made them (another API key gets
404, as for an id that never existed), are bounded in bytes per conversation and in total,
and expire; ids carry the process's instance tag, which /ready reports."""

from __future__ import annotations

import httpx
import psutil
import pytest
from shoal.runtime.api.protocol import ChatMessageIn, ToolCall, ToolCallFunction
from shoal.runtime.api.responses_store import ConversationTooLarge, ResponseStore

from shoal.contract.response_ids import instance_of

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


def turn(text: str) -> list[ChatMessageIn]:
    return [ChatMessageIn(role="user", content=text),
            ChatMessageIn(role="assistant", content=None, tool_calls=[ToolCall(
                id="c1", function=ToolCallFunction(name="f", arguments="{}"))])]


def test_reads_are_copies_and_writes_are_copies() -> None:
    store = ResponseStore()
    messages = turn("hello")
    store.put("r1", "a", messages)
    messages[1].tool_calls.append(messages[1].tool_calls[0])  # the caller's list changes
    first = store.get("r1", "a")
    assert first is not None and len(first[1].tool_calls) == 1
    first[1].tool_calls.append(first[1].tool_calls[0])  # so does what a reader got
    first.append(ChatMessageIn(role="user", content="more"))
    again = store.get("r1", "a")
    assert again is not None and len(again) == 2 and len(again[1].tool_calls) == 1


def test_only_the_tenant_that_stored_a_conversation_reads_it() -> None:
    store = ResponseStore()
    store.put("r1", "a", turn("x"))
    store.put("r2", None, turn("y"))
    assert store.get("r1", "b") is None and store.get("r1", None) is None
    assert store.get("r2", "a") is None and store.get("r2", None) is not None


def test_bytes_are_bounded_per_conversation_and_in_total_and_entries_expire() -> None:
    now = [0.0]
    store = ResponseStore(max_bytes=3000, max_conversation_bytes=1200, ttl_s=10,
                          clock=lambda: now[0])
    assert not store.put("big", "a", turn("x" * 2000))  # over one conversation's bound
    with pytest.raises(ConversationTooLarge):
        store.check_size(1201)
    for i in range(5):
        assert store.put(f"r{i}", "a", turn("x" * 900))
    assert store.bytes <= 3000 and store.get("r0", "a") is None  # the oldest went first
    assert store.get("r4", "a") is not None
    now[0] = 11.0
    assert store.get("r4", "a") is None and len(store) == 0 and store.bytes == 0


def test_ids_carry_the_instance_tag() -> None:
    store = ResponseStore()
    assert instance_of(store.new_id()) == store.instance
    assert instance_of("resp_0123") is None


@pytest.fixture(scope="module")
def keyed_server(start_server, tiny_qwen2):
    return start_server("--api-key", KEY_B, api_key=KEY_A, model_dir=tiny_qwen2)


def create(server, key: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/responses", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "shoal-test", "max_output_tokens": 2, **body})


def test_another_tenant_gets_404_and_the_owner_continues(keyed_server) -> None:
    first = create(keyed_server, KEY_A, input="Hello there")
    assert first.status_code == 200
    response_id = first.json()["id"]
    assert instance_of(response_id) == keyed_server.get("/ready").json()["instance"]
    other = create(keyed_server, KEY_B, input="mine now", previous_response_id=response_id)
    assert other.status_code == 404
    assert other.json()["error"]["param"] == "previous_response_id"
    missing = create(keyed_server, KEY_A, input="x", previous_response_id="resp_nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith(
        "no stored response")  # the same answer: no way to tell "someone else's" apart
    assert create(keyed_server, KEY_A, input="go on",
                  previous_response_id=response_id).status_code == 200


def test_follow_ups_never_change_the_stored_conversation(keyed_server) -> None:
    """Ten follow-ups with function_call items (some too large, so rejected) on one stored
    response: its conversation, as the prompt size of a fixed follow-up shows, is the
    same before and after, and the API process's memory stays bounded."""
    base = create(keyed_server, KEY_A, input="Weather in Oslo?").json()["id"]

    def probe() -> int:
        answer = create(keyed_server, KEY_A, input="and now?", previous_response_id=base)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["input_tokens"]

    before = probe()
    rss_before = psutil.Process(keyed_server.proc.pid).memory_info().rss
    for i in range(10):
        arguments = '{"city": "Oslo"}' if i % 2 else "x" * (2 << 20)
        answer = create(keyed_server, KEY_A, previous_response_id=base, input=[
            {"type": "function_call", "call_id": f"c{i}", "name": "get_weather",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": f"c{i}", "output": "rain"}])
        assert answer.status_code == (200 if i % 2 else 400), answer.text[:200]
    assert probe() == before
    grown = psutil.Process(keyed_server.proc.pid).memory_info().rss - rss_before
    assert grown < 300 << 20, f"the API process grew {grown >> 20} MiB"
