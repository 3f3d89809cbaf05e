"""Attention sinks (gpt-oss) and logit softcaps (Gemma 2) in every attention path the engine
can run, each against the plain torch reference (``shoal/kernels/reference.py``, which writes the
sink as one more softmax column and drops it): the Triton kernel under the interpreter
(mixed batches, windows, split decode), the torch backend and the native CPU backend (its
decode kernel's vector and scalar paths and its prefill kernel), over the model's cache and
over a float8 one (the reference then reads what the float8 cache holds).

The sinks are drawn large enough (around the scores' own scale) that a kernel ignoring them
fails: the reference without them is checked to differ.
"""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.paged_attention import paged_attention
from shoal.kernels.reference import paged_attention_ref

MIXED = [(0, 7), (9, 1), (4, 5), (13, 1), (0, 1), (6, 3)]  # (cached context, new queries)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _sinks(rng: torch.Generator) -> torch.Tensor:
    return torch.randn(HEADS, generator=rng) + 1.0


def _reference(batch, q, scale, **features):
    return paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                               batch.seq_lens, batch.block_tables, scale, **features)


@pytest.mark.parametrize("window,softcap,with_sinks", [
    (None, None, True), (5, None, True), (None, 2.0, False), (6, 1.5, True)],
    ids=["sinks", "sinks-window", "softcap", "all"])
def test_triton_kernel_matches_the_reference(rng, paged_batch, window, softcap, with_sinks):
    batch = paged_batch(rng, MIXED, 4, KV_HEADS, HEAD_DIM)
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, generator=rng) * 2
    sinks = _sinks(rng) if with_sinks else None
    out = torch.full_like(q, float("nan"))

    paged_attention(q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
                    batch.block_tables, batch.max_query_len, 0.5, sliding_window=window,
                    out=out, softcap=softcap, sinks=sinks)

    expected = _reference(batch, q, 0.5, sliding_window=window, softcap=softcap, sinks=sinks)
    plain = _reference(batch, q, 0.5, sliding_window=window)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the features matter here
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_decode_counts_each_sink_once(rng, paged_batch, num_splits):
    batch = paged_batch(rng, [(40, 1), (3, 1), (70, 1)], 8, KV_HEADS, HEAD_DIM)
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, generator=rng)
    sinks = _sinks(rng)
    out = torch.full_like(q, float("nan"))

    paged_attention(q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
                    batch.block_tables, 1, 0.5, out=out, num_splits=num_splits,
                    softcap=3.0, sinks=sinks)

    torch.testing.assert_close(out, _reference(batch, q, 0.5, softcap=3.0, sinks=sinks),
                               rtol=1e-4, atol=1e-5)


def test_sinks_of_the_wrong_shape_are_refused(rng, paged_batch):
    batch = paged_batch(rng, [(3, 1)], 4, KV_HEADS, HEAD_DIM)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=rng)
    with pytest.raises(ValueError, match="sinks must be float32"):
        paged_attention(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                        batch.seq_lens, batch.block_tables, 1, 0.5,
                        sinks=torch.zeros(HEADS + 1))


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("window,softcap,head_dim", [(None, None, 16), (5, 2.0, 16),
                                                    (5, None, 12)],
                         ids=["plain", "window", "scalar-path"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_backends_match_the_reference_with_sinks(rng, paged_batch, backend_name, window,
                                                 softcap, head_dim, kv_cache_dtype):
    """Through ``backend.forward`` as a layer calls it: the step's K/V written first, decode
    rows and prefill chunks (after a cached prefix) in one batch. Head size 12: the native
    decode kernel's scalar path, prefill through the torch code."""
    from shoal.runtime.attention.kv_cache_dtype import (
        attention_needs,
        dequantize,
        kv_cache_torch_dtype,
        quantize,
    )
    from shoal.runtime.attention.selector import get_attention_backend

    if backend_name == "cpu":
        from shoal.kernels.native_cpu import unavailable_reason

        if unavailable_reason() is not None:
            pytest.skip(f"native CPU kernels: {unavailable_reason()}")
    backend = get_attention_backend(backend_name, torch.device("cpu"),
                                    needs=frozenset({"sinks"}) | attention_needs(kv_cache_dtype))
    batch = paged_batch(rng, MIXED, 4, KV_HEADS, head_dim)
    meta = backend.build_metadata(batch.metadata())
    tokens = batch.num_tokens
    q = torch.randn(tokens, HEADS, head_dim, generator=rng) * 2
    k = torch.randn(tokens, KV_HEADS, head_dim, generator=rng)
    v = torch.randn(tokens, KV_HEADS, head_dim, generator=rng)
    sinks = _sinks(rng)
    if kv_cache_dtype == "auto":
        out = backend.forward(q, k, v, batch.k_cache, batch.v_cache, meta, 0.5, window,
                              softcap, sinks)
    else:  # the reference attends over what the float8 cache holds after the step's write
        cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, torch.float32)
        scales = torch.tensor([0.5, 0.25])  # k_scale, v_scale
        k_cache = quantize(batch.k_cache, scales[0], cache_dtype)
        v_cache = quantize(batch.v_cache, scales[1], cache_dtype)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.5, window, softcap, sinks,
                              scales)
        batch.k_cache = dequantize(k_cache, scales[0], torch.float32)
        batch.v_cache = dequantize(v_cache, scales[1], torch.float32)

    expected = _reference(batch, q, 0.5, sliding_window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
