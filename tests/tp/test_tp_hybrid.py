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
def test_tp2_hybrid_greedy_tokens_equal_tp1(arch, make_engine, run_to_completion, greedy):
    model_dir = cached_hybrid_model(arch)
    requests = [greedy(f"r{i}", p, max_tokens=10 + 3 * i) for i, p in enumerate(PROMPTS)]
    tp1_engine = make_engine(model_dir, tp=1, max_model_len=128)
    single = run_to_completion(tp1_engine, requests)
    tp2_engine = make_engine(model_dir, tp=2, max_model_len=128)
    tensor_parallel = run_to_completion(tp2_engine, requests)
    for req_id, outs in single.items():
        want = [t for o in outs for t in o.new_token_ids]
        got = [t for o in tensor_parallel[req_id] for t in o.new_token_ids]
        assert got == want, f"{req_id}: TP=2 diverged from TP=1"
    # each rank keeps half the heads' state
    assert 2 * tp2_engine.executor.state_bytes_per_request() == \
        tp1_engine.executor.state_bytes_per_request()
    tp2_engine.check_invariants()
