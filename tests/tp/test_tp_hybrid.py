"""Qwen3-Next and Qwen3.5's text model at TP=2 over gloo give the greedy tokens of TP=1:
each rank holds one of the two linear-attention key heads with its two value heads (rows of
every projection into the heads, its channels of the conv, its heads' per-request state),
``out_proj`` row-parallel; the gated full-attention layers split heads as attention does,
the experts their intermediate dims. Mixed prompt lengths, prefill chunked by 48 tokens."""

from __future__ import annotations

import pytest
from shoal.runtime.model.make_hybrid_model import HYBRID_ARCHS, cached_hybrid_model

from tests.tp.test_tp_equivalence import PROMPTS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_tp2_hybrid_greedy_tokens_equal_tp1(arch, tp2_equals_tp1):
    tp1_engine, tp2_engine, _ = tp2_equals_tp1(cached_hybrid_model(arch), PROMPTS)
    # each rank keeps half the heads' state
    assert 2 * tp2_engine.executor.state_bytes_per_request() == \
        tp1_engine.executor.state_bytes_per_request()
    tp2_engine.check_invariants()
