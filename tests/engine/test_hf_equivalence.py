"""Greedy output token-for-token equal to HF transformers (float32, CPU) for llama, qwen2 and
qwen3, through the real Worker: mixed prompt lengths, chunked prefill forced small, prefix
hits with staggered arrivals, and preemption forced by a tiny KV cache. The invariant
checker runs after every step and everything is free once idle."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tiny_moe_model_dirs):
    return {**tiny_model_dirs, **tiny_moe_model_dirs}


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(length)]


def engine(model_dir, **kwargs) -> EngineCore:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("num_kv_blocks", 128)
    return EngineCore(EngineConfig.from_kwargs(str(model_dir), **kwargs))


def same_kv_bytes(model_dir, num_blocks: int) -> int:
    """A model mixing sliding and full layers has KV cache groups whose blocks hold fewer
    layers each (``kv/kv_groups.py``): the block count taking the bytes ``num_blocks`` took
    with one block table for every layer (the same count for other models)."""
    from shoal.runtime.engine.core import kv_groups_of
    from shoal.runtime.model.config import load_model_config

    groups = kv_groups_of(load_model_config(model_dir))
    return num_blocks * sum(1 for g in groups.layer_group if g >= 0) // groups.slots


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(core: EngineCore, arrivals: list[tuple[int, str, list[int], int]]
        ) -> dict[str, list[int]]:
    """arrivals: (step at which it is added, req_id, prompt, max_tokens)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outputs: dict[str, list[int]] = {}
    step = 0
    while pending or core.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, req_id, prompt, max_tokens = pending.pop(0)
            core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                               sampling_params=greedy(max_tokens)))
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        core.check_invariants()
        step += 1
        assert step < 5000
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    return outputs


