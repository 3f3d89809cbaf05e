"""Every string a chat template can see counts toward the prompt bound before any rendering
or tokenizing: 6 MiB in any one field (message content, name, tool-call arguments, a tool's
description or schema, documents, template kwargs, Responses items and instructions, the
same through /tokenize and the Anthropic route) is a 4xx, and /health keeps answering
within a second while such requests are refused."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

BIG = "a" * (6 << 20)
USER = {"role": "user", "content": "hi"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": BIG}}]}
TOOL = {"type": "function", "function": {"name": "f", "description": BIG}}
SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "description": BIG}}}}}
CHAT = {"model": "shoal-test", "max_tokens": 2}

CASES = {
    "content": ("/v1/chat/completions", {**CHAT, "messages": [{**USER, "content": BIG}]}),
    "name": ("/v1/chat/completions", {**CHAT, "messages": [{**USER, "name": BIG}]}),
    "tool_call_arguments": ("/v1/chat/completions", {**CHAT, "messages": [
        USER, CALL, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    "tool_description": ("/v1/chat/completions", {**CHAT, "messages": [USER],
                                                  "tools": [TOOL]}),
    "tool_schema": ("/v1/chat/completions", {**CHAT, "messages": [USER],
                                             "tools": [SCHEMA_TOOL]}),
    "documents": ("/v1/chat/completions", {**CHAT, "messages": [USER],
                                           "documents": [{"title": "d", "text": BIG}]}),
    "template_kwargs": ("/v1/chat/completions", {**CHAT, "messages": [USER],
                                                 "chat_template_kwargs": {"extra": BIG}}),
    "responses_function_call": ("/v1/responses", {
        "model": "shoal-test", "max_output_tokens": 2, "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": BIG},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    "responses_function_output": ("/v1/responses", {
        "model": "shoal-test", "max_output_tokens": 2, "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": BIG}]}),
    "responses_instructions": ("/v1/responses", {"model": "shoal-test", "input": "hi",
                                                 "instructions": BIG, "max_output_tokens": 2}),
    "responses_tool": ("/v1/responses", {"model": "shoal-test", "input": "hi",
                                         "max_output_tokens": 2, "tools": [
                                             {"type": "function", "name": "f",
                                              "description": BIG}]}),
    "tool_name": ("/v1/chat/completions", {**CHAT, "messages": [USER], "tools": [
        {"type": "function", "function": {"name": BIG}}]}),
    "tool_call_name": ("/v1/chat/completions", {**CHAT, "messages": [USER, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": BIG, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    "tool_message_content": ("/v1/chat/completions", {**CHAT, "messages": [
        USER, {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {
            "name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": BIG}]}),
    "responses_function_call_name": ("/v1/responses", {
        "model": "shoal-test", "max_output_tokens": 2, "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": BIG, "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    "responses_message_content": ("/v1/responses", {
        "model": "shoal-test", "max_output_tokens": 2,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": BIG}]}]}),
    "tokenize_prompt": ("/tokenize", {"model": "shoal-test", "prompt": BIG}),
    "tokenize_content": ("/tokenize", {"model": "shoal-test",
                                       "messages": [{**USER, "content": BIG}]}),
    "tokenize_tool_call": ("/tokenize", {"model": "shoal-test", "messages": [USER, CALL]}),
    "tokenize_tools": ("/tokenize", {"model": "shoal-test", "messages": [USER],
                                     "tools": [TOOL]}),
    "messages_tool": ("/v1/messages", {"model": "shoal-test", "max_tokens": 2,
                                       "messages": [USER], "tools": [
                                           {"name": "f", "description": BIG,
                                            "input_schema": {"type": "object"}}]}),
    "messages_tool_use_input": ("/v1/messages", {"model": "shoal-test", "max_tokens": 2,
                                                 "messages": [USER, {
                                                     "role": "assistant", "content": [{
                                                         "type": "tool_use", "id": "t1",
                                                         "name": "f",
                                                         "input": {"x": BIG}}]}, {
                                                     "role": "user", "content": [{
                                                         "type": "tool_result",
                                                         "tool_use_id": "t1",
                                                         "content": "ok"}]}]}),
}


def health_latencies(base_url: str, stop: threading.Event, out: list[float]) -> None:
    # at least one probe, however fast the refusal: a refusal before the first probe
    # completed left no sample to check
    with httpx.Client(timeout=30) as client:
        while True:
            started = time.monotonic()
            assert client.get(f"{base_url}/health").status_code == 200
            out.append(time.monotonic() - started)
            if stop.is_set():
                return
            time.sleep(0.05)


@pytest.mark.parametrize("field", list(CASES))
def test_six_mib_in_a_template_visible_field_is_refused_while_health_answers(
        tiny_chat_server, field) -> None:
    path, body = CASES[field]
    latencies: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=health_latencies,
                               args=(tiny_chat_server.base_url, stop, latencies))
    watcher.start()
    try:
        answer = httpx.post(f"{tiny_chat_server.base_url}{path}", json=body, timeout=60)
    finally:
        stop.set()
        watcher.join()
    assert 400 <= answer.status_code < 500, (field, answer.status_code, answer.text[:300])
    # refused on its bytes (or its shape) before anything was tokenized: not "N tokens"
    message = answer.json()["error"]["message"]
    assert "bytes" in message or "at most" in message, (field, message)
    assert latencies and max(latencies) < 1.0, (field, max(latencies))


def test_the_rendered_text_is_bounded_before_tokenizing(tiny_chat_server) -> None:
    """A template can write more than it sees: the rendering itself is measured too."""
    from shoal.runtime.frontend.prompts import ChatPrompt, PromptRenderer, PromptTooLong
    from shoal.runtime.frontend.tokenizer import Tokenizer

    renderer = PromptRenderer(Tokenizer.from_dir(tiny_chat_server.model_dir))
    chat = ChatPrompt([{"role": "user", "content": "x" * 1000}], max_text_bytes=500)
    with pytest.raises(PromptTooLong, match="bytes"):
        renderer.render_chat(chat)
    fits = ChatPrompt([{"role": "user", "content": "x" * 100}], max_text_bytes=500)
    assert renderer.render_chat(fits).token_ids
