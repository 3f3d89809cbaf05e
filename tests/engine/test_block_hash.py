"""Block hashes: SHA-256 based, salted per tenant, equal across the engine's and the router's
entry points, and cheap enough per block."""

from __future__ import annotations

import time

from shoal.runtime.kv.block_hash import (
    ExtraKeys,
    effective_cache_salt,
    hash_block,
    hash_block_chain,
    hash_prefix_blocks,
    tenant_cache_salt,
)

from shoal.contract.tenant import tenant_of_key

BLOCK = 16


def test_the_three_entry_points_agree():
    tokens = list(range(5 * BLOCK + 3))
    extra = ExtraKeys("rev", None, "salt").digest()
    prefix = hash_prefix_blocks(tokens, BLOCK, extra)
    chain = hash_block_chain(0, tokens[:5 * BLOCK], BLOCK, extra)
    one_by_one, parent = [], 0
    for i in range(5):
        parent = hash_block(parent, tokens[i * BLOCK:(i + 1) * BLOCK], extra)
        one_by_one.append(parent)
    assert prefix == chain == one_by_one
    assert all(0 <= h < 2**64 for h in prefix)  # uint64 on the KV-events wire


def test_tenants_salts_and_revisions_change_every_hash():
    tokens = list(range(2 * BLOCK))
    base = hash_prefix_blocks(tokens, BLOCK, ExtraKeys("rev").digest())
    for extra in (ExtraKeys("rev2"), ExtraKeys("rev", "adapter"),
                  ExtraKeys("rev", None, effective_cache_salt("key:a", None)),
                  ExtraKeys("rev", None, effective_cache_salt("key:b", None))):
        other = hash_prefix_blocks(tokens, BLOCK, extra.digest())
        assert not set(other) & set(base)
    assert effective_cache_salt(None, "mine") == "mine"
    assert effective_cache_salt("key:a", "mine") != effective_cache_salt("key:b", "mine")
    assert "secret" not in tenant_of_key("sk-secret") + tenant_cache_salt(tenant_of_key("s"))
    assert tenant_of_key("sk-a") == tenant_of_key("sk-a") != tenant_of_key("sk-b")


def test_hashing_a_block_costs_microseconds_not_more():
    tokens = list(range(256 * BLOCK))
    extra = ExtraKeys("rev").digest()
    best = min(_timed(lambda: hash_prefix_blocks(tokens, BLOCK, extra)) for _ in range(5))
    per_block_us = best / 256 * 1e6
    print(f"sha256 block hash: {per_block_us:.2f} us per {BLOCK}-token block")
    assert per_block_us < 50  # generous: a loaded 2-core machine; ~1 us measured idle


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
