"""KV cache groups for models mixing sliding-window and full-attention layers: the grouping,
the per-group block tables (a sliding group frees behind its window while the full group
keeps every block), a prefix hit that must hold in every group, the capacity one cache
holds, and a mixed model's cached prefix over a real engine equal to HF."""

from __future__ import annotations

import random

import numpy as np
import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore, hybrid_token_limit, kv_groups_of
from shoal.runtime.kv.kv_groups import plan_kv_groups
from shoal.runtime.kv.kv_manager import FREED, KVCacheManager, PrefixHits, window_peak_blocks
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

BS = 4
GEMMA3_26 = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))  # 5:1 local:global


def test_gemma3_layers_form_seven_groups_of_four_over_four_tensor_pairs():
    groups = plan_kv_groups(GEMMA3_26)
    assert groups.slots == 4 and groups.windows == (None,) + (512,) * 6
    assert [groups.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert sorted(groups.layers_of(g) for g in range(7)) == [2, 4, 4, 4, 4, 4, 4]
    pairs = {(g, s) for g, s in zip(groups.layer_group, groups.layer_slot, strict=True)}
    assert len(pairs) == 26  # no two layers of one group share a tensor pair
    assert plan_kv_groups((None, 16) * 3).windows == (None, 16)  # Gemma 2: 1:1
    assert not plan_kv_groups((16,) * 4).hybrid and plan_kv_groups((16,) * 4).windows == (16,)
    assert plan_kv_groups(GEMMA3_26, split=False).windows == (None,)


def _hybrid(num_blocks: int = 32, window: int = 6) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_num_seqs=4, max_model_len=128,
                          group_windows=(None, window))


def _run_to(kv: KVCacheManager, seq, computed: int) -> None:
    assert kv.allocate_slots(seq, 0, computed)
    kv.cache_blocks_ahead([seq], [computed])
    kv.written()
    kv.free_outside_window([seq.req_id], np.array([computed]), np.array([kv.rows[seq.req_id]]))


def test_the_sliding_group_frees_behind_its_window_and_the_full_group_keeps_all(make_seq):
    kv = _hybrid()
    seq = make_seq("a", list(range(100, 140)))
    assert kv.allocate_slots(seq, 0, 24)
    assert kv.num_blocks_held_by_group("a") == [6, 6] and kv.num_free_blocks == 32 - 12
    # 24 computed: position 24 sees 19..24, so blocks 0..3 are behind the sliding window
    assert kv.free_outside_window(["a"], np.array([24]), np.array([kv.rows["a"]])) == 4
    assert kv.num_blocks_held_by_group("a") == [6, 2] and kv.blocks_held_by_group() == [6, 2]
    assert kv.block_ids("a", 1)[:4] == [-1] * 4 and -1 not in kv.block_ids("a", 0)
    assert kv.group_arrays[1][kv.rows["a"], :4].tolist() == [0] * 4
    # growing: every group's table covers the same positions
    assert kv.extend_tables(["a"], [40])
    assert kv.num_blocks_of("a") == 10 and kv.num_blocks_held_by_group("a") == [10, 6]
    kv.check_invariants()
    kv.free("a")
    assert kv.num_free_blocks == 32
    kv.check_invariants()


def test_a_prefix_hit_is_a_hit_in_every_group(make_seq):
    kv = _hybrid()
    prompt = list(range(200, 232))
    _run_to(kv, make_seq("a", prompt + [7]), 32)
    assert kv.num_blocks_held_by_group("a") == [8, 2]  # dead in the sliding group: blocks 0..5
    kv.free("a")
    again = make_seq("b", prompt + [9])
    hits = kv.find_cached_prefix(again)
    assert isinstance(hits, PrefixHits) and len(hits) == 8
    assert len(hits.groups[0]) == 2  # the sliding group: only blocks 6 and 7 (its window)
    assert kv.allocate_slots(again, 32, 1, hits)
    assert kv.block_ids("b", 1)[:6] == [-1] * 6 and kv.group_tables[1]["b"][6] is hits.groups[0][0]
    assert kv.num_blocks_held_by_group("b") == [9, 3]
    kv.check_invariants()
    kv.free("b")
    # the sliding group lost block 7's KV: 8 blocks are no hit (position 32's window reads
    # it); 7 are (position 28 reads blocks 5 and 6, still cached though freed)
    kv.pool.uncache(kv.pool.group_cached[1][again.block_hashes[7]])
    hits = kv.find_cached_prefix(make_seq("c", prompt + [5]))
    assert len(hits) == 7 and len(hits.groups[0]) == 2
    kv.check_invariants()


