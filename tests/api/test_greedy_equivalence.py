"""Greedy decoding over HTTP equals the offline engine and HF transformers, token for token.

Random weights make some logits near-ties, where float rounding legitimately flips the
argmax: a divergence is accepted only at a position where the reference's top-2 margin is
below NEAR_TIE, and comparison stops there (later tokens follow a different prefix).
"""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import assert_equal_up_to_a_near_tie, greedy_token_ids

MAX_TOKENS = 16
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["def fibonacci(n):", "import sys\nimport os\n", "The quick brown fox",
             "class Node:\n    def __init__(self"]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def hf_reference(small_qwen3, prompts, hf_greedy) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, top-2 logit margin at each step) from transformers' generate."""
    return [hf_greedy(small_qwen3).generate(ids, MAX_TOKENS) for ids in prompts]


@pytest.fixture(scope="module")
def llm(small_qwen3):
    """The offline API (``LLM``) on the same checkpoint, in this process."""
    from shoal.runtime.llm import LLM

    return LLM(small_qwen3, num_kv_blocks=512)


@pytest.fixture(scope="module")
def offline(llm, prompts) -> list[list[int]]:
    from shoal.runtime.sampling_params import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


def test_greedy_over_http_equals_offline_engine_and_hf(server, prompts, hf_reference, offline):
    over_http = greedy_token_ids(server, prompts, MAX_TOKENS)
    assert over_http == offline  # same engine, same ids: exactly equal
    for ours, (reference, margins) in zip(over_http, hf_reference, strict=True):
        assert_equal_up_to_a_near_tie(ours, reference, margins, NEAR_TIE)
    exact = sum(ours == ref for ours, (ref, _) in zip(over_http, hf_reference, strict=True))
    assert exact >= len(prompts) - 1  # near-ties are rare: most prompts match HF exactly


def test_stop_strings_and_n_give_the_same_choices_over_http_and_offline(server, prompts, llm):
    """The API and ``LLM`` share one output path (fan-out, incremental detokenizing, stop
    strings held back and cut, finish reasons): the same call gives the same choices."""
    from shoal.runtime.sampling_params import SamplingParams

    sampled = {"n": 2, "temperature": 0.8, "seed": 7, "max_tokens": MAX_TOKENS}
    free = llm.generate(prompts[:2], SamplingParams(**sampled, ignore_eos=True))
    texts = [o.text for r in free for o in r.outputs]
    # stops that end some choices mid-text: a piece from the middle of two of them, one of
    # them with a first character that also occurs earlier (held back, then released)
    stops = [texts[0][len(texts[0]) // 2:][:3], texts[3][len(texts[3]) // 2:][:2]]
    assert all(s.strip() for s in stops), f"blank stop strings from {texts!r}"
    params = SamplingParams(**sampled, ignore_eos=True, stop=stops)
    offline = [o for r in llm.generate(prompts[:2], params) for o in r.outputs]

    client = openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0)
    batch = client.completions.create(
        model=server.model, prompt=prompts[:2], stop=stops, **sampled,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    over_http = sorted(batch.choices, key=lambda c: c.index)
    assert [(c.text, c.model_extra["token_ids"], c.finish_reason, c.model_extra["stop_reason"])
            for c in over_http] == [(o.text, o.token_ids, o.finish_reason, o.stop_reason)
                                    for o in offline]
    assert sum(o.finish_reason == "stop" for o in offline) >= 2
    assert all(s not in o.text for o in offline for s in stops)
