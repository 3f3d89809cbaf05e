"""Sliding-window block freeing: when every attention layer is windowed, a running request
gives back the blocks no window reaches again, its table stays positionally aligned, freed
blocks stay valid cached prefixes until reallocated, and the output still equals HF
transformers' own model with the window. Models with one full-attention layer free nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.kv.kv_manager import FREED, KVCacheManager, window_peak_blocks
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

WINDOW = 16  # make_family_model.WINDOW: mistral_sliding windows every layer by it


def _manager(window: int | None, num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, max_num_seqs=4, max_model_len=64,
                          sliding_window=window)


def _free(kv: KVCacheManager, seq, computed: int) -> int:
    return kv.free_outside_window([seq.req_id], np.array([computed]),
                                  np.array([kv.rows[seq.req_id]]))


def test_blocks_wholly_before_every_future_window_go_back(make_seq):
    kv = _manager(window=6)
    seq = make_seq("a", list(range(100, 140)))
    assert kv.allocate_slots(seq, 0, 24)  # blocks 0..5 hold positions 0..23
    kv.cache_blocks_ahead([seq], [24])
    kv.written()
    # 24 tokens computed: the next query (position 24) sees 19..24; block 4 (16..19) is read
    assert _free(kv, seq, 24) == 4
    assert kv.block_ids("a")[:4] == [-1] * 4 and kv.num_blocks_held("a") == 2
    assert kv.num_blocks_of("a") == 6  # positions still map to table entries
    assert kv.block_table_array[kv.rows["a"], :4].tolist() == [0, 0, 0, 0]
    assert kv.num_free_blocks == 16 - 2
    assert _free(kv, seq, 24) == 0  # idempotent
    # one more token: position 25 sees 20..25, so block 4 is dead too
    assert _free(kv, seq, 25) == 1 and kv.num_blocks_held("a") == 1
    kv.check_invariants()
    kv.free("a")
    assert kv.num_free_blocks == 16
    kv.check_invariants()


def test_a_model_with_a_full_attention_layer_frees_nothing(make_seq):
    kv = _manager(window=None)
    seq = make_seq("a", list(range(40)))
    assert kv.allocate_slots(seq, 0, 40)
    assert _free(kv, seq, 40) == 0 and kv.num_blocks_held("a") == 10


def test_freed_blocks_stay_valid_cached_prefixes_until_reallocated(make_seq):
    kv = _manager(window=4, num_blocks=12)
    prompt = list(range(200, 232))
    seq = make_seq("a", prompt + [7])
    assert kv.allocate_slots(seq, 0, 32)
    kv.cache_blocks_ahead([seq], [32])
    kv.written()
    assert _free(kv, seq, 32) == 7  # the window of position 32 starts in block 7
    # another request with the same prompt finds all eight blocks, seven of them free; it
    # takes only the one its window reaches (and a new one), the others stay FREED
    again = make_seq("b", prompt + [9])
    hits = kv.find_cached_prefix(again)
    assert len(hits) == 8 and hits[0].ref_cnt == 0
    assert kv.allocate_slots(again, 32, 1, hits)
    assert kv.block_ids("b") == [-1] * 7 + [hits[7].block_id, kv.tables["b"][8].block_id]
    assert kv.num_blocks_held("b") == 2 and hits[0].ref_cnt == 0
    kv.check_invariants()
    kv.free("b")
    # reallocating the freed blocks evicts their hashes: no stale prefix is ever served
    other = make_seq("c", list(range(500, 544)))
    assert kv.allocate_slots(other, 0, 44)  # 11 of the 12 blocks
    assert len(kv.find_cached_prefix(make_seq("d", prompt + [1]))) < 8
    kv.free("a")
    kv.free("c")
    kv.check_invariants()


def test_invariants_catch_a_freed_entry_that_is_not_leading(make_seq):
    from shoal.runtime.kv.kv_manager import KVInvariantError

    kv = _manager(window=4)
    seq = make_seq("a", list(range(20)))
    assert kv.allocate_slots(seq, 0, 20)
    kv.tables["a"][3] = FREED
    with pytest.raises(KVInvariantError):
        kv.check_invariants()


@pytest.mark.parametrize(("max_window_layers", "window"), [(0, 24), (1, None)])
def test_only_a_model_windowed_on_every_layer_frees(tmp_path, max_window_layers, window):
    """Qwen2 windows the layers from ``max_window_layers`` on: all of them, or all but the
    first (which then attends to everything, so no block may be freed)."""
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.make_model import hf_config

    config = hf_config("qwen2", "tiny")
    config.use_sliding_window, config.sliding_window = True, 24
    config.max_window_layers = max_window_layers
    config.architectures = ["Qwen2ForCausalLM"]
    config.layer_types = None
    config.__post_init__()  # layer_types from the sliding fields, as transformers derives them
    config.save_pretrained(tmp_path)
    assert load_model_config(tmp_path).sliding_window == window


# -- the engine over transformers' own windowed model --------------------------------------

def _engine(model_dir, **kwargs) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(model_dir), dtype="float32", device="cpu", block_size=4, **kwargs))


def _run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int,
         on_step=None) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for req_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                           sampling_params=params))
    outputs: dict[str, list[int]] = {r: [] for r in prompts}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
        core.check_invariants()
        if on_step is not None:
            on_step(core)
        steps += 1
        assert steps < 2000
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    return outputs


@pytest.fixture(scope="module")
def sliding_model():
    from shoal.runtime.model.make_family_model import cached_family_model

    return cached_family_model("mistral_sliding")


def test_a_long_generation_holds_a_bounded_number_of_blocks_and_equals_hf(
        sliding_model, hf_greedy, assert_matches_hf):
    core = _engine(sliding_model, num_kv_blocks=40, max_model_len=160)
    assert core.scheduler.kv.sliding_window == WINDOW
    prompt = random.Random(1).sample(range(3, 1000), 20)
    held: list[int] = []
    outputs = _run(core, {"long": prompt}, 120,
                   lambda c: held.append(c.scheduler.kv.num_blocks_held("long")))
    # a decode holds the window (16 positions, up to 5 blocks of 4) and the block it fills;
    # without freeing the request would end holding 35 blocks
    assert max(held[1:]) <= WINDOW // 4 + 2, held
    assert check(hf_greedy(sliding_model), assert_matches_hf, {"long": prompt}, outputs,
                 120) == 0


def test_requests_longer_together_than_the_cache_run_without_preemption(
        sliding_model, hf_greedy, assert_matches_hf):
    rng = random.Random(2)
    system = rng.sample(range(3, 1000), 24)
    prompts = {f"r{i}": system + rng.sample(range(3, 1000), rng.randint(3, 30))
               for i in range(4)}
    # 40 blocks of 4 hold 160 tokens; the four requests reach 127-154 tokens, ~560 together
    core = _engine(sliding_model, num_kv_blocks=40, max_model_len=160,
                   max_num_batched_tokens=32)
    outputs = _run(core, prompts, 100)
    stats = core.stats()
    assert stats.num_preemptions == 0
    assert stats.prefix_cache_hits > 0  # the system prompt is shared before it is freed
    assert check(hf_greedy(sliding_model), assert_matches_hf, prompts, outputs, 100) <= 1


def test_preemption_with_freed_blocks_equals_hf(sliding_model, hf_greedy, assert_matches_hf):
    """A request preempted after blocks behind its window went back recomputes from its
    first token (its freed entries are not freed twice) and still equals HF."""
    rng = random.Random(3)
    prompts = {f"r{i}": rng.sample(range(3, 1000), rng.randint(5, 20)) for i in range(8)}
    core = _engine(sliding_model, num_kv_blocks=24, max_model_len=96)
    outputs = _run(core, prompts, 60)
    assert core.stats().num_preemptions > 0
    assert check(hf_greedy(sliding_model), assert_matches_hf, prompts, outputs, 60) <= 1


def test_a_sequence_longer_than_the_whole_cache_equals_hf(sliding_model, hf_greedy,
                                                          assert_matches_hf, caplog):
    """16 blocks of 4 hold 64 tokens; a request runs to 20 + 150 tokens, since it only ever
    holds its window's blocks (max_model_len is the model's own 1024)."""
    with caplog.at_level("INFO", logger="shoal.engine.core"):
        core = _engine(sliding_model, num_kv_blocks=16, max_num_batched_tokens=16)
    assert "the last 16 positions, so a request holds at most 9 blocks" in caplog.text
    assert core.max_model_len == 1024
    prompt = random.Random(4).sample(range(3, 1000), 20)
    held: list[int] = []
    outputs = _run(core, {"long": prompt}, 150,
                   lambda c: held.append(c.scheduler.kv.num_blocks_held("long")))
    assert len(held) >= 150 and max(held) <= window_peak_blocks(WINDOW, 16, 4), held
    assert max(held[2:]) <= WINDOW // 4 + 2, held  # decoding: the window and one block
    assert check(hf_greedy(sliding_model), assert_matches_hf, {"long": prompt}, outputs,
                 150) == 0


def test_a_long_cached_prefix_is_taken_from_the_windows_start(sliding_model, hf_greedy,
                                                              assert_matches_hf):
    core = _engine(sliding_model, num_kv_blocks=48, max_num_batched_tokens=16)
    prompt = random.Random(5).sample(range(3, 1000), 20)
    first = _run(core, {"first": prompt}, 60)["first"]
    again = prompt + first[:50]  # 70 tokens: 17 full blocks cached, 13 behind the window
    held: list[int] = []
    hits_before = core.stats().prefix_cache_hits
    outputs = _run(core, {"again": again}, 10,
                   lambda c: held.append(c.scheduler.kv.num_blocks_held("again")))
    assert core.stats().prefix_cache_hits - hits_before == 68
    assert held[0] <= WINDOW // 4 + 2, held  # not the 18 blocks of the whole prefix
    assert check(hf_greedy(sliding_model), assert_matches_hf, {"again": again}, outputs,
                 10) == 0


def test_a_cache_smaller_than_the_window_keeps_the_limit(sliding_model):
    core = _engine(sliding_model, num_kv_blocks=8, max_num_batched_tokens=16)
    assert core.max_model_len == 32  # 8 blocks of 4: the window (16) and a step do not fit


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "ministral", "gpt_oss"])
def test_a_mixed_model_frees_its_sliding_groups_blocks_and_equals_hf(
        name, hf_greedy, assert_matches_hf, caplog):
    """Windowed layers alternating with full ones: each kind has its own KV cache group, so
    over a sequence many windows long the full group keeps every block while the sliding
    group holds only its window's, and the output equals HF's."""
    from shoal.runtime.model.make_family_model import cached_family_model
    from shoal.runtime.model.make_moe_model import cached_moe_model

    model_dir = cached_moe_model(name) if name == "gpt_oss" else cached_family_model(name)
    with caplog.at_level("INFO", logger="shoal.engine.core"):
        # 80 blocks of one layer each: the bytes 40 blocks of both layers took with one table
        core = _engine(model_dir, num_kv_blocks=80, max_num_batched_tokens=16)
    assert set(core.model_config.layer_windows) == {WINDOW, None}
    assert "KV cache groups: full attention: 1 layers in 1 group(s); window 16" in caplog.text
    kv = core.scheduler.kv
    assert kv.windows == (None, WINDOW) and kv.sliding_window is None
    peak = window_peak_blocks(WINDOW, 16, 4)
    assert core.max_model_len == (80 - peak) * 4  # was 160 with one table per request
    prompt = random.Random(7).sample(range(3, 1000), 20)
    tables: list[tuple[list[int], int]] = []
    outputs = _run(core, {"long": prompt}, 120, lambda c: tables.append(
        (c.scheduler.kv.num_blocks_held_by_group("long"), c.scheduler.kv.num_blocks_of("long"))))
    assert all(full == covered for (full, _), covered in tables)
    assert max(full for (full, _), _ in tables) == 35  # 139 positions computed, 4 per block
    assert max(sliding for (_, sliding), _ in tables) <= peak, tables
    assert max(sliding for (_, sliding), _ in tables[3:]) <= WINDOW // 4 + 2, tables
    assert check(hf_greedy(model_dir), assert_matches_hf, {"long": prompt}, outputs,
                 120) <= 1


def check(hf, assert_matches_hf, prompts, outputs, max_tokens: int) -> int:
    return assert_matches_hf(hf, prompts, outputs, dict.fromkeys(prompts, max_tokens))