def test_group0_hits_alone_are_refused_for_a_mixed_model(make_seq):
    kv = _hybrid()
    prompt = list(range(300, 317))
    _run_to(kv, make_seq("a", prompt), 16)
    kv.free("a")
    seq = make_seq("b", prompt)
    plain = list(kv.find_cached_prefix(seq))
    with pytest.raises(ValueError, match="2 KV cache groups"):
        kv.allocate_slots(seq, 16, 1, plain)
    assert kv.tables == {} and FREED.block_id == -1
    kv.check_invariants()


def test_one_request_fits_the_full_groups_and_a_window_peak_per_sliding_group():
    groups = plan_kv_groups((16, None))
    peak = window_peak_blocks(16, 16, BS)
    assert hybrid_token_limit(groups, 80, BS, 16, 1024) == (80 - peak) * BS
    assert hybrid_token_limit(groups, 80, BS, 16, 100) == 100  # the model's own limit
    # short requests take a block in each group for each block of tokens
    assert hybrid_token_limit(groups, 6, BS, 16, 1024) == 3 * BS
    seven = plan_kv_groups(GEMMA3_26)
    assert hybrid_token_limit(seven, 10_000, 16, 2048, 10**6) == (
        10_000 - 6 * window_peak_blocks(512, 2048, 16)) * 16


def _engine(model_dir, **kwargs) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(model_dir), dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=16,
        **kwargs))


def test_the_same_bytes_hold_twice_the_blocks_for_gemma3(caplog):
    """Gemma 3's tiny checkpoint (one sliding, one full layer): a block holds one layer's
    K/V instead of both, so one memory budget gives twice the blocks; with
    ``--disable-hybrid-kv-cache-manager`` it is one table for both layers, as before."""
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.make_family_model import cached_family_model

    model_dir = cached_family_model("gemma3")
    assert kv_groups_of(load_model_config(model_dir)).windows == (None, 16)
    budget = 1 << 20
    grouped = _engine(model_dir, kv_cache_memory=budget)
    single = _engine(model_dir, kv_cache_memory=budget, disable_hybrid_kv_cache_manager=True)
    assert grouped.scheduler.kv.num_blocks == 2 * single.scheduler.kv.num_blocks
    assert grouped.executor.kv_bytes_per_block() * 2 == single.executor.kv_bytes_per_block()
    assert single.scheduler.kv.num_groups == 1 and grouped.scheduler.kv.num_groups == 2


def test_a_mixed_models_long_cached_prefix_takes_the_window_and_equals_hf(hf_greedy,
                                                                          assert_matches_hf):
    from shoal.runtime.model.make_family_model import cached_family_model

    model_dir = cached_family_model("gemma3")
    core = _engine(model_dir, num_kv_blocks=96)
    prompt = random.Random(5).sample(range(3, 1000), 20)
    first = _drain(core, "first", prompt, 60)
    again = prompt + first[:50]  # 70 tokens: 17 full blocks cached, 13 behind the window
    hits_before = core.stats().prefix_cache_hits
    held: list[list[int]] = []
    core.add_request(_request("again", again, 10))
    tokens: list[int] = []
    while core.scheduler.has_unfinished_requests():
        for out in core.step():
            tokens.extend(out.new_token_ids)
        core.scheduler.check_invariants()
        held.append(core.scheduler.kv.num_blocks_held_by_group("again"))
    assert core.stats().prefix_cache_hits - hits_before == 68
    assert held[0][0] == 18 and held[0][1] <= 16 // BS + 2, held  # full: all; sliding: window
    assert assert_matches_hf(hf_greedy(model_dir), {"again": again}, {"again": tokens},
                             {"again": 10}) <= 1


def _request(req_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(temperature=0.0,
                                                            max_tokens=max_tokens,
                                                            ignore_eos=True))


def _drain(core: EngineCore, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    core.add_request(_request(req_id, prompt, max_tokens))
    tokens: list[int] = []
    while core.scheduler.has_unfinished_requests():
        for out in core.step():
            tokens.extend(out.new_token_ids)
        core.scheduler.check_invariants()
    return tokens
