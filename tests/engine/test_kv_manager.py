"""Block pool and KV manager: LRU free list, prefix sharing of full blocks, events, and
invariants under random interleavings (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shoal.runtime.kv.block_pool import BlockPool
from shoal.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from shoal.runtime.kv.kv_manager import KVCacheManager, KVInvariantError

BS = 4


def manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_num_seqs=8, max_model_len=64,
                          enable_prefix_caching=caching)


def test_free_list_is_lru_and_a_freed_block_stays_findable_until_reallocated():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_blocks([a], [111], None, BS, list(range(BS)))
    pool.free([b, a, c])  # freed order: b, a, c
    assert pool.lookup(111) is a
    assert pool.allocate(1) == [b]  # head of the free list
    assert pool.lookup(111) is a  # not yet evicted
    assert pool.allocate(1) == [a]  # reallocated: evicted
    assert pool.lookup(111) is None
    assert pool.drain_events() == [BlockStored([111], None, list(range(BS)), BS),
                                   BlockRemoved([111])]


def test_allocation_is_all_or_nothing(make_seq):
    kv = manager(num_blocks=4)
    seq = make_seq("a", list(range(20)))
    assert not kv.allocate_slots(seq, 0, 20)  # needs 5 blocks
    assert kv.num_free_blocks == 4 and kv.tables == {}
    kv.check_invariants()


def test_prefix_hit_shares_only_full_blocks_and_never_the_last_token(make_seq):
    kv = manager()
    first = make_seq("a", list(range(10)))
    assert kv.allocate_slots(first, 0, 10)
    kv.cache_full_blocks(first, 10)  # blocks 0-3, 4-7 full; 8-9 partial
    same = make_seq("b", list(range(10)))
    hits = kv.find_cached_prefix(same)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    exact_blocks = make_seq("c", list(range(8)))  # 8 tokens: only the first block may hit
    assert len(kv.find_cached_prefix(exact_blocks)) == 1
    assert kv.allocate_slots(same, 8, 2, cached_blocks=hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.check_invariants()


def test_cache_salt_isolates_prefixes(make_seq):
    kv = manager()
    a = make_seq("a", list(range(9)), salt="tenant-1")
    assert kv.allocate_slots(a, 0, 9)
    kv.cache_full_blocks(a, 9)
    assert kv.find_cached_prefix(make_seq("b", list(range(9)), salt="tenant-2")) == []
    assert len(kv.find_cached_prefix(make_seq("c", list(range(9)), salt="tenant-1"))) == 2


def test_free_releases_tail_first_so_the_head_survives_longest(make_seq):
    kv = manager(num_blocks=3)
    seq = make_seq("a", list(range(12)))
    assert kv.allocate_slots(seq, 0, 12)
    kv.cache_full_blocks(seq, 12)
    head, _, tail = kv.block_ids("a")
    kv.free("a")
    other = make_seq("b", [99] * 4)
    assert kv.allocate_slots(other, 0, 4)
    assert kv.block_ids("b") == [tail]
    assert len(kv.find_cached_prefix(make_seq("c", list(range(12)) + [5]))) == 2
    assert kv.pool.lookup(seq.block_hashes[0]).block_id == head


def test_invariant_checker_catches_a_leak_and_a_bad_ref_count(make_seq):
    kv = manager()
    seq = make_seq("a", list(range(5)))
    assert kv.allocate_slots(seq, 0, 5)
    kv.tables["a"][0].ref_cnt += 1
    with pytest.raises(KVInvariantError, match="ref count"):
        kv.check_invariants()
    kv.tables["a"][0].ref_cnt -= 1
    del kv.tables["a"]  # forget the table without freeing
    kv.rows.pop("a")
    with pytest.raises(KVInvariantError):
        kv.check_invariants()


def test_reset_prefix_cache_only_when_idle(make_seq):
    kv = manager()
    seq = make_seq("a", list(range(8)))
    assert kv.allocate_slots(seq, 0, 8)
    kv.cache_full_blocks(seq, 8)
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.pool.cached == {}
    assert isinstance(kv.drain_events()[-1], AllBlocksCleared)


# -- property test: random interleavings ----------------------------------------------------

op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 3), st.integers(1, 30)),  # prefix family, length
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("decode"), st.just(0), st.just(0)),  # one token for every live request
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=40), num_blocks=st.integers(2, 20))
def test_random_interleavings_keep_invariants_and_free_everything(make_seq, ops, num_blocks):
    kv = KVCacheManager(num_blocks, BS, max_num_seqs=8, max_model_len=64)
    live: dict[str, tuple[object, int]] = {}  # req_id -> (seq, num_computed)
    counter = 0
    for kind, a, b in ops:
        if kind == "admit" and len(live) < 8:
            counter += 1
            tokens = [a * 1000 + i for i in range(b)]  # same family = shared prefix
            seq = make_seq(f"r{counter}", tokens)
            hits = kv.find_cached_prefix(seq)
            computed = len(hits) * BS
            before = (kv.num_free_blocks, dict(kv.pool.cached))
            if kv.allocate_slots(seq, computed, b - computed, cached_blocks=hits):
                kv.cache_full_blocks(seq, b)
                live[seq.req_id] = (seq, b)
            else:
                assert (kv.num_free_blocks, dict(kv.pool.cached)) == before
        elif kind == "append" and live:
            req_id = sorted(live)[a % len(live)]
            seq, computed = live[req_id]
            if computed + b > 64:
                continue
            seq.all_token_ids.extend(range(7000, 7000 + b))
            if kv.allocate_slots(seq, computed, b):
                kv.cache_full_blocks(seq, computed + b)
                live[req_id] = (seq, computed + b)
            else:
                del seq.all_token_ids[-b:]
        elif kind == "decode" and live:
            rows = [(req_id, seq, computed) for req_id, (seq, computed) in sorted(live.items())
                    if computed < 64]
            before = (kv.num_free_blocks, {r: kv.block_ids(r) for r in live})
            if kv.extend_tables([r for r, _, _ in rows], [c + 1 for _, _, c in rows]):
                for req_id, seq, computed in rows:
                    seq.all_token_ids.append(9000 + computed)
                    live[req_id] = (seq, computed + 1)
                kv.cache_blocks_ahead([seq for _, seq, _ in rows], [c + 1 for _, _, c in rows])
                kv.written()
            else:
                assert (kv.num_free_blocks, {r: kv.block_ids(r) for r in live}) == before
        elif kind == "free" and live:
            req_id = sorted(live)[a % len(live)]
            kv.free(req_id)
            del live[req_id]
        kv.check_invariants()
    for req_id in list(live):
        kv.free(req_id)
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks


def test_extend_tables_grows_only_rows_that_need_blocks_all_or_nothing(make_seq):
    kv = manager(num_blocks=7)
    a, b = make_seq("a", list(range(8))), make_seq("b", list(range(100, 106)))
    assert kv.allocate_slots(a, 0, 8) and kv.allocate_slots(b, 0, 6)  # 2 + 2 blocks, 3 free
    assert kv.extend_tables(["a", "b"], [9, 7])  # a's 9th token starts block 3, b fits
    assert kv.num_blocks_of("a") == 3 and kv.num_blocks_of("b") == 2
    kv.check_invariants()  # the persistent block-table rows follow
    assert not kv.extend_tables(["a", "b"], [13, 16])  # 1 + 2 new blocks, 2 free
    assert kv.num_blocks_of("a") == 3 and kv.num_blocks_of("b") == 2
    assert kv.extend_tables(["b"], [16])  # a chunk: two blocks at once
    assert kv.num_blocks_of("b") == 4 and kv.num_free_blocks == 0
    kv.check_invariants()


def test_cache_hits_sitting_in_the_free_list_are_not_counted_twice(make_seq):
    kv = manager(num_blocks=4)
    first = make_seq("a", list(range(12)))
    assert kv.allocate_slots(first, 0, 12)
    kv.cache_full_blocks(first, 12)
    kv.free("a")  # 3 cached blocks, all free
    longer = make_seq("b", list(range(12)) + [50] * 8)  # hits 3 blocks, needs 2 more
    hits = kv.find_cached_prefix(longer)
    assert len(hits) == 3
    assert not kv.allocate_slots(longer, 12, 8, cached_blocks=hits)  # 4 free - 3 hits < 2
    assert all(b.ref_cnt == 0 for b in hits) and kv.num_free_blocks == 4
    assert kv.allocate_slots(longer, 12, 4, cached_blocks=hits)  # 1 more block fits
    assert kv.block_ids("b")[:3] == [b.block_id for b in hits]
    kv.check_invariants()


def test_usage_counts_referenced_blocks_only(make_seq):
    kv = manager(num_blocks=10)
    seq = make_seq("a", list(range(8)))
    assert kv.allocate_slots(seq, 0, 8)
    kv.cache_full_blocks(seq, 8)
    assert kv.usage() == pytest.approx(0.2)
    kv.free("a")
    assert kv.usage() == 0.0 and len(kv.pool.cached) == 2


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_hashes_one_at_a_time_chained_and_the_routers_agree(block_size):
    from shoal.runtime.kv.block_hash import (
        ExtraKeys,
        hash_block,
        hash_block_chain,
        hash_prefix_blocks,
    )

    extra = ExtraKeys("rev", "adapter", "salt").digest()
    tokens = [(i * 7919) % 150_000 for i in range(5 * block_size + block_size // 2)]
    routers = hash_prefix_blocks(tokens, block_size, extra)
    assert len(routers) == 5 and len(set(routers)) == 5
    assert hash_block_chain(0, tokens[:5 * block_size], block_size, extra) == routers
    assert hash_block_chain(routers[1], tokens[2 * block_size:5 * block_size], block_size,
                            extra) == routers[2:]
    parent = 0
    for i, want in enumerate(routers):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        assert parent == want
    assert hash_prefix_blocks(tokens, block_size, ExtraKeys("rev").digest()) != routers
