"""gpt-oss's harmony format (``--reasoning-parser openai_gptoss``, ``--tool-call-parser openai``):
headers parsed, the channels split into reasoning, content and calls whole and at every cut
(string fixtures), then served: a tiny gpt-oss checkpoint whose tokenizer has harmony's
special tokens and a harmony chat template (tests/api/harmony_template.jinja, written for
these tests) is trained here (a few dozen CPU steps) to answer three conversations in
harmony: a tool call after its analysis, a final answer after its analysis, and the answer
to the tool's result. The openai and anthropic clients read what the server makes of the
output, streamed and not; the follow-up is rendered from the client's own echo of the
assistant turn (``reasoning_content`` and JSON-text arguments), and the model only answers
it as trained when the server renders it as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shoal.runtime.api.harmony import harmony_format, parse_header

from tests.api.train_tiny import train_until_greedy

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                  "<|call|>", "<|constrain|>"]
TEMPLATE = Path(__file__).with_name("harmony_template.jinja")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
WEATHER_Q = [{"role": "user", "content": "Weather in Paris?"}]
HELLO_Q = [{"role": "user", "content": "Say hi"}]
CALL_OUT = ('<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant'
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|>')
HELLO_OUT = ('<|channel|>analysis<|message|>Greet them.<|end|><|start|>assistant<|channel|>'
             'final<|message|>Hello there.<|return|>')
SUNNY_OUT = ('<|channel|>analysis<|message|>Report it.<|end|><|start|>assistant<|channel|>'
             'final<|message|>It is sunny in Paris.<|return|>')
TOOL_RESULT = '{"sky": "sunny"}'


def follow_up(reasoning_key: str, arguments) -> list[dict]:
    """The weather conversation after the call, the assistant turn written as a client
    sends it (or as a template reads it)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    return [*WEATHER_Q, {"role": "assistant", "content": None,
                         reasoning_key: "Need the weather tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}]


START = "<|start|>assistant"


@pytest.mark.parametrize("header,expected", [
    ("<|channel|>analysis", ("analysis", None, None, "reasoning")),
    ("<|start|>assistant<|channel|>final", ("final", None, None, "content")),
    ("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
     ("commentary", "functions.get_weather", "json", "call")),
    ("assistant to=functions.get_weather<|channel|>commentary json",
     ("commentary", "functions.get_weather", "json", "call")),
    ("<|channel|>commentary", ("commentary", None, None, "content")),  # a preamble
    ("<|channel|>analysis to=browser.search", ("analysis", "browser.search", None, "ignore")),
    ("assistant", (None, None, None, "content")),
])
def test_headers(header, expected) -> None:
    parsed = parse_header(header)
    assert (parsed.channel, parsed.recipient, parsed.content_type, parsed.kind) == expected


CALL_FRAGMENT = '<|start|>assistant to=functions.get_weather<|message|>{"city": "Paris"}<|call|>'

# (prompt tail, keep reasoning, keep calls, output, expected (reasoning, content))
SPLITS = [
    (START, True, True, HELLO_OUT, ("Greet them.", "Hello there.")),
    (START, True, True, CALL_OUT, ("Need the weather tool.", CALL_FRAGMENT)),
    (START, True, False, CALL_OUT, ("Need the weather tool.", "")),  # tool_choice none
    (START, False, True, HELLO_OUT, (None, "Hello there.")),  # no --reasoning-parser
    (START, True, True, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather json<|message|>{\"city\": \"Paris\"}"
     "<|call|>", (None, "Checking." + CALL_FRAGMENT)),
    (START, True, True, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
     "analysis<|message|>b<|end|><|start|>assistant<|channel|>final<|message|>x<|end|>"
     "<|start|>assistant<|channel|>final<|message|>y<|return|>", ("a\nb", "x\ny")),
    (START, True, True, "<|channel|>analysis<|message|>cut sh", ("cut sh", "")),
    (START, True, True, "<|channel|>analysis to=browser.search<|message|>{}<|call|>",
     (None, "")),  # a built-in tool this server does not run
    (START, True, True, "<|channel|>commentary to=functions.get_weather<|message|>{\"ci",
     (None, '<|start|>assistant to=functions.get_weather<|message|>{"ci<|call|>')),
    (START, True, True, "Hello, no channels", (None, "Hello, no channels")),
    (START, True, True, "<|channel|>final<|message|>a < b <|en", (None, "a < b <|en")),
    ("<|start|>assistant<|channel|>final<|message|>", True, True, "Already final.<|return|>",
     (None, "Already final.")),
]


@pytest.mark.parametrize("tail,keep_reasoning,keep_calls,text,expected", SPLITS)
def test_split_whole_and_at_every_cut(tail, keep_reasoning, keep_calls, text, expected):
    fmt = harmony_format("<|start|>user<|message|>q<|end|>" + tail, keep_reasoning,
                         keep_calls)
    assert fmt.split(text) == expected
    for cut in range(len(text) + 1):
        for second in (cut, min(len(text), cut + 4)):
            stream = fmt.stream()
            pieces = [stream.feed(text[:cut]), stream.feed(text[cut:second]),
                      stream.feed(text[second:]), stream.finish()]
            reasoning = "".join(p[0] for p in pieces)
            content = "".join(p[1] for p in pieces)
            assert (reasoning if stream.saw_reasoning else None, content) == expected
            # harmony's markup reaches neither field (the call fragment is the server's own)
            for r, c in pieces:
                assert "<|channel|>" not in r + c.replace(CALL_FRAGMENT, "")


class _Pieces:
    """A tokenizer stand-in: token id i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_reasoning_tokens_run_to_the_end_of_the_analysis() -> None:
    pieces = ["<|channel|>", "analysis", "<|message|>", "Gr", "eet", "<|end|>", "<|start|>",
              "assistant", "<|channel|>", "final", "<|message|>", "Hi", "<|return|>"]
    fmt = harmony_format(START, True, True)
    ids = list(range(len(pieces)))
    assert fmt.reasoning_tokens("".join(pieces), ids, _Pieces(pieces)) == 6
    assert fmt.reasoning_tokens("", ids[8:], _Pieces(pieces)) == 0


def _train_harmony_model(out: Path) -> None:
    """The tiny gpt-oss checkpoint, its tokenizer given harmony's special tokens (new rows
    in the embeddings) and the harmony template, trained until greedy decoding writes
    each conversation's answer with a margin."""
    import torch
    from shoal.runtime.model.make_moe_model import cached_moe_model
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = cached_moe_model("gpt_oss")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a busy machine
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False)
                              for t in HARMONY_TOKENS], special_tokens=True)
        tokenizer.chat_template = TEMPLATE.read_text()
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        cases = [(WEATHER_Q, TOOLS, CALL_OUT), (HELLO_Q, None, HELLO_OUT),
                 (follow_up("thinking", {"city": "Paris"}), TOOLS, SUNNY_OUT)]
        data = []
        for messages, tools, answer in cases:
            prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=True)
            data.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         tokenizer(answer, add_special_tokens=False)["input_ids"]))
        train_until_greedy(model, data, max_steps=300)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")}
        config = json.loads((out / "config.json").read_text())
        config["eos_token_id"] = list(ids.values())
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": list(ids.values()), "bos_token_id": config.get("bos_token_id")}))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def harmony_model() -> Path:
    import hashlib

    from shoal.runtime.model.make_model import cached_build

    version = hashlib.sha256((TEMPLATE.read_text() + CALL_OUT + HELLO_OUT + SUNNY_OUT)
                             .encode()).hexdigest()[:8]
    return cached_build(f"gpt_oss-harmony-trained-{version}", _train_harmony_model)


