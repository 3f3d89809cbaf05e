"""EngineCore plumbing over the fake executor: KV sizing, max_model_len, KV events, prefix
cache reset, stats counters, and the priority policy's preemption victim."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore, resolve_num_kv_blocks
from shoal.runtime.kv.block_hash import ExtraKeys, hash_prefix_blocks
from shoal.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest


def request(req_id: str, prompt: list[int], max_tokens: int = 4, **kwargs) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(temperature=0.0,
                                                            max_tokens=max_tokens),
                             **kwargs)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def drain(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()
        core.check_invariants()


def test_kv_blocks_from_exact_count_memory_budget_or_default():
    config = EngineConfig(model="m", block_size=16)
    assert resolve_num_kv_blocks(config.replace(num_kv_blocks=7), 4096) == 7
    assert resolve_num_kv_blocks(config.replace(kv_cache_memory=10 * 4096 + 5), 4096) == 10
    default = resolve_num_kv_blocks(config.replace(max_num_seqs=4), 4096)
    assert default == 4 * 1024 // 16  # max_num_seqs x 1k tokens (well under 25% of RAM)
    with pytest.raises(ValueError, match="no block"):
        resolve_num_kv_blocks(config.replace(kv_cache_memory=100), 4096)


def test_max_model_len_defaults_to_what_the_kv_cache_holds(fake_engine):
    core, _ = fake_engine(num_kv_blocks=10, block_size=4)
    assert core.max_model_len == 40
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        fake_engine(num_kv_blocks=10, block_size=4, max_model_len=41)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fake_engine(num_kv_blocks=10_000, max_model_len=5000)


def test_kv_events_report_stored_chains_and_evictions_with_router_hashes(fake_engine):
    core, _ = fake_engine(num_kv_blocks=6, block_size=4, max_model_len=24,
                          kv_events_endpoint="inproc://events")
    prompt = prompt_of(9, 1)
    core.add_request(request("a", prompt, max_tokens=1, cache_salt="t1"))
    drain(core)
    stored = [e for e in core.drain_kv_events() if isinstance(e, BlockStored)]
    router_view = hash_prefix_blocks(prompt, 4, ExtraKeys(cache_salt="t1").digest())
    assert [h for e in stored for h in e.block_hashes] == router_view
    assert stored[0].parent_block_hash is None
    # each event carries its blocks' tokens (what llm-d hashes), block_size per hash
    assert [t for e in stored for t in e.token_ids] == prompt[:len(router_view) * 4]
    assert all(e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes)
               and e.lora_id is None for e in stored)
    for first, second in zip(stored, stored[1:], strict=False):  # parent: the chain before
        assert second.parent_block_hash == first.block_hashes[-1]
    core.add_request(request("b", prompt_of(23, 2), max_tokens=1))  # needs every block
    drain(core)
    removed = [h for e in core.drain_kv_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes]
    assert set(router_view) <= set(removed)
    assert core.drain_kv_events() == []


def test_kv_events_are_not_kept_when_nothing_publishes_them(fake_engine):
    """Without --kv-events-endpoint nothing drains them: recorded, they grew without bound."""
    core, _ = fake_engine(num_kv_blocks=6, block_size=4, max_model_len=24)
    for i in range(20):  # every block stored, then evicted by the next prompt
        core.add_request(request(f"r{i}", prompt_of(20, i), max_tokens=1))
        drain(core)
    assert core.drain_kv_events() == []
    assert core.scheduler.kv.pool.events == []


def test_reset_prefix_cache_clears_hits_and_emits_one_event(fake_engine):
    core, _ = fake_engine(kv_events_endpoint="inproc://events")
    prompt = prompt_of(12, 3)
    core.add_request(request("a", prompt))
    drain(core)
    assert core.reset_prefix_cache()
    assert isinstance(core.drain_kv_events()[-1], AllBlocksCleared)
    core.add_request(request("b", prompt))
    drain(core)
    assert core.stats().prefix_cache_hits == 0


def test_stats_count_prompt_and_generated_tokens_and_usage(fake_engine):
    core, _ = fake_engine(num_kv_blocks=20, block_size=4)
    core.add_request(request("a", prompt_of(6, 1), max_tokens=3))
    core.add_request(request("b", prompt_of(5, 2), max_tokens=2))
    core.step()
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.prompt_tokens) == (2, 0, 11)
    assert stats.kv_cache_usage == pytest.approx(4 / 20)  # 2 + 2 blocks
    drain(core)
    stats = core.stats()
    assert stats.generation_tokens == 5 and stats.kv_cache_usage == 0.0
    assert stats.prefix_cache_queries == 11 and stats.num_kv_blocks == 20


def test_priority_policy_preempts_the_worst_priority_first(fake_engine):
    core, _ = fake_engine(scheduling_policy="priority", num_kv_blocks=8, block_size=4,
                          max_model_len=32)
    core.add_request(request("urgent", prompt_of(7, 1), max_tokens=20, priority=0))
    core.add_request(request("relaxed", prompt_of(7, 2), max_tokens=20, priority=9))
    while not core.stats().num_preemptions:
        core.step()
        core.check_invariants()
    assert [r.req_id for r in core.scheduler.waiting] == ["relaxed"]
    drain(core)


def test_aborting_a_waiting_request_leaves_no_trace(fake_engine):
    core, _ = fake_engine(max_num_seqs=1)
    core.add_request(request("a", prompt_of(5, 1)))
    core.add_request(request("b", prompt_of(5, 2)))
    core.step()
    core.abort_requests(["b"])
    assert core.stats().num_waiting == 0
    drain(core)
    assert not core.has_unfinished_requests()


@pytest.mark.parametrize("text, limit", [("max\n", None), ("4294967296\n", 4 << 30),
                                         ("9223372036854771712\n", None), ("", None)])
def test_a_cgroup_memory_limit_is_read_as_bytes_or_none(text, limit):
    from shoal.runtime.engine.host_memory import parse_limit

    assert parse_limit(text) == limit


def test_on_cpu_the_kv_cache_is_sized_within_the_memory_it_lives_in():
    config = EngineConfig(model="m", block_size=16, max_num_seqs=64)
    host = 400 * 4096  # room for 400 blocks of 4096 bytes
    # the default budget: a quarter of that memory, where max_num_seqs x 1k tokens wants more
    assert resolve_num_kv_blocks(config, 4096, host_memory=host) == 100
    assert resolve_num_kv_blocks(config.replace(kv_cache_memory=400 * 4096), 4096,
                                 host_memory=host) == 400
    with pytest.raises(ValueError, match="does not fit in memory.*lower --kv-cache-memory"):
        resolve_num_kv_blocks(config.replace(kv_cache_memory=401 * 4096), 4096, host_memory=host)
    with pytest.raises(ValueError, match="lower --num-kv-blocks"):
        resolve_num_kv_blocks(config.replace(num_kv_blocks=401), 4096, host_memory=host)


def test_an_engine_refuses_a_cpu_kv_cache_larger_than_the_machine(fake_engine):
    import psutil

    too_big = 2 * psutil.virtual_memory().total
    with pytest.raises(ValueError, match="does not fit in memory"):
        fake_engine(num_kv_blocks=None, kv_cache_memory=too_big, device="cpu")
