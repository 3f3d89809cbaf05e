"""DeepSeek-V3 at TP=2 over gloo gives the greedy tokens of TP=1: each rank holds half the
query heads (``q_b_proj`` rows), their rows of ``kv_b_proj`` and ``o_proj``'s columns, and a
full copy of the latent cache (the latent and rotary-key projections are replicated); the
experts' and the shared expert's intermediate dims are split, a dense first layer between.
Mixed prompt lengths, a shared prefix, a prefill chunked by a 48-token budget."""

from __future__ import annotations

import pytest
from shoal.runtime.model.make_mla_model import cached_mla_model

from tests.tp.test_tp_equivalence import PROMPTS

pytestmark = pytest.mark.slow


def test_tp2_deepseek_v3_greedy_tokens_equal_tp1(tp2_equals_tp1):
    tp1_engine, tp2_engine, tensor_parallel = tp2_equals_tp1(cached_mla_model("deepseek_v3"),
                                                             PROMPTS)
    assert sum(o.num_cached_tokens for outs in tensor_parallel.values() for o in outs) > 0
    # every rank caches the whole latent: the per-block bytes are TP=1's
    assert tp2_engine.executor.kv_bytes_per_block() == tp1_engine.executor.kv_bytes_per_block()
    tp2_engine.check_invariants()
