"""Qwen3-Next (Gated DeltaNet linear attention + gated full attention + MoE) and Qwen3.5's
text model served over HTTP by a real ``shoal serve``: greedy equal to transformers'
``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM`` token for token for concurrent requests of different lengths, with chunked prefill (16-token
steps), preemption (20 blocks of 4 tokens) and 3 state slots (``--max-num-seqs``) for 5
requests; prefix caching is off for the model (no state checkpoint for a cached prefix)."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.model.make_hybrid_model import HYBRID_ARCHS, cached_hybrid_model

from tests.api.conftest import assert_equal_up_to_a_near_tie, greedy_token_ids
from tests.hf_reference import NEAR_TIE

MAX_TOKENS = 16


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_over_http_equals_hf_with_chunking_preemption_and_few_slots(arch, start_server,
                                                                    hf_greedy):
    model_dir = cached_hybrid_model(arch)
    server = start_server("--block-size", "4", "--num-kv-blocks", "20",
                          "--max-num-batched-tokens", "16", "--max-model-len", "64",
                          "--max-num-seqs", "3", model_dir=model_dir)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (2, 9, 21, 30, 40)]
    outputs = greedy_token_ids(server, prompts, MAX_TOKENS)
    assert server.metric("shoal:num_preemptions_total") > 0
    assert server.metric("shoal:prefix_cache_hits_total") == 0

    reference = hf_greedy(model_dir)
    for prompt, ours in zip(prompts, outputs, strict=True):
        want, margins = reference.generate(prompt, MAX_TOKENS)
        assert_equal_up_to_a_near_tie(ours, want, margins, NEAR_TIE)
