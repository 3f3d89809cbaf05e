"""Paged attention over a flat mixed batch matches the torch reference.

Every case poisons the output with NaN first, so a row the kernel forgets to write fails.
Batches mix decodes, fresh prefills and prefill chunks after a cached prefix, with ragged
lengths, random block order and prefix blocks shared between requests.
"""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import launch
from shoal.kernels.paged_attention import paged_attention
from shoal.kernels.reference import paged_attention_ref, reshape_and_cache_ref
from shoal.kernels.reshape_and_cache import reshape_and_cache

MIXED = [(0, 7), (9, 1), (4, 5), (13, 1), (0, 1), (6, 3)]  # (cached context, new queries)


def _run_both(batch, q, scale, window=None):
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.max_query_len, scale, sliding_window=window, out=out,
    )
    expected = paged_attention_ref(
        q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale, sliding_window=window,
    )
    return out, expected


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(4, 4, 8, 4), (4, 2, 16, 4), (6, 2, 12, 8), (8, 1, 8, 16)],
    ids=["mha", "gqa2", "gqa3-odd-dim", "mqa8-page16"],
)
def test_mixed_ragged_batch_matches_reference(rng, paged_batch, num_heads, num_kv_heads, head_dim, block_size):
    batch = paged_batch(rng, MIXED, block_size, num_kv_heads, head_dim)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=rng)

    out, expected = _run_both(batch, q, scale=head_dim**-0.5)

    assert out.isfinite().all(), "some query rows were never written"
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size,key_tile", [(12, 16), (32, 16), (5, 32)],
                         ids=["odd-pages-in-a-tile", "tile-inside-a-page", "tiny-pages"])
def test_key_tiles_and_pages_of_any_size(rng, paged_batch, block_size, key_tile):
    batch = paged_batch(rng, MIXED, block_size, 2, 8)
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng)
    out = torch.full_like(q, float("nan"))

    paged_attention(q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
                    batch.block_tables, batch.max_query_len, 0.35, sliding_window=7, out=out,
                    key_tile=key_tile)

    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.35, sliding_window=7)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_requests_sharing_prefix_blocks_read_the_same_pages(rng, paged_batch):
    requests = [(9, 1), (8, 4), (12, 2), (3, 2)]  # the last one is too short to share
    batch = paged_batch(rng, requests, 4, 2, 8, shared_prefix_blocks=2)
    assert torch.equal(batch.block_tables[0, :2], batch.block_tables[1, :2])
    assert torch.equal(batch.block_tables[0, :2], batch.block_tables[2, :2])
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng)

    out, expected = _run_both(batch, q, scale=0.35)

    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 6, 64])
def test_sliding_window_limits_each_query_to_its_last_keys(rng, paged_batch, window):
    batch = paged_batch(rng, MIXED, 4, 2, 8)
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng)

    out, expected = _run_both(batch, q, scale=0.35, window=window)

    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_pure_decode_batch(rng, paged_batch):
    batch = paged_batch(rng, [(5, 1), (16, 1), (0, 1), (31, 1)], 8, 2, 16)
    q = torch.randn(batch.num_tokens, 8, 16, generator=rng)

    out, expected = _run_both(batch, q, scale=0.25)

    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_long_prefill_spans_several_query_tiles(rng, paged_batch):
    """70 query rows need more than one tile, and the decode row rides in the same launch."""
    batch = paged_batch(rng, [(5, 70), (20, 1)], 16, 1, 8)
    q = torch.randn(batch.num_tokens, 2, 8, generator=rng)

    out, expected = _run_both(batch, q, scale=0.35)

    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cache(rng, paged_batch, dtype):
    batch = paged_batch(rng, MIXED, 4, 2, 8, dtype=dtype)
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng).to(dtype)

    out, expected = _run_both(batch, q, scale=0.35)

    assert out.dtype == dtype and out.isfinite().all()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_write_then_attend_sees_this_steps_tokens(rng, paged_batch):
    """The backend's per-layer sequence: new K/V into poisoned slots, then attention."""
    batch = paged_batch(rng, MIXED, 4, 2, 8)
    batch.k_cache.view(-1, 2, 8)[batch.slot_mapping] = float("nan")
    batch.v_cache.view(-1, 2, 8)[batch.slot_mapping] = float("nan")
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    new_k = torch.randn(batch.num_tokens, 2, 8, generator=rng)
    new_v = torch.randn(batch.num_tokens, 2, 8, generator=rng)
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng)

    reshape_and_cache(new_k, new_v, batch.k_cache, batch.v_cache, batch.slot_mapping)
    reshape_and_cache_ref(new_k, new_v, k_ref, v_ref, batch.slot_mapping)
    out = paged_attention(
        q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.max_query_len, 0.35,
    )
    expected = paged_attention_ref(
        q, k_ref, v_ref, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.35
    )

    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_bad_shapes_and_devices_are_rejected():
    q = torch.zeros(2, 3, 8)
    cache = torch.zeros(4, 4, 2, 8)
    meta = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q, cache, cache, *meta, 2, 1.0)
    with pytest.raises(ValueError, match="key_tile"):
        paged_attention(torch.zeros(2, 2, 8), cache, cache, *meta, 2, 1.0, key_tile=24)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(torch.zeros(2, 2, 8), cache, cache, *meta, 2, 1.0, sliding_window=0)


def test_cpu_tensors_without_the_interpreter_get_an_actionable_error(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        launch.check_launchable(torch.zeros(1))
