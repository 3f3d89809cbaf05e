"""Hostile input against a real ``shoal serve``: every case is a 4xx with an OpenAI error
body naming the field where there is one, no traceback in any body, and the engine is
healthy and idle afterwards (KV, running and waiting back to zero).

The first rows are the ones that killed the engine or returned 500s before (issue 18):
top_k 2**63, seeds and priorities outside int64, stop_token_ids [2**64], JSON 10k levels
deep, lone surrogates in prompt / stop / cache_salt / chat content, chat content parts 10k
deep, the same on /tokenize.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
import pytest

from .test_cancellation import wait_idle_within

M = "shoal-test"
CMPL = {"model": M, "prompt": "hello there", "max_tokens": 2}
CHAT = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = 10_000


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict | bytes
    status: int = 400
    param: str | None = None  # the field the error must name (None: not checked)
    auth: bool = True


def cmpl(name: str, param: str | None = None, status: int = 400, **fields) -> Case:
    return Case(name, "/v1/completions", {**CMPL, **fields}, status, param)


def chat(name: str, param: str | None = None, status: int = 400, **fields) -> Case:
    return Case(name, "/v1/chat/completions", {**CHAT, **fields}, status, param)


def raw(name: str, path: str, text: str, param: str | None = None, status: int = 400) -> Case:
    return Case(name, path, text.encode("utf-8", "surrogatepass"), status, param)


def deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_parts(depth: int) -> str:
    """Chat content parts nested ``depth`` levels: [{"type":"text","text":[{...}]}]."""
    return '[{"type":"text","text":' * depth + '"x"' + "}]" * depth


LONG_TEXT = "x" * (6 * 1024 * 1024)  # under the 8 MiB body limit, far over max_model_len

CASES = [
    # -- the reproductions --------------------------------------------------------
    cmpl("top_k 2**63", "top_k", top_k=2**63),
    cmpl("seed 2**64", "seed", seed=2**64),
    cmpl("seed -2**63-1", "seed", seed=-(2**63) - 1),
    cmpl("priority 2**64", "priority", priority=2**64),
    cmpl("stop_token_ids [2**64]", "stop_token_ids", stop_token_ids=[2**64]),
    cmpl("n 2 with seed 2**64-1", "seed", n=2, seed=2**64 - 1),
    raw("10k-deep JSON", "/v1/completions",
        json.dumps(CMPL)[:-1] + ', "user": ' + deep_list(DEEP) + "}"),
    raw("lone surrogate in prompt", "/v1/completions",
        '{"model": "shoal-test", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    raw("lone surrogate in stop", "/v1/completions",
        '{"model": "shoal-test", "prompt": "a", "stop": ["\\udc00"]}', "stop.0"),
    raw("lone surrogate in cache_salt", "/v1/completions",
        '{"model": "shoal-test", "prompt": "a", "cache_salt": "\\ud800"}', "cache_salt"),
    raw("lone surrogate in chat content", "/v1/chat/completions",
        '{"model": "shoal-test", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages.0.content"),
    raw("chat content parts 10k deep", "/v1/chat/completions",
        '{"model": "shoal-test", "messages": [{"role": "user", "content": '
        + deep_parts(DEEP) + "}]}"),
    raw("tokenize: lone surrogate", "/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    raw("tokenize: 10k deep", "/tokenize", '{"prompt": "x", "messages": ' + deep_list(DEEP) + "}"),
    # -- integer ranges -------------------------------------------------------------------
    cmpl("top_k -2", "top_k", top_k=-2),
    cmpl("top_k over the vocabulary", "top_k", top_k=10**6),
    cmpl("seed 2**63 - 1 with n 2", "seed", n=2, seed=2**63 - 1),
    cmpl("priority -2**63-1", "priority", priority=-(2**63) - 1),
    cmpl("stop_token_ids [-1]", "stop_token_ids", stop_token_ids=[-1]),
    cmpl("stop_token_ids beyond the vocabulary", "stop_token_ids", stop_token_ids=[10**7]),
    cmpl("2000 stop_token_ids", "stop_token_ids", stop_token_ids=[1] * 2000),
    cmpl("n 0", "n", n=0),
    cmpl("n 65", "n", n=65),
    cmpl("n 2**64", "n", n=2**64),
    cmpl("logprobs 21", "logprobs", logprobs=21),
    cmpl("logprobs -1", "logprobs", logprobs=-1),
    cmpl("logprobs 2**64", "logprobs", logprobs=2**64),
    cmpl("max_tokens 0", "max_tokens", max_tokens=0),
    cmpl("max_tokens -1", "max_tokens", max_tokens=-1),
    cmpl("max_tokens 2**64", "max_tokens", max_tokens=2**64),
    cmpl("max_tokens past the context", "max_tokens", max_tokens=10**6),
    cmpl("min_tokens 2**64", "min_tokens", min_tokens=2**64),
    cmpl("min_tokens over max_tokens", "min_tokens", min_tokens=5, max_tokens=2),
    cmpl("prompt id 2**64", "prompt", prompt=[2**64]),
    cmpl("prompt id -1", "prompt", prompt=[-1]),
    cmpl("prompt id beyond the vocabulary", "prompt", prompt=[10**7]),
    cmpl("prompt id list of lists with 2**63", "prompt", prompt=[[1, 2], [2**63]]),
    cmpl("empty prompt list", "prompt", prompt=[]),
    cmpl("empty inner prompt", "prompt", prompt=[[]]),
    cmpl("100 prompts", "prompt", prompt=["a"] * 100),
    cmpl("40 prompts x n 2", "prompt", prompt=["a"] * 40, n=2),
    # -- floats ---------------------------------------------------------------------------
    cmpl("temperature -1", "temperature", temperature=-1),
    raw("temperature 1e400", "/v1/completions",
        '{"model": "shoal-test", "prompt": "a", "temperature": 1e400}'),
    raw("temperature NaN", "/v1/completions",
        '{"model": "shoal-test", "prompt": "a", "temperature": NaN}'),
    cmpl("top_p 0", "top_p", top_p=0),
    cmpl("top_p 1.5", "top_p", top_p=1.5),
    cmpl("min_p 2", "min_p", min_p=2),
    cmpl("presence_penalty 3", "presence_penalty", presence_penalty=3),
    cmpl("frequency_penalty -3", "frequency_penalty", frequency_penalty=-3),
    cmpl("repetition_penalty 0", "repetition_penalty", repetition_penalty=0),
    # -- strings and lists ----------------------------------------------------------------
    cmpl("65 stop strings", "stop", stop=[f"s{i}" for i in range(65)]),
    cmpl("10k stop strings", "stop", stop=[f"s{i}" for i in range(10_000)]),
    cmpl("a 300-character stop string", "stop", stop=["y" * 300]),
    cmpl("an empty stop string", "stop", stop=[""]),
    cmpl("a 1000-character cache_salt", "cache_salt", cache_salt="s" * 1000),
    Case("a 6 MiB text prompt", "/v1/completions", {**CMPL, "prompt": LONG_TEXT}, 400,
         "prompt"),
    # -- shape ----------------------------------------------------------------------------
    cmpl("unknown field", "bogus", bogus=1),
    cmpl("prompt of the wrong type", "prompt", prompt={"a": 1}),
    cmpl("stream_options with an unknown field", None, stream=True,
         stream_options={"nope": True}),
    cmpl("prompt_logprobs 2**64", "prompt_logprobs", prompt_logprobs=2**64),
    cmpl("prompt_logprobs -1", "prompt_logprobs", prompt_logprobs=-1),
    cmpl("unknown model", "model", 404, model="no-such-model"),
    raw("100-deep JSON", "/v1/completions",
        json.dumps(CMPL)[:-1] + ', "user": ' + deep_list(100) + "}"),
    raw("invalid JSON", "/v1/completions", '{"model": "shoal-test", "prompt": '),
    raw("JSON that is not an object", "/v1/completions", "[1, 2]"),
    Case("invalid UTF-8 bytes", "/v1/completions",
         b'{"model": "shoal-test", "prompt": "\xff\xfe"}'),
    Case("a 9 MiB body", "/v1/completions", {**CMPL, "prompt": "x" * (9 * 1024 * 1024)}, 413),
    # -- chat -----------------------------------------------------------------------------
    chat("no messages", "messages", messages=[]),
    chat("an unknown role", "messages.0.role", messages=[{"role": "wizard", "content": "x"}]),
    chat("an image content part", None,
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
    chat("top_logprobs without logprobs", "top_logprobs", top_logprobs=2),
    chat("top_logprobs 2**64", "logprobs", logprobs=True, top_logprobs=2**64),
    chat("max_completion_tokens 2**64", "max_tokens", max_completion_tokens=2**64),
    chat("chat seed 2**64", "seed", seed=2**64),
    chat("chat n 2 with seed 2**64-1", "seed", n=2, seed=2**64 - 1),
    chat("chat stop_token_ids [2**64]", "stop_token_ids", stop_token_ids=[2**64]),
    chat("a 6 MiB chat message", "messages",
         messages=[{"role": "user", "content": LONG_TEXT}]),
    # -- structured outputs -----------------------------------------------------------------
    cmpl("an invalid regex", None, structured_outputs={"regex": "(unclosed"}),
    cmpl("an invalid grammar", None, structured_outputs={"grammar": "root ::= ("}),
    cmpl("an unknown response_format type", "response_format.type",
         response_format={"type": "yaml"}),
    raw("a 10k-deep JSON schema", "/v1/completions",
        '{"model": "shoal-test", "prompt": "a", "structured_outputs": {"json": '
        + '{"type": "array", "items": ' * DEEP + '{"type": "string"}' + "}" * DEEP + "}}"),
    # -- /tokenize and /detokenize ----------------------------------------------------------
    Case("tokenize: both prompt and messages", "/tokenize",
         {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    Case("tokenize: neither", "/tokenize", {}, 400, "prompt"),
    Case("tokenize: a 6 MiB prompt", "/tokenize", {"prompt": LONG_TEXT}, 400, "prompt"),
    Case("tokenize: without a key", "/tokenize", {"prompt": "a"}, 401, auth=False),
    Case("detokenize: id 2**64", "/detokenize", {"tokens": [2**64]}, 400, "tokens"),
    Case("detokenize: id -1", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    Case("detokenize: more ids than max_model_len", "/detokenize", {"tokens": [1] * 100_000},
         400, "tokens"),
    Case("detokenize: without a key", "/detokenize", {"tokens": [1]}, 401, auth=False),
    Case("completions: without a key", "/v1/completions", CMPL, 401, auth=False),
]


def test_the_table_is_large_enough():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_clean_client_error(case: Case, server, http):
    headers = server.headers() if case.auth else {}
    started = time.monotonic()
    if isinstance(case.body, bytes):
        response = http.post(case.path, content=case.body,
                             headers={**headers, "Content-Type": "application/json"})
    else:
        response = http.post(case.path, json=case.body, headers=headers)
    elapsed = time.monotonic() - started
    assert response.status_code == case.status, response.text[:500]
    assert "Traceback" not in response.text and 'File "' not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if case.param is not None:
        assert error["param"] == case.param, error
    assert elapsed < 10, f"{case.name} took {elapsed:.1f} s"  # refused, not worked through


def test_the_engine_is_healthy_and_idle_after_the_table(server, http):
    assert server.get("/health").json()["status"] == "ok"
    out = http.post("/v1/completions", json={**CMPL, "seed": 2**63 - 1},
                    headers=server.headers())
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "length"
    wait_idle_within(server, 10)
    assert "Traceback" not in server.log()
