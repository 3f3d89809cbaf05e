"""``--reasoning-parser``: the ``<think>`` span split off as it streams and whole (string
fixtures, every split point), then served: chat ``reasoning_content`` / ``reasoning``,
streamed reasoning deltas, ``reasoning_tokens``, Responses reasoning items, Anthropic
thinking blocks, and a grammar that starts only after ``</think>``.

The served checkpoint is the tiny qwen2 one with two vocabulary entries renamed to
``<think>`` and ``</think>`` (single tokens, as in Qwen3 and DeepSeek-R1). Its weights are
random, so the tests force ``</think>`` with ``logit_bias`` where they need the span to end:
a grammar active from the first token would forbid it there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest
from shoal.runtime.api.reasoning import (
    ReasoningStream,
    reasoning_format,
    reasoning_token_count,
)

THINK_IDS = {"<think>": 1022, "</think>": 1023}
SCHEMA = {"type": "object", "required": ["city"], "additionalProperties": False,
          "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}
USER = [{"role": "user", "content": "Where?"}]


@pytest.mark.parametrize("parser,prompt,text,expected", [
    ("qwen3", "assistant\n", "<think>\nhmm, maybe</think>\n\nParis.", ("\nhmm, maybe", "Paris.")),
    ("qwen3", "assistant\n", "  Paris.", (None, "  Paris.")),
    ("qwen3", "assistant\n<think>\n", "a < b</think>Oslo", ("a < b", "Oslo")),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "Lima", (None, "Lima")),
    ("qwen3", "assistant\n", "<think>cut short", ("cut short", "")),
    ("deepseek_r1", "assistant\n", "so</think>\n\nAnswer", ("so", "Answer")),
    ("deepseek_r1", "assistant\n", "all thought", ("all thought", "")),
    ("deepseek_r1", "assistant\n", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "<think>\n\n</think>\n\n", "plain", (None, "plain")),
    ("qwen3", "assistant\n", "<thin", (None, "<thin")),
])
def test_split_whole_and_at_every_chunk_boundary(parser, prompt, text, expected) -> None:
    fmt = reasoning_format(parser, prompt)
    assert fmt is not None and fmt.split(text) == expected
    for cut in range(len(text) + 1):
        for second_cut in (cut, min(len(text), cut + 3)):
            stream = ReasoningStream(fmt)
            pieces = [stream.feed(text[:cut]), stream.feed(text[cut:second_cut]),
                      stream.feed(text[second_cut:]), stream.finish()]
            reasoning = "".join(p[0] for p in pieces)
            content = "".join(p[1] for p in pieces)
            assert (reasoning if stream.saw_reasoning else None, content) == expected
            # markup never reaches either field, not even for one chunk
            assert all("</think>" not in r + c for r, c in pieces)


def test_grammar_waits_unless_the_prompt_closed_the_span() -> None:
    assert reasoning_format("qwen3", "x<think>\n").grammar_deferred  # type: ignore[union-attr]
    assert not reasoning_format("qwen3", "<think>\n\n</think>\n\n").grammar_deferred  # type: ignore[union-attr]
    assert reasoning_format(None, "x") is None


def test_reasoning_tokens_count_up_to_the_end_marker() -> None:
    assert reasoning_token_count([5, 6, 9, 7], [9], True) == 3
    assert reasoning_token_count([5, 6, 7], [9], True) == 3  # cut short inside the span
    assert reasoning_token_count([5, 6, 7], [9], False) == 0
    assert reasoning_token_count([5, 8, 9, 7], [8, 9], True) == 3


@pytest.fixture(scope="module")
def thinking_model(tiny_qwen2, tmp_path_factory) -> Path:
    """tiny qwen2 whose vocabulary has ``<think>`` and ``</think>`` as single tokens."""
    out = tmp_path_factory.mktemp("thinking-qwen2")
    for path in tiny_qwen2.iterdir():
        shutil.copy(path, out / path.name)
    data = json.loads((tiny_qwen2 / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()}
    for marker, token_id in THINK_IDS.items():
        old = by_id[token_id]
        del vocab[old]
        vocab[marker] = token_id
        data["model"]["merges"] = [m for m in data["model"]["merges"]
                                   if "".join(m if isinstance(m, list) else m.split(" ")) != old]
        data["added_tokens"].append({"id": token_id, "content": marker, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": False})
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def server(start_server, thinking_model):
    return start_server("--reasoning-parser", "deepseek_r1", model_dir=thinking_model)


def chat(server, **body) -> dict:
    response = httpx.post(server.v1 + "/chat/completions", timeout=60, json={
        "model": "shoal-test", "messages": USER, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, **body) -> tuple[str, str, list[str]]:
    """(reasoning, content, the order of field kinds as they arrived)."""
    reasoning = content = ""
    kinds: list[str] = []
    with httpx.stream("POST", server.v1 + "/chat/completions", timeout=60, json={
            "model": "shoal-test", "messages": USER, "temperature": 0, "stream": True,
            **body}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    assert delta["reasoning"] == delta["reasoning_content"]
                    reasoning += delta["reasoning_content"]
                    kinds.append("reasoning")
                if delta.get("content"):
                    content += delta["content"]
                    kinds.append("content")
    return reasoning, content, kinds


def test_unfinished_span_is_all_reasoning_streamed_or_not(server) -> None:
    answer = chat(server, max_tokens=12, return_token_ids=True)
    message, choice = answer["choices"][0]["message"], answer["choices"][0]
    marker = THINK_IDS["</think>"]
    ids = choice["token_ids"]
    expected_tokens = ids.index(marker) + 1 if marker in ids else len(ids)
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected_tokens
    if marker not in ids:
        assert message["content"] in (None, "") and message["reasoning_content"]
    assert message.get("reasoning") == message.get("reasoning_content")
    reasoning, content, _ = streamed(server, max_tokens=12)
    assert reasoning == (message.get("reasoning_content") or "")
    assert content == (message["content"] or "")


def test_structured_output_starts_after_the_span(server) -> None:
    """``</think>`` forced first: a grammar active from the first token would have masked
    it; after it the schema holds."""
    format_ = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    bias = {str(THINK_IDS["</think>"]): 100}
    answer = chat(server, max_tokens=40, response_format=format_, logit_bias=bias,
                  return_token_ids=True)
    choice = answer["choices"][0]
    assert choice["token_ids"][0] == THINK_IDS["</think>"]
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1
    _, content, _ = streamed(server, max_tokens=40, response_format=format_, logit_bias=bias)
    assert content == choice["message"]["content"]
    tool = {"type": "function", "function": {"name": "where", "parameters": SCHEMA}}
    forced = chat(server, max_tokens=40, tools=[tool], logit_bias=bias,
                  tool_choice={"type": "function", "function": {"name": "where"}})
    call = forced["choices"][0]["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_responses_reasoning_item_and_anthropic_thinking_block(server) -> None:
    plain = chat(server, max_tokens=10)["choices"][0]["message"]
    response = httpx.post(server.v1 + "/responses", timeout=60, json={
        "model": "shoal-test", "input": USER, "max_output_tokens": 10,
        "temperature": 0}).json()
    items = [item for item in response["output"] if item["type"] == "reasoning"]
    if plain.get("reasoning_content"):
        assert items[0]["content"][0]["text"] == plain["reasoning_content"]
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    kwargs = {"model": "shoal-test", "max_tokens": 10, "messages": USER,
              "thinking": {"type": "enabled", "budget_tokens": 1024},
              "extra_body": {"temperature": 0}}
    message = client.messages.create(**kwargs)
    thinking = [b.thinking for b in message.content if b.type == "thinking"]
    assert thinking == ([plain["reasoning_content"]] if plain.get("reasoning_content") else [])
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in message.content]
    assert [b.thinking for b in final.content if b.type == "thinking"] == thinking


def test_responses_stream_sends_reasoning_text_events_that_add_up_to_the_item(server) -> None:
    """As OpenAI streams a reasoning model: the reasoning item opens first, its text arrives
    as response.reasoning_text.delta events and closes with reasoning_text.done, then the
    message (if any); the openai client's stream helper assembles the same output."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    kwargs = {"model": "shoal-test", "input": "Where?", "max_output_tokens": 12,
              "temperature": 0}
    whole = client.responses.create(**kwargs)
    reasoning = [item.content[0].text for item in whole.output if item.type == "reasoning"]
    assert reasoning, "deepseek_r1 opens the span: a cut-short answer is all reasoning"
    kinds, deltas, done_text = [], "", None
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas += event.delta
            elif event.type == "response.reasoning_text.done":
                done_text = event.text
        final = stream.get_final_response()
    assert deltas == done_text == reasoning[0]
    first = kinds.index("response.output_item.added")
    assert kinds[first + 1:first + 3] == ["response.content_part.added",
                                          "response.reasoning_text.delta"]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_item.done")
    assert kinds[-1] == "response.completed"
    assert [(i.type, i.content[0].text) for i in final.output if i.type == "reasoning"] == \
        [("reasoning", reasoning[0])]
    assert len(final.output) == len(whole.output)


