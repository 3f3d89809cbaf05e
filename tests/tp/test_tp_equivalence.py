"""TP=2 over gloo produces exactly the greedy tokens of TP=1, for every architecture.

llama tiny has one KV head, so at TP=2 both ranks hold a replica of it; qwen2, qwen3 and
qwen2_moe tiny shard their two KV heads. The workload mixes prompt lengths, a shared prefix (prefix
cache hits), chunked prefill (a 48-token budget) and concurrent decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    list(range(3, 20)),
    [7] * 5 + list(range(100, 160)),  # longer than one step's budget: chunked prefill
    list(range(3, 20)) + [500, 501, 502, 503, 504, 505, 506, 507, 508, 509],  # shared prefix
    [900, 17, 33],
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2_moe", "gpt_oss"])
def test_tp2_greedy_tokens_equal_tp1(arch, tiny_model_dirs, tiny_moe_model_dirs, make_engine,
                                      run_to_completion, greedy):
    """qwen2_moe: each expert's and the shared expert's intermediate dim split over the two
    ranks, routed and shared partial sums in one all-reduce, a dense layer between;
    gpt_oss: each rank's query heads with their attention sinks, a sliding layer."""
    model_dir = {**tiny_model_dirs, **tiny_moe_model_dirs}[arch]
    requests = [greedy(f"r{i}", p, max_tokens=10 + 3 * i, logprobs=2 if i == 0 else None)
                for i, p in enumerate(PROMPTS)]
    single = run_to_completion(make_engine(model_dir, tp=1), requests)
    tp2_engine = make_engine(model_dir, tp=2)
    tensor_parallel = run_to_completion(tp2_engine, requests)

    for req_id, outs in single.items():
        want = [t for o in outs for t in o.new_token_ids]
        got = [t for o in tensor_parallel[req_id] for t in o.new_token_ids]
        assert got == want, f"{arch} {req_id}: TP=2 diverged from TP=1"
        assert tensor_parallel[req_id][-1].finish_reason == outs[-1].finish_reason
    # logprobs come back from rank 0 through the wire and match the single-rank ones
    want_lp = [lp.logprob for o in single["r0"] for lp in o.new_logprobs or []]
    got_lp = [lp.logprob for o in tensor_parallel["r0"] for lp in o.new_logprobs or []]
    assert len(got_lp) == len(want_lp) == 10
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    assert sum(o.num_cached_tokens for outs in tensor_parallel.values() for o in outs) > 0
    tp2_engine.check_invariants()


@pytest.fixture(scope="module")
def odd_vocab_qwen2(tmp_path_factory):
    """Tied qwen2 with 1001 tokens: at TP=2 the embedding and the LM head (one tensor) are
    padded to 1002 rows, and the padding must never be embedded nor win an argmax."""
    import torch
    from shoal.runtime.model.make_model import hf_config
    from transformers import AutoModelForCausalLM

    config = hf_config("qwen2", "tiny")
    config.vocab_size = 1001
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("odd-vocab")
    model.save_pretrained(out)
    return out


def test_tp2_pads_a_vocabulary_that_does_not_divide(odd_vocab_qwen2, make_engine,
                                                    run_to_completion, greedy):
    requests = [greedy("top", [1000, 999, 3, 4], max_tokens=12),  # ids in the last shard
                greedy("low", [1, 2, 3], max_tokens=12)]
    single = run_to_completion(make_engine(odd_vocab_qwen2, tp=1), requests)
    tensor_parallel = run_to_completion(make_engine(odd_vocab_qwen2, tp=2), requests)
    for req_id, outs in single.items():
        want = [t for o in outs for t in o.new_token_ids]
        got = [t for o in tensor_parallel[req_id] for t in o.new_token_ids]
        assert got == want and max(got) < 1001


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "mistral_sliding"])
def test_tp2_feature_built_families_equal_tp1(family, make_engine, run_to_completion, greedy):
    """gemma2: sliding window (16) on alternate layers and softcaps, KV heads split over the
    ranks; olmo2: q/k norms over the whole projection, whose sum of squares is all-reduced;
    mistral_sliding: every layer windowed, so blocks behind the window go back to the pool
    mid-request (blocks of 4) and the ranks get tables whose leading entries were freed."""
    from shoal.runtime.model.make_family_model import cached_family_model

    model_dir = cached_family_model(family)
    requests = [greedy(f"r{i}", p, max_tokens=12 + 2 * i) for i, p in enumerate(PROMPTS)]
    block_size = 4 if family == "mistral_sliding" else 16
    single = run_to_completion(make_engine(model_dir, tp=1, block_size=block_size), requests)
    tp2_engine = make_engine(model_dir, tp=2, block_size=block_size)
    tensor_parallel = run_to_completion(tp2_engine, requests)
    if family == "mistral_sliding":
        assert tp2_engine.scheduler.kv.sliding_window == 16
    for req_id, outs in single.items():
        want = [t for o in outs for t in o.new_token_ids]
        got = [t for o in tensor_parallel[req_id] for t in o.new_token_ids]
        assert got == want, f"{family} {req_id}: TP=2 diverged from TP=1"
