"""Kernel tests run the Triton kernels on CPU through triton's interpreter.

triton decides interpreted vs compiled when ``@triton.jit`` runs, i.e. when shoal.kernels'
modules are first imported, so the variable is set here, before any test module imports
them. Shapes stay tiny: the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def rng() -> torch.Generator:
    """A generator with a fresh seed each run; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"kernel test seed: {seed}")
    generator = torch.Generator().manual_seed(seed)
    return generator


class PagedBatch:
    """A random flat mixed batch over a paged cache, laid out like the runtime's step plan."""

    def __init__(self, query_start_loc, seq_lens, block_tables, slot_mapping, k_cache, v_cache):
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.slot_mapping = slot_mapping
        self.k_cache = k_cache
        self.v_cache = v_cache

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())


def build_paged_batch(
    rng: torch.Generator,
    requests: list[tuple[int, int]],  # (context_len before this step, query_len)
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    shared_prefix_blocks: int = 0,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Blocks are handed out in random order; every request whose cached context covers them
    starts with the same ``shared_prefix_blocks`` blocks (prefix-cache hits share blocks)."""
    blocks_needed = [-(-(ctx + q) // block_size) for ctx, q in requests]
    sharers = [ctx >= shared_prefix_blocks * block_size for ctx, _ in requests]
    own = [n - (shared_prefix_blocks if s else 0) for n, s in zip(blocks_needed, sharers, strict=True)]
    num_blocks = shared_prefix_blocks + sum(own) + spare_blocks
    order = torch.randperm(num_blocks, generator=rng).tolist()
    shared, pool = order[:shared_prefix_blocks], order[shared_prefix_blocks:]
    max_blocks = max(blocks_needed) + 1  # one padding column, as the scheduler pads
    tables, slots, starts = [], [], [0]
    for (ctx, q_len), share, n_own in zip(requests, sharers, own, strict=True):
        table = (shared if share else []) + pool[:n_own]
        pool = pool[n_own:]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
        tables.append(table + [0] * (max_blocks - len(table)))
        starts.append(starts[-1] + q_len)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([ctx + q for ctx, q in requests], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        k_cache=torch.randn(shape, generator=rng).to(dtype),
        v_cache=torch.randn(shape, generator=rng).to(dtype),
    )


@pytest.fixture
def paged_batch():
    return build_paged_batch
