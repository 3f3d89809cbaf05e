"""Reasoning and tool calls on real model output: the tiny qwen2 checkpoint, its tokenizer
given each format's marker tokens, is trained here (a few dozen CPU steps) to think in a
``<think>`` span, then call a tool in the format its prompt names: mistral (``[TOOL_CALLS]``
and ``[ARGS]`` special tokens, as in Mistral's tokenizers), qwen3_coder, pythonic,
deepseek_v3, and the default reading's hermes ``<tool_call>`` and Llama 3 JSON. Each format
is served with ``--reasoning-parser qwen3`` and its ``--tool-call-parser``; the openai client reads the reasoning and the call, streamed and
not (its stream helper too, which parses the arguments as partial JSON at every delta), and
a Responses reasoning item then a function_call item; the anthropic client reads a
thinking block and a tool_use block, streamed and not. The model only writes each text as
trained; what the server makes of it is read from the tokens it sampled, not from a string
fixture."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest

from tests.api.train_tiny import train_until_greedy

REASONING = "Check the weather."
ARGUMENTS = {"city": "Paris", "days": 3}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}}]
# as the openai client's stream helper needs them (it parses strict tools' arguments only)
STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
DS = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
      "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
# each format's call as the model is trained to write it, after its reasoning
CALLS = {
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                   "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                   "</tool_call>",
    "pythonic": '[get_weather(city="Paris", days=3)]',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
              '\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "deepseek_v3": f'{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n'
                   f'{{"city": "Paris", "days": 3}}\n```{DS[3]}{DS[4]}',
}
# (token, special): special as in the models that write them, so the server must keep
# Mistral's markers in the text it parses (they are skipped by default)
ADDED = [("<think>", False), ("</think>", False), ("[TOOL_CALLS]", True), ("[ARGS]", True),
         ("<tool_call>", False), ("</tool_call>", False)] + [(t, False) for t in DS]


def question(parser: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather in Paris for 3 days? Call in {parser}."}]


def _train(out: Path) -> None:
    """Trained until greedy decoding writes each format's answer, and the end of the turn
    after it, with a margin."""
    import torch
    from shoal.runtime.model.make_model import cached_model
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = cached_model("qwen2", "tiny")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a busy machine
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.add_tokens([AddedToken(t, special=special, normalized=False)
                              for t, special in ADDED if not special])
        tokenizer.add_special_tokens({"additional_special_tokens": [
            AddedToken(t, special=True, normalized=False) for t, special in ADDED if special]})
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        data = []
        for (parser, call), tools in itertools.product(CALLS.items(), (TOOLS, STRICT_TOOLS)):
            prompt = tokenizer.apply_chat_template(question(parser), tools=tools,
                                                   tokenize=False, add_generation_prompt=True)
            answer = f"<think>{REASONING}</think>\n\n{call}{tokenizer.eos_token}"
            data.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         tokenizer(answer, add_special_tokens=False)["input_ids"]))
        train_until_greedy(model, data, max_steps=400)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_model() -> Path:
    from shoal.runtime.model.make_model import cached_build

    version = hashlib.sha256(json.dumps([REASONING, CALLS, ADDED, TOOLS, STRICT_TOOLS]).encode()
                             ).hexdigest()[:8]
    return cached_build(f"qwen2-think-and-call-trained-{version}", _train)


def _streamed(client, **kwargs) -> tuple[str, str, dict[int, dict], str | None, list[str]]:
    """(reasoning, content, calls by index, finish_reason, kinds in order) as a client
    assembles a chat stream."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish, kinds = None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            finish = choice.finish_reason or finish
            extra = delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                reasoning += extra["reasoning_content"]
                kinds.append("reasoning")
            if delta.content:
                content += delta.content
                kinds.append("content")
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": "",
                                                   "pieces": 0})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
                entry["pieces"] += bool(d.function.arguments)
                kinds.append("tool_call")
    return reasoning, content, calls, finish, kinds


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_trained_reasoning_then_call_read_by_openai_and_anthropic_clients(
        start_server, trained_model, parser) -> None:
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    server = start_server("--reasoning-parser", "qwen3", "--tool-call-parser", parser,
                          "--enable-auto-tool-choice", model_dir=trained_model)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        kwargs = {"model": "shoal-test", "messages": question(parser), "tools": TOOLS,
                  "temperature": 0, "max_tokens": 120}
        answer = client.chat.completions.create(**kwargs)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == REASONING
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == ARGUMENTS
        assert answer.usage.completion_tokens_details.reasoning_tokens > 0

        reasoning, content, calls, finish, kinds = _streamed(client, **kwargs)
        assert (reasoning, content.strip(), finish) == (REASONING, "", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (call.function.name, call.function.arguments)]
        assert calls[0]["id"]
        if parser not in ("pythonic", "llama3_json"):  # (sent whole when the message ends)
            assert calls[0]["pieces"] > 1  # the arguments stream as the model writes them
        last_reasoning = max(i for i, k in enumerate(kinds) if k == "reasoning")
        assert kinds.index("tool_call") > last_reasoning

        # the openai client's own stream accumulation: it parses the arguments so far as
        # partial JSON at every delta, so each prefix sent must be one
        with client.chat.completions.stream(**{**kwargs, "tools": STRICT_TOOLS}) as stream:
            partial = [event.parsed_arguments for event in stream
                       if event.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion()
        [helped] = final.choices[0].message.tool_calls
        assert helped.function.name == "get_weather"
        assert helped.function.parsed_arguments == ARGUMENTS == partial[-1]
        assert len(partial) >= calls[0]["pieces"]  # one event per delta, each one parsed

        # the same output as a Responses reasoning item, then a function_call item
        function = TOOLS[0]["function"]  # the same tool, so the same prompt
        response = client.responses.create(
            model="shoal-test", input=question(parser), tools=[{"type": "function", **function}],
            temperature=0, max_output_tokens=120)
        reasoning_item, call_item = response.output
        assert (reasoning_item.type, call_item.type) == ("reasoning", "function_call")
        assert reasoning_item.content[0].text == REASONING
        assert (call_item.name, json.loads(call_item.arguments)) == ("get_weather", ARGUMENTS)

        # and as Anthropic blocks: thinking, then tool_use with the object
        messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused",
                                       max_retries=0).messages
        tools = [{"name": function["name"], "description": function["description"],
                  "input_schema": function["parameters"]}]
        body = {"model": "shoal-test", "max_tokens": 120, "messages": question(parser),
                "tools": tools, "thinking": {"type": "enabled", "budget_tokens": 1024},
                "extra_body": {"temperature": 0}}
        message = messages.create(**body)
        assert message.stop_reason == "tool_use", message
        assert [b.type for b in message.content] == ["thinking", "tool_use"]
        assert message.content[0].thinking == REASONING
        assert (message.content[1].name, message.content[1].input) == ("get_weather", ARGUMENTS)
        with messages.stream(**body) as stream:
            events = [event.type for event in stream]
            final = stream.get_final_message()
        assert [b.model_dump(exclude={"id", "signature"}) for b in final.content] == [
            b.model_dump(exclude={"id", "signature"}) for b in message.content]
        assert final.stop_reason == "tool_use"
        assert "thinking" in events and "input_json" in events  # deltas of both blocks
    finally:
        server.stop()