def mixed_batch(seed: int) -> list[tuple[int, str, list[int], int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 17, 33, 64, 100]
    return [(0, f"r{i}", random_prompt(rng, n), rng.randint(4, 24))
            for i, n in enumerate(lengths)]


def check(hf, assert_matches_hf, arrivals, outputs) -> int:
    prompts = {req_id: prompt for _, req_id, prompt, _ in arrivals}
    max_new = {req_id: m for _, req_id, _, m in arrivals}
    return assert_matches_hf(hf, prompts, outputs, max_new)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_prompt_lengths_match_hf(arch, model_dirs, hf_greedy, assert_matches_hf):
    arrivals = mixed_batch(1)
    outputs = run(engine(model_dirs[arch]), arrivals)
    assert check(hf_greedy(model_dirs[arch]), assert_matches_hf, arrivals, outputs) <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_budget_16_matches_hf(arch, model_dirs, hf_greedy,
                                              assert_matches_hf):
    arrivals = mixed_batch(1)  # same prompts as above: HF results are memoised
    core = engine(model_dirs[arch], max_num_batched_tokens=16)
    outputs = run(core, arrivals)
    assert check(hf_greedy(model_dirs[arch]), assert_matches_hf, arrivals, outputs) <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_with_staggered_arrivals_match_hf(arch, model_dirs, hf_greedy,
                                                            assert_matches_hf):
    rng = random.Random(2)
    system = random_prompt(rng, 45)
    arrivals = [(3 * i, f"r{i}", system + random_prompt(rng, rng.randint(1, 20)),
                 rng.randint(4, 16)) for i in range(6)]
    arrivals.append((20, "again", list(arrivals[0][2]), 8))  # the whole prompt cached
    core = engine(model_dirs[arch], block_size=8)
    outputs = run(core, arrivals)
    stats = core.stats()
    assert stats.prefix_cache_hits >= 5 * 40
    assert check(hf_greedy(model_dirs[arch]), assert_matches_hf, arrivals, outputs) <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_shared_within_one_step_matches_hf(arch, model_dirs, hf_greedy,
                                                    assert_matches_hf):
    """Requests arriving together read the system prompt's K/V in the step that writes it."""
    rng = random.Random(5)
    system = random_prompt(rng, 45)
    arrivals = [(0, f"r{i}", system + random_prompt(rng, rng.randint(1, 20)),
                 rng.randint(4, 16)) for i in range(6)]
    core = engine(model_dirs[arch], block_size=8)
    outputs = run(core, arrivals)
    assert core.stats().prefix_cache_hits == 5 * 40  # all five others, in the first step
    assert check(hf_greedy(model_dirs[arch]), assert_matches_hf, arrivals, outputs) <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_by_a_tiny_kv_cache_matches_hf(arch, model_dirs, hf_greedy,
                                                  assert_matches_hf):
    rng = random.Random(4)  # prompts fit together; their generations do not
    arrivals = [(0, f"r{i}", random_prompt(rng, rng.randint(5, 20)), 40) for i in range(6)]
    core = engine(model_dirs[arch], block_size=4,
                  num_kv_blocks=same_kv_bytes(model_dirs[arch], 32), max_model_len=128)
    outputs = run(core, arrivals)
    assert core.stats().num_preemptions > 0
    assert check(hf_greedy(model_dirs[arch]), assert_matches_hf, arrivals, outputs) <= 1


@pytest.mark.slow
def test_small_qwen3_everything_at_once_matches_hf(small_qwen3, hf_greedy, assert_matches_hf):
    """Integration-size model: shared prefixes, chunking and preemption in one run."""
    rng = random.Random(3)
    system = random_prompt(rng, 70)
    arrivals = [(2 * i, f"r{i}", (system if i % 2 else []) + random_prompt(rng, rng.randint(3, 90)),
                 rng.randint(8, 32)) for i in range(10)]
    core = engine(small_qwen3, block_size=16, num_kv_blocks=24, max_num_batched_tokens=64)
    outputs = run(core, arrivals)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert check(hf_greedy(small_qwen3), assert_matches_hf, arrivals, outputs) <= 1


FAMILIES = ["gemma2", "gemma3", "gemma3_nested", "mistral3_nested", "phi3_longrope", "olmo2",
            "granite", "glm4", "smollm3", "arcee", "ministral", "ministral3", "llama_biases", "qwen2_yarn",
            "mistral_sliding"]


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_family_everything_at_once_matches_hf(family, hf_greedy, assert_matches_hf):
    """A tiny checkpoint of each family transformers' classes made (runtime/model/
    make_family_model.py: sliding windows of 16, softcaps, multipliers, longrope, yarn, no-rope
    layers, ...): shared prefixes, chunked prefill and preemption in one run, past the window."""
    from shoal.runtime.model.make_family_model import cached_family_model

    model_dir = cached_family_model(family)
    rng = random.Random(6)
    system = random_prompt(rng, 37)
    arrivals = [(2 * i, f"r{i}", (system if i % 2 else []) + random_prompt(rng, rng.randint(3, 40)),
                 rng.randint(8, 24)) for i in range(6)]
    # a model mixing sliding and full layers frees its sliding group's blocks behind the
    # window: in the bytes of 40 blocks (80 of its blocks) it would never preempt here, so it
    # gets 48, still room for one 128-token request (32 blocks + the window's peak of 11)
    mixed = same_kv_bytes(model_dir, 40) != 40
    core = engine(model_dir, block_size=4, num_kv_blocks=48 if mixed else 40,
                  max_num_batched_tokens=24, max_model_len=128)
    outputs = run(core, arrivals)
    stats = core.stats()
    # mistral_sliding frees the blocks behind its window (every layer is windowed), so this
    # cache does not preempt it: tests/engine/test_sliding_window_blocks.py preempts it
    assert stats.num_preemptions > 0 or family == "mistral_sliding"
    assert stats.prefix_cache_hits > 0
    assert check(hf_greedy(model_dir), assert_matches_hf, arrivals, outputs) <= 1
