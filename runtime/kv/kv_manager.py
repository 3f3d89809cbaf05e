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
prefix.

Mixed models (Gemma 2/3, gpt-oss, Cohere2 alternate sliding and full layers) have several KV
cache groups (``kv_groups.py``): each group has its own table per request, all of one
request's tables cover the same positions (one length, one row in every group's array), and
a windowed group frees its leading blocks as above while the full group keeps them. A prefix
hit must be a hit in every group (``find_cached_prefix``).
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


class PrefixHits(list[KVBlock]):
    """``find_cached_prefix``'s answer: group 0's hit blocks (a list, as a one-group model
    has always had) and, for the other KV cache groups, the hits their layers read: a
    sliding group's window before the first uncached token, a full group's every block."""

    def __init__(self, blocks: Sequence[KVBlock], groups: list[list[KVBlock]]) -> None:
        super().__init__(blocks)
        self.groups = groups


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None,
                 group_windows: Sequence[int | None] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        windows = tuple(group_windows) if group_windows else (sliding_window,)
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"sliding_window must be at least 1, got {windows}")
        self.block_size = block_size
        # per KV cache group (``kv_groups.py``): its layers' window, None for full attention
        self.windows = windows
        self.num_groups = len(windows)
        # the window of every layer (None: some layer attends to all positions)
        self.sliding_window = windows[0] if self.num_groups == 1 else None
        self.frees_blocks = any(w is not None for w in windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.num_groups)
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        # per group: request -> its block table; all of one request's tables have one length
        self.group_tables: list[dict[str, list[KVBlock]]] = [{} for _ in windows]
        self.tables = self.group_tables[0]
        # blocks a request holds outside any block table (KV transfer, ``hold_table``)
        self.holds: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading table blocks already offered to the cache
        self._unwritten: list[KVBlock] = []  # hashed ahead by the step in flight
        self.rows: dict[str, int] = {}  # one row per request, the same in every group
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.group_arrays = [np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32)
                             for _ in windows]
        self.block_table_array = self.group_arrays[0]
        # per group, per table row: leading FREED entries
        self.group_freed = [np.zeros(max_num_seqs, np.int64) for _ in windows]
        self.num_freed = self.group_freed[0]

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
        """The pool blocks the request holds now, every group (tables less freed entries)."""
        return sum(self.num_blocks_held_by_group(req_id))

    def num_blocks_held_by_group(self, req_id: str) -> list[int]:
        row = self.rows.get(req_id)
        if row is None:
            return [0] * self.num_groups
        return [len(tables[req_id]) - int(freed[row])
                for tables, freed in zip(self.group_tables, self.group_freed, strict=True)]

    def blocks_held_by_group(self) -> list[int]:
        """Pool blocks every running request holds, per group (the KV accounting: how much a
        windowed group holds against a full one)."""
        rows = list(self.rows.values())
        return [sum(len(t) for t in tables.values()) - int(freed[rows].sum())
                for tables, freed in zip(self.group_tables, self.group_freed, strict=True)]

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """The table's block ids; a freed entry is -1."""
        return [b.block_id for b in self.group_tables[group].get(req_id, [])]

    # -- prefix cache -------------------------------------------------------------------
    def find_cached_prefix(self, seq: KVSequence) -> list[KVBlock]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never
        served from cache: the step that computes it produces the next token's logits.

        Several groups: a prefix of ``k`` blocks is a hit only if every group has what its
        layers read at position ``k * block_size``: a full group all ``k`` blocks, a sliding
        group the blocks its window reaches (vLLM's rule too). The longest such ``k`` at or
        below group 0's chain wins; the answer is a ``PrefixHits``."""
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
        if self.num_groups == 1:
            return hits
        return self._hits_in_every_group(seq.block_hashes, hits)

    def _hits_in_every_group(self, hashes: list[int], hits: list[KVBlock]) -> PrefixHits:
        k = len(hits)
        while k > 0:
            groups: list[list[KVBlock]] = []
            for g in range(1, self.num_groups):
                cached = self.pool.group_cached[g]
                lo = self._dead_blocks(self.windows[g], k * self.block_size)
                found = [cached.get(h) for h in hashes[lo:k]]
                missing = [i for i, b in enumerate(found) if b is None]
                if missing:  # no k' above the last miss can work: its window still holds it
                    k = lo + missing[-1]
                    break
                groups.append(found)  # type: ignore[arg-type]  # no None: checked above
            else:
                return PrefixHits(hits[:k], groups)
        return PrefixHits([], [[] for _ in range(1, self.num_groups)])

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
        """Offer the blocks whose KV is now complete to the prefix cache (every group)."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        done = self._num_hashed.get(seq.req_id)
        if done is None or full <= done:
            return
        self._ensure_hashes(seq, full)
        parent = seq.block_hashes[done - 1] if done else None
        size = self.block_size
        tokens = seq.all_token_ids[done * size:full * size] if self.pool.record_events else ()
        hashes = seq.block_hashes[done:full]
        for g, tables in enumerate(self.group_tables):
            blocks = tables[seq.req_id][done:full]
            if g and any(b is FREED for b in blocks):  # not expected: never hash FREED
                continue
            self.pool.cache_blocks(blocks, hashes, parent, size, tokens,
                                   getattr(seq, "lora_name", None), g)
        self._num_hashed[seq.req_id] = full

    def cache_blocks_ahead(self, seqs: Sequence[KVSequence], num_tokens: Sequence[int]
                           ) -> None:
        """Rows being scheduled: the blocks that are full once the step computes
        ``num_tokens[i]`` of ``seqs[i]`` become shareable now (see the module docstring), and
        are recorded as unwritten until the step has run. The common case, a decode whose
        token fills one block, hashes just that block."""
        if not self.enable_prefix_caching:
            return
        size, num_hashed, pool = self.block_size, self._num_hashed, self.pool
        tables, group_tables = self.tables, self.group_tables[1:]  # group 0, the others
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
                lora_name = getattr(seq, "lora_name", None)
                pool.cache_block(table[done], block_hash, parent if done else None, size,
                                 tokens, lora_name)
                for g, other in enumerate(group_tables, 1):
                    pool.cache_block(other[seq.req_id][done], block_hash, parent if done
                                     else None, size, tokens, lora_name, g)
                num_hashed[seq.req_id] = full
            else:
                self.cache_full_blocks(seq, total)
            unwritten.extend(table[done:full])
            for other in group_tables:
                unwritten.extend(other[seq.req_id][done:full])

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
        (admission only; with several groups a ``PrefixHits``) become the head of the
        tables. False, with nothing changed, when the pool cannot cover it."""
        req_id = seq.req_id
        table = self.tables.get(req_id)
        hits = cached_blocks or []
        if hits and table:
            raise ValueError(f"cached blocks offered to {req_id!r}, which already holds blocks")
        have = len(table) if table is not None else 0
        total_tokens = num_computed_tokens + num_new_tokens
        if cdiv(total_tokens, self.block_size) > self.max_blocks_per_seq:
            raise ValueError(f"{req_id!r}: {total_tokens} tokens exceed max_model_len")
        group_hits = self._group_hits(req_id, num_computed_tokens, hits, table is None)
        # per group: leading hits no window reaches are not taken (FREED in the table): a
        # long cached prefix then needs only the window's blocks, like a running request
        total_blocks = cdiv(total_tokens, self.block_size)
        needed = [max(total_blocks - have - dead - len(taken), 0) for dead, taken in group_hits]
        # hits sitting in the free list leave it, so they cannot also be allocated fresh
        hits_in_free_list = sum(1 for _, taken in group_hits for b in taken if b.ref_cnt == 0)
        if sum(needed) > self.pool.free_list.num_free - hits_in_free_list:
            return False
        if table is None:
            if not self._free_rows:
                return False
            row_id = self.rows[req_id] = self._free_rows.pop()
            for g, (dead, _) in enumerate(group_hits):
                self.group_tables[g][req_id] = [FREED] * dead
                self.group_freed[g][row_id] = dead
            self._num_hashed[req_id] = group_hits[0][0] + len(group_hits[0][1])
        if not hits and not any(needed):
            return True
        row_id = self.rows[req_id]
        for g, (_, taken) in enumerate(group_hits):
            self.pool.touch(taken)
            table = self.group_tables[g][req_id]
            start = len(table)  # after any FREED entries (0 in the array already)
            table.extend(taken)
            table.extend(self.pool.allocate(needed[g]))
            row = self.group_arrays[g][row_id]
            if len(table) == start + 1:  # the common case: one new block (a scalar store)
                row[start] = table[start].block_id
            else:
                row[start:len(table)] = [b.block_id for b in table[start:]]
        return True

    def _group_hits(self, req_id: str, num_computed: int, hits: list[KVBlock], new: bool
                    ) -> list[tuple[int, list[KVBlock]]]:
        """Per group: the leading entries left FREED and the hit blocks taken after them."""
        if not new:
            return [(0, [])] * self.num_groups
        dead = min(self._dead_blocks(self.windows[0], num_computed), len(hits))
        out = [(dead, list(hits[dead:]))]
        if self.num_groups == 1:
            return out
        others = getattr(hits, "groups", None)
        if hits and others is None:
            raise ValueError(f"{req_id!r}: cached blocks of group 0 only, for a model with "
                             f"{self.num_groups} KV cache groups")
        for g in range(1, self.num_groups):
            taken = others[g - 1] if others is not None else []
            out.append((len(hits) - len(taken), list(taken)))
        return out

    def extend_tables(self, req_ids: Sequence[str], num_tokens: Sequence[int]) -> bool:
        """Grow the tables of requests that hold blocks to cover ``num_tokens[i]`` tokens
        each, all or nothing (False, nothing changed, when the pool cannot cover them all):
        the running rows' one call per step instead of ``allocate_slots`` per row. Every
        group's table grows by the same count (they cover the same positions)."""
        size, tables, max_blocks = self.block_size, self.tables, self.max_blocks_per_seq
        growth = []
        for req_id, total in zip(req_ids, num_tokens, strict=True):
            table = tables[req_id]
            needed = cdiv(total, size) - len(table)
            if needed > 0:
                if len(table) + needed > max_blocks:
                    raise ValueError(f"{req_id!r}: {total} tokens exceed max_model_len")
                growth.append((req_id, table, needed))
        total = sum(n for *_, n in growth) * self.num_groups
        if total > self.pool.free_list.num_free:
            return False
        rows = self.rows
        blocks = self.pool.allocate(total)
        at = 0
        for g, (group_tables, array) in enumerate(zip(self.group_tables, self.group_arrays,
                                                      strict=True)):
            for req_id, table, needed in growth:
                if g:
                    table = group_tables[req_id]
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
        row ``rows[i]``): give back, in every windowed group, the leading blocks its layers
        never read again, and return how many went back. The next token computed sits at
        position ``num_computed``; its window starts at ``num_computed - W + 1`` and later
        tokens' windows start later, so block ``b`` is dead once
        ``(b + 1) * block_size <= num_computed - W + 1``. Those blocks are complete (their
        tokens are computed), so they were offered to the prefix cache already."""
        if not self.frees_blocks or not len(req_ids):
            return 0
        freed = 0
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            dead = np.maximum(num_computed - (window - 1), 0) // self.block_size
            for i in np.flatnonzero(dead > self.group_freed[g][rows]).tolist():
                freed += self._free_leading(g, req_ids[i], int(rows[i]), int(dead[i]))
        return freed

    def _dead_blocks(self, window: int | None, num_computed: int) -> int:
        """Leading blocks no window reaches once ``num_computed`` tokens are computed."""
        return 0 if window is None else max(num_computed - (window - 1), 0) // self.block_size

    def _free_leading(self, group: int, req_id: str, row: int, count: int) -> int:
        table = self.group_tables[group][req_id]
        freed = self.group_freed[group]
        start = int(freed[row])
        count = min(count, len(table))
        if self._num_hashed[req_id] < count:  # never offered (not expected): the cache skips
            self._num_hashed[req_id] = count  # them, so FREED itself is never hashed
        gone = table[start:count]
        table[start:count] = [FREED] * len(gone)
        self.pool.free(reversed(gone))  # the later block first: the head is more shareable
        self.group_arrays[group][row, start:count] = 0
        freed[row] = count
        return len(gone)

    def free(self, req_id: str) -> None:
        """Release a request's blocks, tail first (its tail is the least shareable)."""
        if req_id not in self.tables:
            return
        row = self.rows.pop(req_id)
        for tables, array, freed in zip(self.group_tables, self.group_arrays,
                                        self.group_freed, strict=True):
            table = tables.pop(req_id)
            self.pool.free(reversed(table[int(freed[row]):]))
            array[row, :len(table)] = 0
            freed[row] = 0
        del self._num_hashed[req_id]
        self._free_rows.append(row)

    # -- holds: blocks kept for a KV transfer, outside any block table ------------------
    def hold_table(self, req_id: str, keep: int) -> list[KVBlock]:
        """A finishing request (``free`` otherwise): its first ``keep`` blocks stay held under
        its id for a remote engine to pull; the rest are freed. Returns the held blocks."""
        table = self.tables.get(req_id)
        if (table is None or keep <= 0 or any(b is FREED for b in table[:keep])
                or self.num_groups > 1):
            # nothing to offer (a sliding window freed its head; several groups' blocks do
            # not travel: the engine refuses KV transfer for such models)
            self.free(req_id)
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
        if self.num_groups > 1:
            raise ValueError("KV transfer holds one KV cache group's blocks; this model has "
                             f"{self.num_groups}")
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
        refs = Counter(b.block_id for tables in (*self.group_tables, self.holds)
                       for table in tables.values() for b in table if b is not FREED)
        if self.num_groups > 1 and self.holds:
            raise KVInvariantError("KV transfer holds with several KV cache groups")
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
            if (block.block_hash is not None
                    and pool.group_cached[block.group].get(block.block_hash) is not block):
                raise KVInvariantError(f"{block}: hash not mapped to it")
        for group, cached in enumerate(pool.group_cached):
            for block_hash, block in cached.items():
                if block.block_hash != block_hash or block.group != group:
                    raise KVInvariantError(f"{block}: hash map entry {block_hash} of group "
                                           f"{group}")
        if set(self.rows) != set(self.tables):
            raise KVInvariantError("block-table rows disagree with tables")
        for g, (tables, array, num_freed) in enumerate(zip(
                self.group_tables, self.group_arrays, self.group_freed, strict=True)):
            if set(tables) != set(self.tables):
                raise KVInvariantError(f"group {g} has tables of other requests")
            for req_id, table in tables.items():
                if len(table) != len(self.tables[req_id]):
                    raise KVInvariantError(f"{req_id}: group {g}'s table covers other "
                                           "positions than group 0's")
                freed = int(num_freed[self.rows[req_id]])
                if any(b is FREED for b in table[freed:]) or any(b is not FREED
                                                                  for b in table[:freed]):
                    raise KVInvariantError(f"{req_id}: freed entries are not its leading "
                                           f"{freed}")
                if freed and self.windows[g] is None:
                    raise KVInvariantError(f"{req_id}: blocks freed without a sliding window")
                row = array[self.rows[req_id]]
                if (row[:len(table)].tolist() != [0 if b is FREED else b.block_id
                                                  for b in table]
                        or row[len(table):].any()):
                    raise KVInvariantError(f"{req_id}: block-table row is stale")
            if num_freed[self._free_rows].any():
                raise KVInvariantError("a free block-table row counts freed entries")
        if not self.tables and not self.holds and pool.num_free != pool.num_blocks:
            raise KVInvariantError(f"{pool.num_blocks - pool.num_free} blocks leaked with no "
                                   "request")
