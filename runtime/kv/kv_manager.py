"""Per-request block tables over the block pool, with prefix caching by chained hashes.

The scheduler asks for the slots a step needs (``allocate_slots`` for an admission,
``extend_tables`` for the running rows: all or nothing), looks up a waiting request's cached
prefix (``find_cached_prefix``), offers the blocks each step fills to the prefix cache
(``cache_blocks_ahead``), and frees a request's blocks when it finishes or is preempted. Only
full blocks are ever hashed, so only full blocks are shared; a shared block is read-only
because nobody appends into a full block.

Blocks are hashed when the step that fills them is scheduled, not after it ran (the tokens
are known by then, a decode's as much as a prefill chunk's): a request admitted later in the
same step then shares them instead of computing the same prefix again (many users sending
one system prompt at once). Every attention backend writes a step's K/V before any row of
the step reads the cache, so the sharer reads them complete. A step that fails wrote nothing
anyone may trust: its ahead-hashed blocks are forgotten (``forget_unwritten``); a step that
ran clears the record (``written``).

Block tables also live in one persistent int32 array, one row per request holding blocks,
so building a step's ``block_tables`` is a single fancy-indexing copy.

Sliding windows: when EVERY attention layer sees only the last ``sliding_window`` positions
(Mistral-style models), a block wholly before the window of the next token a request
computes is never read again by any layer, so it goes back to the pool while the request
runs (``free_outside_window``; vLLM's sliding-window manager does the same). The table stays
positionally aligned: a freed entry becomes ``FREED`` (block id 0 in the array, the padding
value, never read: every attention backend starts reading at the window). A freed block
keeps its hash like any freed block: its K/V stays right for that prefix until the block is
reallocated (which evicts the hash), so another request may still take it as a cached
prefix. With even one full-attention layer (Gemma 2/3, gpt-oss alternate sliding and full
layers) every block stays needed, and nothing is freed early.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from shoal.runtime.kv.block_hash import NONE_HASH, hash_block, hash_block_chain
from shoal.runtime.kv.block_pool import BlockPool, KVBlock
from shoal.runtime.kv.events import KVEvent


class KVInvariantError(AssertionError):
    """The KV bookkeeping is inconsistent: a bug, never a user error."""


class KVSequence(Protocol):
    """What the manager needs of a request (structural, so kv imports no scheduler)."""

    req_id: str
    all_token_ids: list[int]
    block_hashes: list[int]  # hashes of the leading full blocks, extended by the manager
    extra_digest: bytes  # ExtraKeys(...).digest(): model revision, adapter, cache salt
    # optional ``lora_name``: the adapter, named in the KV events of the blocks it stores


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# a table entry whose block went back to the pool because no layer's window reaches it
FREED = KVBlock(-1)


def window_peak_blocks(window: int, max_step_tokens: int, block_size: int) -> int:
    """The most blocks one request of a model windowed on every layer holds at once, however
    long it is: a step's tokens and the ``window - 1`` positions before them, misaligned by
    up to a block."""
    return cdiv(window - 1 + max_step_tokens, block_size) + 1


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.block_size = block_size
        # the window of every layer (None: some layer attends to all positions)
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.tables: dict[str, list[KVBlock]] = {}
        # blocks a request holds outside any block table (KV transfer, ``hold_table``)
        self.holds: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading table blocks already offered to the cache
        self._unwritten: list[KVBlock] = []  # hashed ahead by the step in flight
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.block_table_array = np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32)
        self.num_freed = np.zeros(max_num_seqs, np.int64)  # per table row: leading FREED entries

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_of(self, req_id: str) -> int:
        """The positions the table covers, in blocks (freed leading entries included)."""
        table = self.tables.get(req_id)
        return 0 if table is None else len(table)

    def num_blocks_held(self, req_id: str) -> int:
        """The pool blocks the request holds now (its table less the freed entries)."""
        row = self.rows.get(req_id)
        return 0 if row is None else len(self.tables[req_id]) - int(self.num_freed[row])

    def block_ids(self, req_id: str) -> list[int]:
        """The table's block ids; a freed entry is -1."""
        return [b.block_id for b in self.tables.get(req_id, [])]

    # -- prefix cache -------------------------------------------------------------------
    def find_cached_prefix(self, seq: KVSequence) -> list[KVBlock]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never
        served from cache: the step that computes it produces the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(seq.all_token_ids) - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        hits: list[KVBlock] = []
        cached = self.pool.cached
        for block_hash in seq.block_hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def prefix_hashes(self, seq: KVSequence, num_blocks: int) -> list[int]:
        """The hashes of the sequence's first ``num_blocks`` full blocks."""
        self._ensure_hashes(seq, num_blocks)
        return seq.block_hashes[:num_blocks]

    def _ensure_hashes(self, seq: KVSequence, num_blocks: int) -> None:
        hashes = seq.block_hashes
        have = len(hashes)
        if have >= num_blocks:
            return
        size = self.block_size
        hashes.extend(hash_block_chain(hashes[-1] if have else NONE_HASH,
                                       seq.all_token_ids[have * size:num_blocks * size], size,
                                       seq.extra_digest))

    def cache_full_blocks(self, seq: KVSequence, num_computed_tokens: int) -> None:
        """Offer the blocks whose KV is now complete to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        done = self._num_hashed.get(seq.req_id)
        if done is None or full <= done:
            return
        self._ensure_hashes(seq, full)
        parent = seq.block_hashes[done - 1] if done else None
        table = self.tables[seq.req_id]
        size = self.block_size
        tokens = seq.all_token_ids[done * size:full * size] if self.pool.record_events else ()
        self.pool.cache_blocks(table[done:full], seq.block_hashes[done:full], parent, size,
                               tokens, getattr(seq, "lora_name", None))
        self._num_hashed[seq.req_id] = full

    def cache_blocks_ahead(self, seqs: Sequence[KVSequence], num_tokens: Sequence[int]
                           ) -> None:
        """Rows being scheduled: the blocks that are full once the step computes
        ``num_tokens[i]`` of ``seqs[i]`` become shareable now (see the module docstring), and
        are recorded as unwritten until the step has run. The common case, a decode whose
        token fills one block, hashes just that block."""
        if not self.enable_prefix_caching:
            return
        size, num_hashed, tables, pool = self.block_size, self._num_hashed, self.tables, self.pool
        unwritten = self._unwritten
        for seq, total in zip(seqs, num_tokens, strict=True):
            full = total // size
            done = num_hashed.get(seq.req_id)
            if done is None or full <= done:
                continue
            hashes = seq.block_hashes
            table = tables[seq.req_id]
            if full == done + 1 and len(hashes) == done:  # one new block, not hashed before
                parent = hashes[-1] if done else NONE_HASH
                tokens = seq.all_token_ids[done * size:full * size]
                block_hash = hash_block(parent, tokens, seq.extra_digest)
                hashes.append(block_hash)
                pool.cache_block(table[done], block_hash, parent if done else None, size,
                                 tokens, getattr(seq, "lora_name", None))
                num_hashed[seq.req_id] = full
            else:
                self.cache_full_blocks(seq, total)
            unwritten.extend(table[done:full])

    def written(self) -> None:
        """The step in flight ran: its ahead-hashed blocks hold their K/V."""
        self._unwritten.clear()

    def forget_unwritten(self) -> None:
        """The step in flight failed: unhash the blocks it hashed ahead (their K/V may never
        have been written). Its requests are preempted or failed by the caller."""
        for block in self._unwritten:
            self.pool.uncache(block)
        self._unwritten.clear()

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(self, seq: KVSequence, num_computed_tokens: int, num_new_tokens: int,
                       cached_blocks: list[KVBlock] | None = None) -> bool:
        """Blocks for ``num_new_tokens`` after ``num_computed_tokens``; ``cached_blocks``
        (admission only) become the head of the table. False, with nothing changed, when
        the pool cannot cover it."""
        req_id = seq.req_id
        table = self.tables.get(req_id)
        hits = cached_blocks or []
        if hits and table:
            raise ValueError(f"cached blocks offered to {req_id!r}, which already holds blocks")
        have = len(table) if table is not None else 0
        total_tokens = num_computed_tokens + num_new_tokens
        needed = cdiv(total_tokens, self.block_size) - have - len(hits)
        if cdiv(total_tokens, self.block_size) > self.max_blocks_per_seq:
            raise ValueError(f"{req_id!r}: {total_tokens} tokens exceed max_model_len")
        # leading hits no window reaches are not taken (FREED in the table): a long cached
        # prefix then needs only the window's blocks, like a running request
        dead = min(self._dead_blocks(num_computed_tokens), len(hits)) if table is None else 0
        hits = hits[dead:]
        # hits sitting in the free list leave it, so they cannot also be allocated fresh
        hits_in_free_list = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
        if needed > self.pool.free_list.num_free - hits_in_free_list:
            return False
        if table is None:
            if not self._free_rows:
                return False
            table = self.tables[req_id] = [FREED] * dead
            self.rows[req_id] = self._free_rows.pop()
            self.num_freed[self.rows[req_id]] = dead
            self._num_hashed[req_id] = dead + len(hits)
        if not hits and needed <= 0:
            return True
        self.pool.touch(hits)
        new_blocks = self.pool.allocate(max(needed, 0))
        start = len(table)  # after any FREED entries (0 in the array already)
        table.extend(hits)
        table.extend(new_blocks)
        row = self.block_table_array[self.rows[req_id]]
        if len(table) == start + 1:  # the common case: one new block (a scalar store)
            row[start] = table[start].block_id
        else:
            row[start:len(table)] = [b.block_id for b in table[start:]]
        return True

    def extend_tables(self, req_ids: Sequence[str], num_tokens: Sequence[int]) -> bool:
        """Grow the tables of requests that hold blocks to cover ``num_tokens[i]`` tokens
        each, all or nothing (False, nothing changed, when the pool cannot cover them all):
        the running rows' one call per step instead of ``allocate_slots`` per row."""
        size, tables, max_blocks = self.block_size, self.tables, self.max_blocks_per_seq
        growth = []
        for req_id, total in zip(req_ids, num_tokens, strict=True):
            table = tables[req_id]
            needed = cdiv(total, size) - len(table)
            if needed > 0:
                if len(table) + needed > max_blocks:
                    raise ValueError(f"{req_id!r}: {total} tokens exceed max_model_len")
                growth.append((req_id, table, needed))
        total = sum(n for _, _, n in growth)
        if total > self.pool.free_list.num_free:
            return False
        array, rows = self.block_table_array, self.rows
        blocks = self.pool.allocate(total)
        at = 0
        for req_id, table, needed in growth:
            start = len(table)
            if needed == 1:
                block = blocks[at]
                table.append(block)
                array[rows[req_id], start] = block.block_id
            else:
                table.extend(blocks[at:at + needed])
                array[rows[req_id], start:len(table)] = [b.block_id for b in table[start:]]
            at += needed
        return True

    def free_outside_window(self, req_ids: Sequence[str], num_computed: np.ndarray,
                            rows: np.ndarray) -> int:
        """Running requests (``num_computed[i]`` tokens of ``req_ids[i]`` computed, table
        row ``rows[i]``): give back the leading blocks no layer reads again, and return how
        many went back. The next token computed sits at position ``num_computed``; its
        window starts at ``num_computed - W + 1`` and later tokens' windows start later, so
        block ``b`` is dead once ``(b + 1) * block_size <= num_computed - W + 1``. Those
        blocks are complete (their tokens are computed), so they were offered to the prefix
        cache already. A no-op unless every layer is windowed."""
        window = self.sliding_window
        if window is None or not len(req_ids):
            return 0
        dead = np.maximum(num_computed - (window - 1), 0) // self.block_size
        freed = 0
        for i in np.flatnonzero(dead > self.num_freed[rows]).tolist():
            freed += self._free_leading(req_ids[i], int(rows[i]), int(dead[i]))
        return freed

    def _dead_blocks(self, num_computed: int) -> int:
        """Leading blocks no window reaches once ``num_computed`` tokens are computed."""
        window = self.sliding_window
        return 0 if window is None else max(num_computed - (window - 1), 0) // self.block_size

    def _free_leading(self, req_id: str, row: int, count: int) -> int:
        table = self.tables[req_id]
        start = int(self.num_freed[row])
        count = min(count, len(table))
        if self._num_hashed[req_id] < count:  # never offered (not expected): the cache skips
            self._num_hashed[req_id] = count  # them, so FREED itself is never hashed
        gone = table[start:count]
        table[start:count] = [FREED] * len(gone)
        self.pool.free(reversed(gone))  # the later block first: the head is more shareable
        self.block_table_array[row, start:count] = 0
        self.num_freed[row] = count
        return len(gone)

    def free(self, req_id: str) -> None:
        """Release a request's blocks, tail first (its tail is the least shareable)."""
        table = self.tables.pop(req_id, None)
        if table is None:
            return
        row = self.rows.pop(req_id)
        self.pool.free(reversed(table[int(self.num_freed[row]):]))
        del self._num_hashed[req_id]
        self.block_table_array[row, :len(table)] = 0
        self.num_freed[row] = 0
        self._free_rows.append(row)

    # -- holds: blocks kept for a KV transfer, outside any block table ------------------
    def hold_table(self, req_id: str, keep: int) -> list[KVBlock]:
        """A finishing request (``free`` otherwise): its first ``keep`` blocks stay held under
        its id for a remote engine to pull; the rest are freed. Returns the held blocks."""
        table = self.tables.get(req_id)
        if table is None or keep <= 0 or any(b is FREED for b in table[:keep]):
            self.free(req_id)  # nothing to offer (a sliding window freed its head)
            return []
        kept = table[:keep]
        for block in kept:
            block.ref_cnt += 1  # the hold's own reference, so free() below leaves them
        self.free(req_id)
        self.holds[req_id] = kept
        return kept

    def hold_new(self, req_id: str, hits: list[KVBlock], count: int) -> list[KVBlock] | None:
        """Hold ``hits`` (cached blocks, not evicted while held) and ``count`` fresh blocks
        for a pull; None, nothing changed, when the pool cannot cover them."""
        if req_id in self.holds:
            raise ValueError(f"{req_id!r} already holds blocks")
        hits_in_free_list = sum(1 for b in hits if b.ref_cnt == 0)
        if count > self.pool.free_list.num_free - hits_in_free_list:
            return None
        self.pool.touch(hits)
        fresh = self.pool.allocate(count)
        self.holds[req_id] = [*hits, *fresh]
        return fresh

    def publish_held(self, req_id: str, start: int, hashes: list[int], parent: int | None,
                     token_ids: Sequence[int], lora_name: str | None = None) -> None:
        """Held blocks ``start..`` now hold the KV of these hashes (a pull wrote them): make
        them findable, so the request's admission finds them as its cached prefix."""
        if not self.enable_prefix_caching:
            return
        blocks = self.holds[req_id][start:start + len(hashes)]
        self.pool.cache_blocks(blocks, hashes, parent, self.block_size,
                               token_ids if self.pool.record_events else (), lora_name)

    def release_hold(self, req_id: str) -> bool:
        """Drop a request's held blocks (tail first); False when it held none."""
        blocks = self.holds.pop(req_id, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_cache()

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    # -- invariants ---------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise KVInvariantError if the bookkeeping is inconsistent (tests call this after
        every step)."""
        pool = self.pool
        refs = Counter(b.block_id for table in (*self.tables.values(), *self.holds.values())
                       for b in table if b is not FREED)
        free_ids = [b.block_id for b in pool.free_list]
        free_set = set(free_ids)
        if len(free_ids) != len(free_set):
            raise KVInvariantError("a block is twice in the free list")
        if len(free_ids) != pool.num_free:
            raise KVInvariantError(f"free count {pool.num_free} != free list {len(free_ids)}")
        for block in pool.blocks:
            count = refs.get(block.block_id, 0)
            if block.ref_cnt != count:
                raise KVInvariantError(f"{block}: ref count != {count} table references")
            if (block.ref_cnt == 0) != (block.block_id in free_set):
                raise KVInvariantError(f"{block}: free-list membership disagrees with its "
                                       "ref count")
            if block.ref_cnt > 1 and block.block_hash is None:
                raise KVInvariantError(f"{block} is shared but not a full block")
            if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
                raise KVInvariantError(f"{block}: hash not mapped to it")
        for block_hash, block in pool.cached.items():
            if block.block_hash != block_hash:
                raise KVInvariantError(f"{block}: hash map entry {block_hash}")
        if set(self.rows) != set(self.tables):
            raise KVInvariantError("block-table rows disagree with tables")
        for req_id, table in self.tables.items():
            freed = int(self.num_freed[self.rows[req_id]])
            if any(b is FREED for b in table[freed:]) or any(b is not FREED
                                                              for b in table[:freed]):
                raise KVInvariantError(f"{req_id}: freed entries are not its leading {freed}")
            if freed and self.sliding_window is None:
                raise KVInvariantError(f"{req_id}: blocks freed without a sliding window")
            row = self.block_table_array[self.rows[req_id]]
            if (row[:len(table)].tolist() != [0 if b is FREED else b.block_id for b in table]
                    or row[len(table):].any()):
                raise KVInvariantError(f"{req_id}: block-table row is stale")
        if self.num_freed[self._free_rows].any():
            raise KVInvariantError("a free block-table row counts freed entries")
        if not self.tables and not self.holds and pool.num_free != pool.num_blocks:
            raise KVInvariantError(f"{pool.num_blocks - pool.num_free} blocks leaked with no "
                                   "request")
