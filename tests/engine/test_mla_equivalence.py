"""DeepSeek-V3 (multi-head latent attention over the paged latent cache, DeepSeek's MoE
routing) through the real engine: greedy output token for token equal to transformers'
``DeepseekV3ForCausalLM`` (float32, CPU) with requests of different lengths arriving
together and staggered, a shared system prompt (prefix-cache hits read cached latents),
prefill chunked small and preemption forced by a tiny cache. Both checkpoints of
``make_mla_model.py``: low-rank queries + interleaved rotary + DeepSeek yarn with mscale,
and a plain ``q_proj`` + neox rotary + attention biases."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.model.make_mla_model import MLA_ARCHS, cached_mla_model

from tests.engine.test_hf_equivalence import check, engine, random_prompt, run


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_deepseek_v3_everything_at_once_matches_hf(arch, hf_greedy, assert_matches_hf):
    model_dir = cached_mla_model(arch)
    rng = random.Random(7)
    system = random_prompt(rng, 37)  # past yarn's original 32 positions with the generations
    arrivals = [(2 * i, f"r{i}", (system if i % 2 else []) + random_prompt(rng, rng.randint(1, 40)),
                 rng.randint(8, 24)) for i in range(6)]
    arrivals.append((0, "long", random_prompt(rng, 70), 12))
    core = engine(model_dir, block_size=4, num_kv_blocks=44, max_num_batched_tokens=24,
                  max_model_len=128)
    outputs = run(core, arrivals)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert check(hf_greedy(model_dir), assert_matches_hf, arrivals, outputs) <= 1


def test_deepseek_v3_decode_batch_of_mixed_lengths_matches_hf(hf_greedy, assert_matches_hf):
    """Everything prefilled in one step, then long decode batches whose rows differ in
    length (the absorbed decode groups rows by length)."""
    model_dir = cached_mla_model("deepseek_v3")
    rng = random.Random(8)
    arrivals = [(0, f"r{i}", random_prompt(rng, n), 20) for i, n in enumerate((1, 3, 9, 30, 61))]
    outputs = run(engine(model_dir, block_size=8, max_model_len=128), arrivals)
    assert check(hf_greedy(model_dir), assert_matches_hf, arrivals, outputs) <= 1
