"""The warm-up's dummy step (runtime/worker/dummy_step.py): all the step's tokens, split on a
CPU into sequences no longer than the bound (and no more of them than a step may hold), laid
over the cache so that every token's slot is where its block table says."""

from __future__ import annotations

import numpy as np
import pytest
from shoal.runtime.worker.dummy_step import dummy_seq_lens, dummy_step_plan


@pytest.mark.parametrize("tokens, block, bound, max_seqs, want", [
    (2048, 16, None, 256, [2048]),  # GPU: one sequence, the memory profile's worst case
    (2048, 16, 256, 256, [256] * 8),
    (2048, 16, 256, 2, [1024, 1024]),  # --max-num-seqs 2: fewer, longer sequences
    (1000, 16, 256, 256, [256, 256, 256, 232]),
    (100, 16, 256, 256, [100]),
    (2048, 48, 256, 256, [288] * 7 + [32]),  # whole blocks: every start on a block boundary
    (64, 256, 16, 256, [64]),  # a block larger than the step
])
def test_the_tokens_are_split_into_bounded_sequences(tokens, block, bound, max_seqs, want):
    lens = dummy_seq_lens(tokens, block, bound, max_seqs)
    assert lens == want and sum(lens) == tokens and len(lens) <= max_seqs


@pytest.mark.parametrize("lens, block, num_blocks", [
    ([2048], 16, 512), ([256] * 8, 16, 512), ([256] * 8, 16, 20),  # 20 blocks: wraps around
    ([288] * 7 + [32], 48, 30), ([7], 4, 1),
])
def test_every_token_is_written_where_its_block_table_reads(lens, block, num_blocks):
    plan = dummy_step_plan(lens, block, num_blocks)
    assert plan.num_tokens == sum(lens) and plan.num_reqs == len(lens)
    assert plan.query_start_loc.tolist() == np.cumsum([0, *lens]).tolist()
    assert plan.sample_rows.all() and [n.req_id for n in plan.new_requests] == plan.req_ids
    for row, n in enumerate(lens):
        first = plan.query_start_loc[row]
        positions = plan.positions[first:first + n]
        assert positions.tolist() == list(range(n))
        table = plan.block_tables[row]
        read = table[positions // block] * block + positions % block
        assert read.tolist() == plan.slot_mapping[first:first + n].tolist()
    assert plan.block_tables.max() < num_blocks