@pytest.fixture(scope="module")
def server(start_server, harmony_model):
    return start_server("--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                        "--max-model-len", "512", model_dir=harmony_model)


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _streamed(client, **kwargs) -> tuple[str, str, dict[int, dict], str | None, list[str], dict]:
    """(reasoning, content, calls by index, finish_reason, kinds in order, usage) as a
    client assembles a chat stream."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish, kinds, usage = None, [], {}
    for chunk in client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
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
    return reasoning, content, calls, finish, kinds, usage


def test_tool_call_with_its_analysis_streamed_and_not(server) -> None:
    client = _client(server)
    kwargs = {"model": "shoal-test", "messages": WEATHER_Q, "tools": TOOLS, "temperature": 0,
              "max_tokens": 80}
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    message = choice.message
    assert choice.finish_reason == "tool_calls"
    assert message.content is None
    assert message.model_extra["reasoning_content"] == "Need the weather tool."
    assert message.model_extra["reasoning"] == "Need the weather tool."
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    details = answer.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < answer.usage.completion_tokens

    reasoning, content, calls, finish, kinds, usage = _streamed(client, **kwargs)
    assert (reasoning, content, finish) == ("Need the weather tool.", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)]
    assert calls[0]["id"] and calls[0]["pieces"] > 1  # the arguments stream as written
    assert kinds.index("tool_call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == details.reasoning_tokens


def test_final_answer_with_its_analysis_and_the_round_trip(server) -> None:
    client = _client(server)
    answer = client.chat.completions.create(model="shoal-test", messages=HELLO_Q,
                                            temperature=0, max_tokens=60)
    choice = answer.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Hello there.", "stop")
    assert choice.message.model_extra["reasoning_content"] == "Greet them."
    reasoning, content, calls, finish, kinds, _ = _streamed(
        client, model="shoal-test", messages=HELLO_Q, temperature=0, max_tokens=60)
    assert (reasoning, content, calls, finish) == ("Greet them.", "Hello there.", {}, "stop")
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # reasoning comes first

    # the call's turn sent back as the client has it: reasoning_content and JSON text
    first = client.chat.completions.create(model="shoal-test", messages=WEATHER_Q,
                                           tools=TOOLS, temperature=0, max_tokens=80)
    echoed = first.choices[0].message.model_dump(exclude_none=True)
    call = echoed["tool_calls"][0]
    messages = [*WEATHER_Q, echoed, {"role": "tool", "tool_call_id": call["id"],
                                     "content": TOOL_RESULT}]
    sunny = client.chat.completions.create(model="shoal-test", messages=messages,
                                           tools=TOOLS, temperature=0, max_tokens=60)
    assert sunny.choices[0].message.content == "It is sunny in Paris."
    assert sunny.choices[0].message.model_extra["reasoning_content"] == "Report it."


def test_rendering_equals_transformers(harmony_model) -> None:
    """The follow-up as the server renders it (reasoning_content, arguments as JSON text)
    equals transformers' rendering of the same turn (thinking, arguments as an object)."""
    from shoal.runtime.api.protocol import ChatMessageIn
    from shoal.runtime.frontend.prompts import ChatPrompt, PromptRenderer
    from shoal.runtime.frontend.tokenizer import Tokenizer
    from transformers import AutoTokenizer

    ours = PromptRenderer(Tokenizer.from_dir(harmony_model)).render_chat(ChatPrompt(
        [ChatMessageIn.model_validate(m).template_data()
         for m in follow_up("reasoning_content", '{"city": "Paris"}')], tools=TOOLS))
    reference = AutoTokenizer.from_pretrained(harmony_model).apply_chat_template(
        follow_up("thinking", {"city": "Paris"}), tools=TOOLS, add_generation_prompt=True,
        tokenize=False)
    assert ours.text == reference
    assert "<|channel|>analysis<|message|>Need the weather tool.<|end|>" in ours.text


def test_responses_and_messages_read_the_same_output(server) -> None:
    client = _client(server)
    response = client.responses.create(
        model="shoal-test", input="Weather in Paris?", temperature=0, max_output_tokens=80,
        tools=[{"type": "function", "name": "get_weather",
                "parameters": TOOLS[0]["function"]["parameters"]}])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == "Need the weather tool."
    assert json.loads(response.output[1].arguments) == {"city": "Paris"}
    assert response.usage.output_tokens_details.reasoning_tokens > 0

    anthropic = pytest.importorskip("anthropic")
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    kwargs = {"model": "shoal-test", "max_tokens": 80, "messages": WEATHER_Q,
              "tools": [{"name": "get_weather",
                         "input_schema": TOOLS[0]["function"]["parameters"]}],
              "extra_body": {"temperature": 0}}
    message = messages.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "Need the weather tool."
    assert message.content[1].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    with messages.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in message.content]


