"""Checkpoints built from config features, served over HTTP, equal HF greedy token for token
with chunked prefill (16-token steps), prefix-cache hits (a shared system prompt) and
preemption (a small cache for five concurrent requests): a dense family (tiny Gemma 2:
sliding window 16 on alternate layers, attention and final logit softcaps, sandwich norms,
scaled embeddings; every sequence longer than the window) and mixtures of experts (tiny
Qwen3-MoE; tiny gpt-oss: attention sinks, window 16 on alternate layers, yarn, its router and
clamped-SwiGLU experts). All are transformers' own classes with random weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.api.conftest import assert_equal_up_to_a_near_tie, greedy_token_ids

MAX_TOKENS = 16
NEAR_TIE = 1e-4


def gemma2() -> Path:
    from shoal.runtime.model.make_family_model import cached_family_model

    return cached_family_model("gemma2")


def qwen3_moe() -> Path:
    from shoal.runtime.model.make_moe_model import cached_moe_model

    return cached_moe_model("qwen3_moe")


def gpt_oss() -> Path:
    from shoal.runtime.model.make_moe_model import cached_moe_model

    return cached_moe_model("gpt_oss")


# checkpoint, KV blocks of 4 tokens (few enough to preempt), prompt seed, shared prefix length;
# gemma2 and gpt-oss mix sliding and full layers: a block of theirs holds one layer of two
# (KV cache groups, runtime/kv/kv_groups.py), and one 64-token request needs 16 blocks plus
# the sliding group's window peak of 9
CASES = {"gemma2": (gemma2, 26, 11, 20), "qwen3_moe": (qwen3_moe, 20, 7, 16),
         "gpt_oss": (gpt_oss, 26, 7, 16)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_over_http_equals_hf(start_server, hf_greedy, case):
    make, num_blocks, seed, shared = CASES[case]
    model_dir = make()
    server = start_server("--block-size", "4", "--num-kv-blocks", str(num_blocks),
                          "--max-num-batched-tokens", "16", "--max-model-len", "64",
                          model_dir=model_dir)
    rng = random.Random(seed)
    system = [rng.randrange(3, 1000) for _ in range(shared)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(rng.randint(2, 10))]
               for _ in range(5)]
    outputs = greedy_token_ids(server, prompts, MAX_TOKENS)

    assert server.metric("shoal:num_preemptions_total") > 0
    assert server.metric("shoal:prefix_cache_hits_total") >= 16
    reference = hf_greedy(model_dir)
    for prompt, ours in zip(prompts, outputs, strict=True):
        want, margins = reference.generate(prompt, MAX_TOKENS)
        assert_equal_up_to_a_near_tie(ours, want, margins, NEAR_TIE)
