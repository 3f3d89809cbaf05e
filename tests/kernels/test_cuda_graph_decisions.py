"""CUDA-graph decisions (ladder, padding, eager fallbacks) and the padded decode batch.

Capture and replay need a GPU (bench/gpu exercises them); what a graph replays — the
static buffers after staging, padded rows included — is checked here on CPU through the
triton backend under the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.attention.triton_backend import TritonAttentionBackend
from shoal.runtime.worker.cuda_graphs import (
    DecodeGraphRunner,
    capture_sizes,
    graph_batch_size,
    padded_batch_size,
)

from shoal.kernels.reference import paged_attention_ref, reshape_and_cache_ref


def test_ladder_is_1_2_4_then_multiples_of_8_up_to_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the cap itself gets a graph
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_ladder_is_capped_for_huge_max_num_seqs():
    sizes = capture_sizes(1024, max_capture_size=512)
    assert sizes[-1] == 512 and len(sizes) == 3 + 64


def test_ladder_rejects_nonsense():
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize("n,expected", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (256, 256), (257, None)])
def test_batches_pad_up_to_the_next_captured_size(n, expected):
    assert padded_batch_size(n, capture_sizes(256)) == expected


def test_only_pure_decode_steps_within_the_ladder_replay_graphs():
    sizes = capture_sizes(64)
    assert graph_batch_size(5, 1, sizes, enforce_eager=False) == 8
    assert graph_batch_size(5, 7, sizes, enforce_eager=False) is None  # a prefill chunk rides along
    assert graph_batch_size(65, 1, sizes, enforce_eager=False) is None  # above the largest: eager
    assert graph_batch_size(5, 1, sizes, enforce_eager=True) is None
    assert graph_batch_size(0, 1, sizes, enforce_eager=False) is None


def test_staged_padded_decode_batch_attends_correctly_and_padding_writes_nothing(rng, paged_batch):
    batch = paged_batch(rng, [(5, 1), (12, 1), (0, 1)], 4, 2, 8)
    runner = DecodeGraphRunner([1, 2, 4, 8], max_blocks_per_seq=6, block_size=4,
                               max_model_len=24, device=torch.device("cpu"))
    # stale state from an earlier, larger step must not leak into the padded rows
    runner.slot_mapping.fill_(3)
    runner.seq_lens.fill_(9)
    size = runner.stage(torch.tensor([11, 12, 13]), batch.seq_lens.long() - 1, batch.seq_lens,
                        batch.block_tables, batch.slot_mapping)
    assert size == 4
    assert runner.slot_mapping[:4].tolist() == batch.slot_mapping.tolist() + [-1]
    assert runner.seq_lens[:4].tolist() == batch.seq_lens.tolist() + [1]
    assert runner.input_ids[:4].tolist() == [11, 12, 13, 0]

    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    q = torch.randn(size, 4, 8, generator=rng)
    k = torch.randn(size, 2, 8, generator=rng)
    v = torch.randn(size, 2, 8, generator=rng)
    backend = TritonAttentionBackend()
    out = backend.forward(q, k, v, batch.k_cache, batch.v_cache,
                          backend.build_metadata(runner.metadata(size)), scale=0.3)

    reshape_and_cache_ref(k[:3], v[:3], k_ref, v_ref, batch.slot_mapping)
    torch.testing.assert_close(batch.k_cache, k_ref, rtol=0, atol=0)  # the pad row wrote nothing
    expected = paged_attention_ref(q[:3], k_ref, v_ref, batch.query_start_loc, batch.seq_lens,
                                   batch.block_tables, 0.3)
    torch.testing.assert_close(out[:3], expected, rtol=1e-4, atol=1e-5)


def test_staging_refuses_batches_the_graphs_cannot_hold():
    runner = DecodeGraphRunner([1, 2], max_blocks_per_seq=2, block_size=4, max_model_len=8,
                               device=torch.device("cpu"))
    three = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="no captured size"):
        runner.stage(three, three, three.int(), torch.zeros(3, 2, dtype=torch.int32), three)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="width"):
        runner.stage(one, one, one.int(), torch.zeros(1, 5, dtype=torch.int32), one)


def test_only_pure_decode_steps_within_the_ladder_reach_a_graph(rng, paged_batch):
    from shoal.runtime.attention.backend import AttentionMetadata
    from shoal.runtime.worker.cuda_graphs import try_replay

    def meta_for(requests):
        batch = paged_batch(rng, requests, 4, 1, 8)
        starts = batch.query_start_loc.tolist()
        return AttentionMetadata(
            batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.slot_mapping,
            max(b - a for a, b in zip(starts, starts[1:], strict=False)), int(batch.seq_lens.max()), 4,
            starts, batch.seq_lens.tolist())

    runner = DecodeGraphRunner([1, 2], max_blocks_per_seq=8, block_size=4, max_model_len=32,
                               device=torch.device("cpu"))
    ids = torch.zeros(2, dtype=torch.int64)
    assert try_replay(None, ids, ids, meta_for([(3, 1), (5, 1)])) is None
    assert try_replay(runner, torch.zeros(4, dtype=torch.int64), ids, meta_for([(3, 3), (5, 1)])) is None
    three = torch.zeros(3, dtype=torch.int64)
    assert try_replay(runner, three, three, meta_for([(3, 1), (5, 1), (2, 1)])) is None  # above 2
    with pytest.raises(RuntimeError, match="not captured"):  # eligible: it would replay on CUDA
        try_replay(runner, ids, ids, meta_for([(3, 1), (5, 1)]))


def test_no_capture_off_cuda_with_enforce_eager_or_with_a_backend_that_does_host_work():
    from shoal.runtime.attention.torch_backend import TorchAttentionBackend
    from shoal.runtime.worker.cuda_graphs import capture_decode_graphs

    def never_called(*args):
        raise AssertionError("nothing may run when graphs are not captured")

    triton = TritonAttentionBackend()
    cuda = torch.device("cuda")
    common = dict(max_num_seqs=8, max_model_len=64, block_size=16)
    assert capture_decode_graphs(never_called, [], triton, torch.device("cpu"), enforce_eager=False,
                                 **common) is None
    assert capture_decode_graphs(never_called, [], triton, cuda, enforce_eager=True, **common) is None
    assert capture_decode_graphs(never_called, [], TorchAttentionBackend(), cuda, enforce_eager=False,
                                 **common) is None
    assert TritonAttentionBackend.cuda_graph_safe and not getattr(TorchAttentionBackend, "cuda_graph_safe", False)