QWEN3_SWITCH = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                "{%- if enable_thinking is defined and enable_thinking is false %}"
                "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def switch_server(start_server, thinking_model, tmp_path_factory):
    """``--reasoning-parser qwen3`` on the thinking checkpoint, its template given Qwen3's
    ``enable_thinking`` switch: false closes an empty span in the prompt."""
    out = tmp_path_factory.mktemp("thinking-switch-qwen2")
    for path in thinking_model.iterdir():
        shutil.copy(path, out / path.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    generation_prompt = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    assert generation_prompt in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(generation_prompt, QWEN3_SWITCH)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return start_server("--reasoning-parser", "qwen3", model_dir=out)


def test_enable_thinking_reaches_the_template_and_decides_where_the_grammar_starts(
        switch_server) -> None:
    """chat_template_kwargs ``enable_thinking: false`` (Anthropic: ``thinking`` disabled)
    closes the span in the prompt, so a grammar holds from the first token: ``</think>``,
    pushed by logit_bias, is masked there. With thinking on, the grammar waits for it."""
    end = THINK_IDS["</think>"]
    off = {"chat_template_kwargs": {"enable_thinking": False}}

    def prompt_ids(**fields) -> list[int]:
        response = httpx.post(switch_server.base_url + "/tokenize", timeout=60, json={
            "model": "shoal-test", "messages": USER, **fields})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    assert end in prompt_ids(**off)[-3:] and end not in prompt_ids()
    format_ = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    body = {"max_tokens": 40, "response_format": format_, "logit_bias": {str(end): 100},
            "return_token_ids": True}
    thinking = chat(switch_server, **body)["choices"][0]
    assert thinking["token_ids"][0] == end  # the grammar waited for the span's end
    plain = chat(switch_server, **body, **off)
    choice = plain["choices"][0]
    assert end not in choice["token_ids"]  # constrained from the first token
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert not choice["message"].get("reasoning_content")
    assert plain["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=switch_server.base_url, api_key="unused",
                                 max_retries=0)
    counted = client.messages.count_tokens(model="shoal-test", messages=USER,
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == len(prompt_ids(**off))
