"""The triton backend behind the runtime's attention interface, and flashinfer's page table."""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.attention.flashinfer_backend import paged_kv_csr
from shoal.runtime.attention.triton_backend import TritonAttentionBackend

from shoal.kernels.reference import paged_attention_ref, reshape_and_cache_ref


def test_triton_backend_writes_kv_then_attends_like_the_reference(rng, paged_batch):
    batch = paged_batch(rng, [(6, 4), (0, 9), (17, 1)], 4, 2, 8, shared_prefix_blocks=1)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    q = torch.randn(batch.num_tokens, 4, 8, generator=rng)
    k = torch.randn(batch.num_tokens, 2, 8, generator=rng)
    v = torch.randn(batch.num_tokens, 2, 8, generator=rng)
    backend = TritonAttentionBackend()

    meta = backend.build_metadata(batch.metadata())
    out = backend.forward(q, k, v, batch.k_cache, batch.v_cache, meta, scale=0.3, sliding_window=5)

    reshape_and_cache_ref(k, v, k_ref, v_ref, batch.slot_mapping)
    expected = paged_attention_ref(q, k_ref, v_ref, batch.query_start_loc, batch.seq_lens,
                                   batch.block_tables, 0.3, sliding_window=5)
    torch.testing.assert_close(batch.k_cache, k_ref)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_flashinfer_page_table_is_the_csr_form_of_the_block_tables():
    block_tables = torch.tensor([[7, 3, 9, 0], [2, 0, 0, 0], [5, 6, 1, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 4, 13], dtype=torch.int32)

    csr = paged_kv_csr(block_tables, seq_lens, block_size=4)

    assert csr.kv_indptr.tolist() == [0, 3, 4, 8]
    assert csr.kv_indices.tolist() == [7, 3, 9, 2, 5, 6, 1, 8]
    assert csr.kv_last_page_len.tolist() == [1, 4, 1]  # 9 = 4+4+1, 4 = 4, 13 = 4+4+4+1


def test_flashinfer_page_table_rejects_tables_too_narrow_for_the_context():
    with pytest.raises(ValueError, match="columns"):
        paged_kv_csr(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9]), block_size=4)
