"""Flash-decoding: a decode batch's keys split over several programs per (request, kv head),
their partial softmaxes combined by a second kernel, equals the torch reference (under the
interpreter), including splits left empty by short contexts and sliding windows."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import paged_attention as pa
from shoal.kernels.reference import paged_attention_ref

LONG_DECODES = [(700, 1), (300, 1), (0, 1), (40, 1)]  # (cached context, one new token)


def _compare(batch, q, num_splits, window=None, rtol=1e-4, atol=1e-5):
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
                       batch.block_tables, 1, 0.3, sliding_window=window, out=out,
                       num_splits=num_splits)
    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.3, sliding_window=window)
    assert out.isfinite().all(), "a row was not combined"
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("num_splits,window", [(4, None), (3, 100)], ids=["4-splits", "window"])
def test_split_decode_matches_the_reference(rng, paged_batch, num_splits, window):
    # 700 keys in tiles of 16 with at least 256 keys a split: 3 splits walk keys, one walks none
    batch = paged_batch(rng, LONG_DECODES, 16, 2, 16)
    q = torch.randn(batch.num_tokens, 6, 16, generator=rng)  # GQA group 3, padded to 4
    _compare(batch, q, num_splits, window)


def test_many_small_splits_and_empty_ones(rng, paged_batch, monkeypatch):
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", 16)  # one key tile a split: 16 splits in play
    batch = paged_batch(rng, [(200, 1), (5, 1)], 8, 1, 8)
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng)
    _compare(batch, q, pa.MAX_SPLITS)


def test_split_decode_in_bfloat16(rng, paged_batch):
    batch = paged_batch(rng, [(520, 1), (17, 1)], 16, 1, 16, dtype=torch.bfloat16)
    q = torch.randn(batch.num_tokens, 2, 16, generator=rng).to(torch.bfloat16)
    _compare(batch, q, 2, rtol=2e-2, atol=2e-2)


def test_splits_are_refused_for_prefill_rows(rng, paged_batch):
    batch = paged_batch(rng, [(4, 3)], 4, 1, 8)
    q = torch.randn(batch.num_tokens, 1, 8, generator=rng)
    with pytest.raises(ValueError, match="num_splits"):
        pa.paged_attention(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                           batch.seq_lens, batch.block_tables, 3, 0.3, num_splits=2)


@pytest.mark.parametrize("query_len,reqs,kv_heads,sms,expected", [
    (1, 1, 8, 132, 16),   # batch 1 on an 8-kv-head model: 8 programs for 132 SMs
    (1, 4, 8, 132, 8),
    (1, 64, 8, 132, 1),   # enough programs already
    (2, 1, 8, 132, 1),    # prefill rows: never
    (1, 1, 8, 0, 1),      # not a CUDA device
])
def test_splits_are_chosen_from_the_batch_shape(query_len, reqs, kv_heads, sms, expected):
    assert pa.choose_splits(query_len, reqs, kv_heads, sms) == expected
