"""A sliding-window layer never reads a KV block outside its window, in every attention
backend selectable on CPU (torch, the native cpu kernels, triton under the interpreter):
blocks wholly before each request's window hold NaN, and decode rows and prefill chunks after
a cached prefix still equal the reference computed on the clean cache."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.reference import paged_attention_ref, reshape_and_cache_ref

WINDOW = 5
REQUESTS = [(30, 1), (17, 1), (21, 6), (12, 9), (0, 12)]  # (cached context, new tokens)


def _backend(name: str):
    if name == "torch":
        from shoal.runtime.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from shoal.runtime.attention.cpu_backend import CpuAttentionBackend

        from shoal.kernels.native_cpu import unavailable_reason

        if unavailable_reason() is not None:
            pytest.skip(f"native CPU kernels unavailable: {unavailable_reason()}")
        return CpuAttentionBackend()
    from shoal.runtime.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _inputs(rng, batch, heads, kv_heads, head_dim):
    return (torch.randn(batch.num_tokens, heads, head_dim, generator=rng),
            torch.randn(batch.num_tokens, kv_heads, head_dim, generator=rng),
            torch.randn(batch.num_tokens, kv_heads, head_dim, generator=rng))


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_blocks_before_the_window_are_never_read(name, rng, paged_batch):
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    batch = paged_batch(rng, REQUESTS, block_size, kv_heads, head_dim)
    q, k, v = _inputs(rng, batch, heads, kv_heads, head_dim)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    reshape_and_cache_ref(k, v, k_ref, v_ref, batch.slot_mapping)
    expected = paged_attention_ref(q, k_ref, v_ref, batch.query_start_loc, batch.seq_lens,
                                   batch.block_tables, 0.3, sliding_window=WINDOW)
    poisoned = 0
    for row, (cached, _) in enumerate(REQUESTS):
        first_needed = max(0, cached - WINDOW + 1)  # the step's first query's window start
        for j in range(first_needed // block_size):
            block = int(batch.block_tables[row, j])
            batch.k_cache[block], batch.v_cache[block] = float("nan"), float("nan")
            poisoned += 1
    assert poisoned >= 12

    backend = _backend(name)
    meta = backend.build_metadata(batch.metadata())
    out = backend.forward(q, k, v, batch.k_cache, batch.v_cache, meta, 0.3, WINDOW)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 48])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_the_native_cpu_kernels_softcap_like_the_torch_backend(head_dim, window, rng,
                                                               paged_batch):
    """Gemma 2's cap * tanh(s / cap) in the native decode (vector and scalar paths by head
    size) and prefill kernels, against the torch backend (itself tested against a float64
    reference in tests/model/test_torch_backend.py)."""
    batch = paged_batch(rng, REQUESTS, 4, 2, head_dim)
    q, k, v = _inputs(rng, batch, 4, 2, head_dim)
    q = q * 3  # scores large enough for the cap to bend them
    outs = {}
    for name in ("torch", "cpu"):
        backend = _backend(name)
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        meta = backend.build_metadata(batch.metadata())
        outs[name] = backend.forward(q, k, v, k_cache, v_cache, meta, 0.3, window, 1.5)
    uncapped = _backend("torch").forward(q, k, v, batch.k_cache.clone(), batch.v_cache.clone(),
                                         batch.metadata(), 0.3, window)
    assert not torch.allclose(uncapped, outs["torch"], atol=1e-3)  # the cap matters here
    torch.testing.assert_close(outs["cpu"], outs["torch"], rtol=1e-4, atol=1e-5)
