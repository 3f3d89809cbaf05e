"""The block pool: every KV block, its reference count, its hash, and the LRU free list.

A block with ``ref_cnt == 0`` is free and sits in a doubly linked free list. Freed blocks go
to the tail and allocation takes from the head, so the least recently freed block is reused
first. A freed block keeps its hash and stays findable through ``cached`` until it is
reallocated, which is when it is evicted. Every operation is O(1) per block.

A model with several KV cache groups (``kv_groups.py``) keeps one hash map per group: the
same prefix has a block in each group (different layers' K/V), found by the same hash. Only
group 0's blocks make KV events (the router's view of the cache is the full-attention
layers').
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.group = 0  # the KV cache group whose hash map finds it (``kv_groups.py``)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockList:
    """Doubly linked list with sentinels: append, pop from the head, and unlink from the
    middle (a cache hit on a free block) are all O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1
                 ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_list = FreeBlockList(self.blocks)
        # per KV cache group: block hash -> the block holding that KV (``cached``: group 0's)
        self.group_cached: list[dict[int, KVBlock]] = [{} for _ in range(max(num_groups, 1))]
        self.cached = self.group_cached[0]
        self.events: list[KVEvent] = []
        self.record_events = True

    @property
    def num_free(self) -> int:
        return self.free_list.num_free

    def usage(self) -> float:
        """Share of blocks referenced by some request (cached-but-free blocks are free)."""
        return 1.0 - self.free_list.num_free / self.num_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """``count`` fresh blocks with ref 1, or ValueError with nothing changed."""
        if count > self.free_list.num_free:
            raise ValueError(f"need {count} KV blocks, {self.free_list.num_free} free")
        blocks = []
        for _ in range(count):
            block = self.free_list.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_list.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass a sequence's blocks tail first so its tail is
        evicted before its (more shareable) head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_list.append(block)

    def cache_blocks(self, blocks: list[KVBlock], hashes: list[int], parent_hash: int | None,
                     block_size: int, token_ids: Sequence[int] = (),
                     lora_name: str | None = None, group: int = 0) -> None:
        """Make full blocks findable by hash (in ``group``'s map). A hash already held by
        another block (the same prefix computed twice) leaves this block unhashed: one block
        per hash. With events on, ``token_ids`` are the blocks' tokens (block_size each), and
        each run of newly stored blocks is one BlockStored with its own parent and tokens."""
        run: list[int] = []  # indices of the current run of stored blocks
        cached = self.group_cached[group]
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            if block.block_hash is not None or block_hash in cached:
                self._stored_event(run, hashes, parent_hash, block_size, token_ids, lora_name,
                                   group)
                run = []
                continue
            block.block_hash = block_hash
            block.group = group
            cached[block_hash] = block
            run.append(i)
        self._stored_event(run, hashes, parent_hash, block_size, token_ids, lora_name, group)

    def _stored_event(self, run: list[int], hashes: list[int], parent_hash: int | None,
                      block_size: int, token_ids: Sequence[int],
                      lora_name: str | None, group: int) -> None:
        if not run or not self.record_events or group:
            return
        first, last = run[0], run[-1] + 1
        parent = hashes[first - 1] if first else parent_hash
        self.events.append(BlockStored(hashes[first:last], parent,
                                       list(token_ids[first * block_size:last * block_size]),
                                       block_size, lora_name=lora_name))

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None,
                    block_size: int, token_ids: Sequence[int] = (),
                    lora_name: str | None = None, group: int = 0) -> None:
        """``cache_blocks`` for one block (a decode step fills one block per row)."""
        cached = self.group_cached[group]
        if block.block_hash is not None or block_hash in cached:
            return
        block.block_hash = block_hash
        block.group = group
        cached[block_hash] = block
        if self.record_events and not group:
            self.events.append(BlockStored([block_hash], parent_hash, list(token_ids),
                                           block_size, lora_name=lora_name))

    def uncache(self, block: KVBlock) -> None:
        """Make a block unfindable (its K/V is not what its hash says); no-op if unhashed."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        cached = self.group_cached[block.group]
        if cached.get(block_hash) is block:
            del cached[block_hash]
            if self.record_events and not block.group:
                self.events.append(BlockRemoved([block_hash]))
        block.block_hash = None
        block.group = 0

    def reset_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if self.free_list.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.group = 0
        for cached in self.group_cached:
            cached.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
