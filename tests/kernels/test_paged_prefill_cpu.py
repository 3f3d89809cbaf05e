"""The native CPU prefill kernel, and the ``cpu`` backend's use of it.

The kernel is compared with the plain reference (``shoal.kernels.reference``) on random
paged batches: chunks with and without a cached prefix, pages in random order and shared,
GQA groups that do and do not divide a 16-row tile, block sizes that are not multiples of
16, sliding windows.
"""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.attention.cpu_backend import CpuAttentionBackend
from shoal.runtime.attention.torch_backend import TorchAttentionBackend

from shoal.kernels import paged_prefill_cpu
from shoal.kernels.reference import paged_attention_ref


def _spans(batch) -> torch.Tensor:
    """Every request of the batch as one span (first row, query tokens, table row, seq_len)."""
    starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    return paged_prefill_cpu.prefill_spans_tensor(
        [(starts[r], starts[r + 1] - starts[r], r, seq_lens[r]) for r in range(len(seq_lens))])


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (8, 4, 64, 16),  # the bench model's shape
    (4, 4, 32, 5),  # no GQA; pages of 5 tokens
    (16, 2, 16, 16),  # groups of 8: two tokens per tile
    (12, 4, 128, 7),  # groups of 3: tiles cut through a token's heads
])
@pytest.mark.parametrize("window", [None, 9])
def test_kernel_matches_the_reference_on_random_paged_prefills(
        rng, paged_batch, num_heads, num_kv_heads, head_dim, block_size, window):
    # (cached prefix, chunk): whole prompts, chunks after a prefix, one-token spans
    requests = [(0, 37), (0, 1), (30, 16), (3 * block_size, 50), (5, 3), (0, 130), (64, 1)]
    batch = paged_batch(rng, requests, block_size, num_kv_heads, head_dim,
                        shared_prefix_blocks=1)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=rng)
    out = torch.full_like(q, float("nan"))

    paged_prefill_cpu.paged_prefill_attention(q, out, batch.k_cache, batch.v_cache,
                                              batch.block_tables, _spans(batch), 0.3, window)

    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.3, window)
    # float32 sums over up to ~180 keys x 128 dims and a vector expf: with a fresh seed each run,
    # 1e-5 was missed by one element in 365k (1.6e-5); 5e-5 still catches any wrong key or mask
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=5e-5)


def test_kernel_writes_only_the_spans_rows(rng, paged_batch):
    batch = paged_batch(rng, [(0, 20), (9, 1), (16, 12)], 16, 2, 16)
    q = torch.randn(batch.num_tokens, 4, 16, generator=rng)
    out = torch.zeros_like(q)
    spans = _spans(batch)[[0, 2]].contiguous()  # not the one-token request in between

    paged_prefill_cpu.paged_prefill_attention(q, out, batch.k_cache, batch.v_cache,
                                              batch.block_tables, spans, 0.25)

    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.25)
    torch.testing.assert_close(out[:20], expected[:20], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(out[21:], expected[21:], rtol=1e-4, atol=5e-5)
    assert out[20].abs().sum() == 0


def test_kernel_reads_q_as_a_view_into_wider_qkv_rows(rng, paged_batch, q_in_qkv_rows):
    batch = paged_batch(rng, [(0, 40), (16, 20)], 16, 2, 64)
    q = torch.randn(batch.num_tokens, 4, 64, generator=rng)
    q_view = q_in_qkv_rows(q, 2, rng)
    out_view, out = torch.empty_like(q), torch.empty_like(q)
    for query, result in ((q_view, out_view), (q, out)):
        paged_prefill_cpu.paged_prefill_attention(query, result, batch.k_cache, batch.v_cache,
                                                  batch.block_tables, _spans(batch), 0.125)
    assert torch.equal(out_view, out)


def test_kernel_refuses_what_it_cannot_compute(rng, paged_batch):
    batch = paged_batch(rng, [(0, 5)], 4, 1, 24)
    q = torch.randn(batch.num_tokens, 2, 24, generator=rng)
    assert not paged_prefill_cpu.supports_head_dim(24)
    with pytest.raises(ValueError, match="head_dim 24 is not a multiple of 16"):
        paged_prefill_cpu.paged_prefill_attention(q, q.clone(), batch.k_cache, batch.v_cache,
                                                  batch.block_tables, _spans(batch), 1.0)
    batch = paged_batch(rng, [(0, 5)], 4, 1, 16)
    q = torch.randn(batch.num_tokens, 2, 16, generator=rng)
    with pytest.raises(ValueError, match=r"spans must be \[count, 4\]"):
        paged_prefill_cpu.paged_prefill_attention(q, q.clone(), batch.k_cache, batch.v_cache,
                                                  batch.block_tables, _spans(batch)[:, :3], 1.0)
    with pytest.raises(ValueError, match="q must be a 3-d torch.float32"):
        paged_prefill_cpu.paged_prefill_attention(q.double(), q.double(), batch.k_cache,
                                                  batch.v_cache, batch.block_tables,
                                                  _spans(batch), 1.0)


@pytest.mark.parametrize("head_dim", [32, 24])  # the native prefill kernel; SDPA for 24
def test_cpu_backend_equals_the_torch_backend_on_prefill_chunks(rng, paged_batch, head_dim):
    batch = paged_batch(rng, [(0, 33), (30, 1), (20, 17), (3, 1)], 8, 2, head_dim,
                        shared_prefix_blocks=1)
    tokens = batch.num_tokens
    q = torch.randn(tokens, 4, head_dim, generator=rng)
    k = torch.randn(tokens, 2, head_dim, generator=rng)
    v = torch.randn(tokens, 2, head_dim, generator=rng)
    outputs = []
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        meta = backend.build_metadata(batch.metadata())
        outputs.append(backend.forward(q, k, v, batch.k_cache.clone(), batch.v_cache.clone(),
                                       meta, 0.2))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize(("head_dim", "kernel_here", "native"),
                         [(32, True, True), (24, True, False), (32, False, False)])
def test_cpu_backend_sends_prefill_chunks_to_the_native_kernel_where_it_applies(
        rng, paged_batch, monkeypatch, head_dim, kernel_here, native):
    """Native for head sizes it takes on a CPU whose registers hold its tiles (AVX-512:
    ``PREFILL_KERNEL_HERE``, set here both ways: the kernel runs on AVX2 too, only slowly),
    else SDPA."""
    import shoal.runtime.attention.cpu_backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "PREFILL_KERNEL_HERE", kernel_here)
    calls: list[str] = []
    native_call = cpu_backend.paged_prefill_cpu.paged_prefill_attention
    sdpa_call = cpu_backend.attend_prefills
    monkeypatch.setattr(cpu_backend.paged_prefill_cpu, "paged_prefill_attention",
                        lambda *a, **k: calls.append("native") or native_call(*a, **k))
    monkeypatch.setattr(cpu_backend, "attend_prefills",
                        lambda *a, **k: calls.append("sdpa") or sdpa_call(*a, **k))
    batch = paged_batch(rng, [(0, 9), (4, 1)], 8, 1, head_dim)
    q = torch.randn(batch.num_tokens, 2, head_dim, generator=rng)
    kv = torch.randn(batch.num_tokens, 1, head_dim, generator=rng)
    backend = CpuAttentionBackend()
    meta = backend.build_metadata(batch.metadata())
    backend.forward(q, kv, kv, batch.k_cache, batch.v_cache, meta, 0.2)
    assert calls == (["native"] if native else ["sdpa"])