def test_reasoning_effort_and_past_arguments_reach_the_template() -> None:
    from shoal.runtime.api.protocol import ChatCompletionRequest, template_arguments

    body = ChatCompletionRequest.model_validate({"messages": HELLO_Q, "reasoning_effort": "high"})
    assert body.template_kwargs() == {"reasoning_effort": "high"}
    assert "reasoning_effort" not in body.ignored_fields()
    both = ChatCompletionRequest.model_validate({"messages": HELLO_Q, "reasoning_effort": "high",
                                                 "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert both.template_kwargs() == {"reasoning_effort": "low"}
    assert template_arguments('{"a": [1]}') == {"a": [1]}
    assert template_arguments("") == {}
    assert template_arguments('{"cut') == '{"cut'  # not JSON: the text as it was


class _Vocabulary:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def token_id(self, token: str) -> int | None:
        return self.tokens.index(token) if token in self.tokens else None


def test_which_servers_read_harmony() -> None:
    from shoal.runtime.api.harmony import reads_harmony

    harmony, chatml = _Vocabulary(HARMONY_TOKENS), _Vocabulary(["<|im_start|>", "<|im_end|>"])
    assert reads_harmony("openai_gptoss", None, "llama", chatml)
    assert reads_harmony(None, "openai", "llama", chatml)
    assert reads_harmony(None, None, "gpt_oss", harmony)  # vLLM reads gpt-oss so by default
    assert not reads_harmony(None, None, "gpt_oss", chatml)  # (the tests' random gpt-oss)
    assert not reads_harmony("qwen3", None, "gpt_oss", harmony)  # another format named
    assert not reads_harmony(None, None, "qwen3", harmony)


def test_a_gpt_oss_checkpoint_without_the_flags_answers_with_its_final_channel(
        start_server, harmony_model) -> None:
    server = start_server("--max-model-len", "512", model_dir=harmony_model)
    try:
        answer = _client(server).chat.completions.create(
            model="shoal-test", messages=HELLO_Q, temperature=0, max_tokens=60)
        message = answer.choices[0].message
        assert message.content == "Hello there."
        assert "reasoning_content" not in (message.model_extra or {})  # not asked for
    finally:
        server.stop()


def test_a_grammar_applies_in_the_final_channel_only(server) -> None:
    """json_object starts after ``<|channel|>final<|message|>``: the analysis is written
    freely (as trained), the final channel is constrained. A forced tool choice is refused:
    gpt-oss writes its calls in the commentary channel, where no grammar is placed."""
    client = _client(server)
    answer = client.chat.completions.create(
        model="shoal-test", messages=HELLO_Q, temperature=0, max_tokens=40,
        response_format={"type": "json_object"})
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "Greet them."
    assert message.content.lstrip().startswith("{")
    openai = pytest.importorskip("openai")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="shoal-test", messages=WEATHER_Q, tools=TOOLS,
                                           max_tokens=10, tool_choice=choice)
        assert info.value.body["param"] == "tool_choice"
