"""The OpenAI API through the official client (sync and async) against a real server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0)


def test_models_lists_the_served_name(client, server):
    assert [m.id for m in client.models.list().data] == [server.model]


def test_completion_reports_text_tokens_and_usage(client, server, tokenizer):
    prompt = "def parse_args(argv):"
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=8,
                                    temperature=0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == 8
    assert choice.text == tokenizer.decode(token_ids)
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(prompt)
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_streamed_completion_equals_the_non_streamed_one(client, server):
    kwargs = dict(model=server.model, prompt="import os\n", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 12
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_chat_streaming_and_not_with_n_2(client, server):
    messages = [{"role": "user", "content": "Write a function."}]
    out = client.chat.completions.create(model=server.model, messages=messages, n=2,
                                         max_tokens=6, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in out.choices)
    assert out.usage.completion_tokens == 12
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    stream = client.chat.completions.create(model=server.model, messages=messages, n=2,
                                            max_tokens=6, temperature=1.0, seed=7, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts == {c.index: c.message.content for c in out.choices}  # same seeds, same text


def test_a_stop_string_split_across_tokens_is_honoured_streaming_and_not(client, server,
                                                                         tokenizer):
    kwargs = dict(model=server.model, prompt="class Foo:", temperature=0,
                  extra_body={"return_token_ids": True})
    full = client.completions.create(**kwargs, max_tokens=24).choices[0]
    ids = full.model_extra["token_ids"]
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tokenizer.decode([t]) for t in ids]
    k = next(i for i in range(2, len(pieces) - 1)
             if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2 and "\ufffd" not in pieces[i]
             + pieces[i + 1])
    stop = pieces[k][-1] + pieces[k + 1][:2]
    expected = full.text[:full.text.index(stop)]
    out = client.completions.create(**kwargs, max_tokens=24, stop=[stop]).choices[0]
    assert (out.text, out.finish_reason, out.model_extra["stop_reason"]) == (expected, "stop",
                                                                             stop)
    streamed = list(client.completions.create(**kwargs, max_tokens=24, stop=[stop],
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_stream_asking_for_token_ids_gets_each_token_while_its_text_is_held_back(
        client, server, tokenizer):
    """vLLM streams every step's tokens (empty text where the text is held back): a client
    asking for token ids or logprobs sees each token when it is made, not with later text."""
    kwargs = dict(model=server.model, prompt="class Foo:", temperature=0, max_tokens=24,
                  extra_body={"return_token_ids": True})
    full = client.completions.create(**kwargs).choices[0]
    ids = full.model_extra["token_ids"]
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "".join(pieces) == full.text
    # a stop string that starts where token k's text starts (so all of it is held back) and
    # ends inside token k + 1, its first occurrence
    k = next(i for i in range(1, len(pieces) - 1)
             if pieces[i].strip() and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
             and full.text.index(pieces[i] + pieces[i + 1][0]) == len("".join(pieces[:i])))
    stop = pieces[k] + pieces[k + 1][0]
    for extra in ({"logprobs": 0}, {}):
        streamed = list(client.completions.create(**kwargs, stop=[stop], stream=True,
                                                  **extra))
        assert "".join(c.choices[0].text for c in streamed) == "".join(pieces[:k])
        per_chunk = [c.choices[0].model_extra["token_ids"] for c in streamed]
        assert per_chunk == [[t] for t in ids[:k + 2]]  # token k: its own chunk
        assert streamed[k].choices[0].text == "" and streamed[-1].choices[0].finish_reason \
            == "stop"


def test_logprobs_in_completions_and_chat(client, server):
    out = client.completions.create(model=server.model, prompt="x = ", max_tokens=4,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and sampled <= 0.0
        assert sampled == pytest.approx(max(top.values()))  # greedy picks the top one
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_prompt_as_token_ids_and_as_a_batch(client, server, tokenizer):
    ids = tokenizer.encode("for i in range(10):")
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=5,
                                       temperature=0)
    by_text = client.completions.create(model=server.model, prompt="for i in range(10):",
                                        max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=server.model, prompt=[ids, ids[:3]], max_tokens=5,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text == batch.choices[1].text
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_echo_prepends_the_prompt_streaming_and_not(client, server):
    prompt = "class Stack:\n    "
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == prompt + plain
    assert echoed.usage.completion_tokens == 6  # the echoed prompt is not completion
    chunks = list(client.completions.create(**kwargs, echo=True, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(prompt)  # the first chunk carries the prompt
    assert "".join(texts) == prompt + plain


def test_echo_of_token_id_prompts_decodes_them_for_every_choice(client, server, tokenizer):
    ids = [tokenizer.encode("def f(x):"), tokenizer.encode("while True:")]
    kwargs = dict(model=server.model, prompt=ids, max_tokens=3, temperature=0, n=2)
    plain = client.completions.create(**kwargs)
    out = client.completions.create(**kwargs, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice, without in zip(out.choices, plain.choices, strict=True):
        assert choice.text == tokenizer.decode(ids[choice.index // 2]) + without.text


def test_vllm_extensions_ignore_eos_and_min_tokens(client, server):
    out = client.completions.create(
        model=server.model, prompt="a", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 5, "min_p": 0.01,
                    "repetition_penalty": 1.1})
    assert out.usage.completion_tokens == 6


async def test_async_client_streams_concurrently(async_client, server):
    async def one(i: int) -> str:
        stream = await async_client.completions.create(
            model=server.model, prompt=f"value_{i} = ", max_tokens=5, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(texts)
    chat = await async_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert chat.usage.completion_tokens == 4


# -- errors arrive as the client's typed exceptions ------------------------------------------

def test_unknown_fields_are_a_bad_request_naming_them(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="x", extra_body={"tempratur": 0})
    assert err.value.body["param"] == "tempratur"
    assert "tempratur" in err.value.body["message"]


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"extra_body": {"min_tokens": 9, "max_tokens": 3}}, "min_tokens"),
])
def test_out_of_range_parameters_are_bad_requests(client, server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="x", **kwargs)
    assert err.value.body["param"] == param


def test_a_prompt_longer_than_the_context_is_a_bad_request(client, server):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=server.model, prompt=[5] * 5000, max_tokens=1)


def test_wrong_or_missing_api_key(server):
    bad = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    response = httpx.post(server.v1 + "/completions", json={"prompt": "x"})
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_validation_order_auth_then_size_then_model_then_parameters(server):
    """The body size is decided while reading (before any parsing), then the model, then
    the parameter ranges, then the prompt's length."""
    huge = "x" * (9 * 1024 * 1024)  # over the default 8 MiB body limit
    url = server.v1 + "/completions"
    bad_everything = {"model": "nope", "prompt": huge, "temperature": -1}
    assert httpx.post(url, json=bad_everything, timeout=30).status_code == 401
    headers = server.headers()
    assert httpx.post(url, json=bad_everything, headers=headers, timeout=30).status_code == 413
    bad_everything["prompt"] = "x" * 100_000  # fits the body, not the context
    assert httpx.post(url, json=bad_everything, headers=headers, timeout=30).status_code == 404
    bad_everything["model"] = server.model
    response = httpx.post(url, json=bad_everything, headers=headers, timeout=30)
    assert (response.status_code, response.json()["error"]["param"]) == (400, "temperature")
    del bad_everything["temperature"]
    response = httpx.post(url, json=bad_everything, headers=headers, timeout=30)
    assert (response.status_code, response.json()["error"]["param"]) == (400, "prompt")


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    text = "print('héllo 世界')"
    auth = server.headers()
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": text},
                        headers=auth).json()["tokens"]
    assert tokens == tokenizer.encode(text)
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens},
                      headers=auth).json()
    assert back["prompt"] == text
    chat = httpx.post(server.base_url + "/tokenize", headers=auth,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
