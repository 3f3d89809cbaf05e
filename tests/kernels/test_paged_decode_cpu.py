"""The native CPU decode kernel and the ``cpu`` attention backend built on it.

The kernel is compared with the plain reference (``shoal.kernels.reference``) on random
paged batches: pages in random order, shared prefix pages, GQA groups, sliding windows,
block size 1. The backend is compared with the torch reference backend on mixed steps.
"""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.attention.backend_choice import choose_attention_backend
from shoal.runtime.attention.cpu_backend import CpuAttentionBackend
from shoal.runtime.attention.selector import get_attention_backend
from shoal.runtime.attention.torch_backend import TorchAttentionBackend

from shoal.kernels import paged_decode_cpu
from shoal.kernels.reference import paged_attention_ref


def _decode_inputs(batch, num_heads: int, head_dim: int, rng: torch.Generator):
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=rng)
    rows = torch.arange(len(batch.seq_lens), dtype=torch.long)
    return q, rows


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (8, 4, 64, 16), (4, 4, 32, 4), (8, 1, 128, 16), (6, 2, 16, 1), (5, 5, 32, 8),
])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_the_reference_on_random_paged_decodes(
        rng, paged_batch, num_heads, num_kv_heads, head_dim, block_size, window):
    requests = [(0, 1), (1, 1), (block_size - 1, 1), (3 * block_size, 1), (37, 1), (200, 1)]
    batch = paged_batch(rng, requests, block_size, num_kv_heads, head_dim,
                        shared_prefix_blocks=1)
    q, rows = _decode_inputs(batch, num_heads, head_dim, rng)
    out = torch.full_like(q, float("nan"))

    paged_decode_cpu.paged_decode_attention(q, out, batch.k_cache, batch.v_cache,
                                            batch.block_tables, rows, rows, batch.seq_lens,
                                            0.3, window)

    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.3, window)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=5e-5)


def test_kernel_writes_only_the_named_rows_through_the_named_table_rows(rng, paged_batch):
    batch = paged_batch(rng, [(20, 1), (9, 1), (40, 1)], 8, 2, 16)
    q = torch.randn(5, 4, 16, generator=rng)
    out = torch.zeros_like(q)
    q_rows, table_rows = torch.tensor([4, 1]), torch.tensor([2, 0])
    seq_lens = batch.seq_lens[table_rows].contiguous()

    paged_decode_cpu.paged_decode_attention(q, out, batch.k_cache, batch.v_cache,
                                            batch.block_tables, q_rows, table_rows, seq_lens, 0.25)

    for q_row, table_row in zip(q_rows.tolist(), table_rows.tolist(), strict=True):
        expected = paged_attention_ref(q[q_row:q_row + 1], batch.k_cache, batch.v_cache,
                                       torch.tensor([0, 1]), batch.seq_lens[table_row:table_row + 1],
                                       batch.block_tables[table_row:table_row + 1], 0.25)
        torch.testing.assert_close(out[q_row:q_row + 1], expected, rtol=1e-4, atol=5e-5)
    assert out[[0, 2, 3]].abs().sum() == 0  # rows not named are untouched


def test_kernel_reads_q_as_a_view_into_wider_qkv_rows(rng, paged_batch, q_in_qkv_rows):
    batch = paged_batch(rng, [(40, 1), (7, 1), (16, 1)], 16, 2, 64)
    q, rows = _decode_inputs(batch, 4, 64, rng)
    q_view = q_in_qkv_rows(q, 2, rng)
    out_view, out = torch.empty_like(q), torch.empty_like(q)
    for query, result in ((q_view, out_view), (q, out)):
        paged_decode_cpu.paged_decode_attention(query, result, batch.k_cache, batch.v_cache,
                                                batch.block_tables, rows, rows, batch.seq_lens,
                                                0.125)
    assert torch.equal(out_view, out)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        paged_decode_cpu.paged_decode_attention(q.transpose(0, 1).contiguous().transpose(0, 1),
                                                out, batch.k_cache, batch.v_cache,
                                                batch.block_tables, rows, rows, batch.seq_lens,
                                                0.125)


def test_kernel_refuses_tensors_it_cannot_read(rng, paged_batch):
    batch = paged_batch(rng, [(3, 1)], 4, 1, 8)
    q, rows = _decode_inputs(batch, 2, 8, rng)
    with pytest.raises(ValueError, match="q must be a 3-d torch.float32"):
        paged_decode_cpu.paged_decode_attention(q.double(), q.double(), batch.k_cache,
                                                batch.v_cache, batch.block_tables, rows, rows,
                                                batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        paged_decode_cpu.paged_decode_attention(q, q.clone(), batch.k_cache.repeat(1, 1, 1, 2)[..., ::2],
                                                batch.v_cache, batch.block_tables, rows, rows,
                                                batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="one entry per request"):
        paged_decode_cpu.paged_decode_attention(q, q.clone(), batch.k_cache, batch.v_cache,
                                                batch.block_tables, rows, rows[:0],
                                                batch.seq_lens, 1.0)



@pytest.mark.parametrize("requests", [
    [(30, 1), (0, 7), (12, 5), (3, 1), (64, 1)],  # decodes mixed with prefill chunks
    [(30, 1), (3, 1), (64, 1)],  # a pure decode step
])
@pytest.mark.parametrize("window", [None, 6])
def test_cpu_backend_equals_the_torch_backend_on_a_step(rng, paged_batch, requests, window):
    batch = paged_batch(rng, requests, 4, 2, 16, shared_prefix_blocks=1)
    q = torch.randn(batch.num_tokens, 4, 16, generator=rng)
    k = torch.randn(batch.num_tokens, 2, 16, generator=rng)
    v = torch.randn(batch.num_tokens, 2, 16, generator=rng)
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    outputs = []
    for backend, (k_cache, v_cache) in zip((CpuAttentionBackend(), TorchAttentionBackend()),
                                           caches, strict=True):
        meta = backend.build_metadata(batch.metadata())
        outputs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 0.25, window))
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=5e-5)


def test_auto_picks_the_native_kernel_on_cpu():
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "cpu"
    assert get_attention_backend("torch", cpu).name == "torch"
    # bfloat16 and float8 caches: tests/kernels/test_cpu_attention_narrow_kv.py


def test_the_rule_falls_back_to_torch_when_the_kernel_cannot_build():
    reason = "no C compiler ('cc' not on PATH; set CC)"
    assert choose_attention_backend("auto", "cpu", False, False, cpu_kernel=reason) == "torch"
    assert choose_attention_backend("auto", "cpu", False, False, cpu_kernel=None) == "cpu"
    with pytest.raises(ValueError, match="unavailable: no C compiler"):
        choose_attention_backend("cpu", "cpu", False, False, cpu_kernel=reason)
    with pytest.raises(ValueError, match="runs on CPU, not cuda"):
        choose_attention_backend("cpu", "cuda", False, True, cpu_kernel=None)
