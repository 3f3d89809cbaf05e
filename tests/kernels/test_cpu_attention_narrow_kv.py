"""The native CPU attention kernels over a bfloat16 or float8 KV cache, and the ``cpu``
backend on a bfloat16 model.

The kernels widen each bfloat16 or float8 K/V element to float32 as they read it (a float8
byte through a table, times the layer's K or V scale) and compute in float32, so over a
narrow cache they must give what the plain reference gives over the same values held in
float32 (float32 tolerances); the float8 table must be torch's own cast for every byte. The
backend on a bfloat16 model is compared with the torch backend running the same step in
bfloat16 (bfloat16 tolerances: the torch backend computes in bfloat16, the native one in
float32), over a bfloat16 cache and over a float8 one, which both backends write alike.
"""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.attention.cpu_backend import CpuAttentionBackend
from shoal.runtime.attention.kv_cache_dtype import dequantize, quantize
from shoal.runtime.attention.selector import get_attention_backend
from shoal.runtime.attention.torch_backend import TorchAttentionBackend

from shoal.kernels import cpu_ops, paged_decode_cpu, paged_prefill_cpu
from shoal.kernels.reference import paged_attention_ref

# the narrow caches the kernels read; float8 with K and V scales that differ (values of
# size ~1 land across most of e4m3's exponents, a few among its subnormals)
CACHE_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
FP8_SCALES = torch.tensor([0.05, 0.02])


def _narrow_batch(paged_batch, rng, requests, block_size, num_kv_heads, head_dim,
                  cache_dtype=torch.bfloat16):
    """A paged batch whose float32 caches hold what a ``cache_dtype`` cache reads back, with
    the ``cache_dtype`` caches beside them and their scales (None for bfloat16)."""
    batch = paged_batch(rng, requests, block_size, num_kv_heads, head_dim,
                        shared_prefix_blocks=1)
    return (batch, *_narrow_caches(batch, cache_dtype))


def _narrow_caches(batch, cache_dtype):
    """The batch's caches in ``cache_dtype`` and their scales; the float32 caches are set to
    what those read back."""
    if cache_dtype == torch.bfloat16:
        k_narrow, v_narrow, scales = batch.k_cache.bfloat16(), batch.v_cache.bfloat16(), None
        batch.k_cache.copy_(k_narrow.float())
        batch.v_cache.copy_(v_narrow.float())
        return k_narrow, v_narrow, scales
    scales = FP8_SCALES.clone()
    k_narrow = quantize(batch.k_cache, scales[0], cache_dtype)
    v_narrow = quantize(batch.v_cache, scales[1], cache_dtype)
    batch.k_cache.copy_(dequantize(k_narrow, scales[0], torch.float32))
    batch.v_cache.copy_(dequantize(v_narrow, scales[1], torch.float32))
    return k_narrow, v_narrow, scales


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_table_is_torchs_cast_for_every_byte(cache_dtype):
    every_byte = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    for scale in (1.0, 0.37):
        expected = every_byte.float() * torch.tensor(scale)
        table = paged_decode_cpu.fp8_table(cache_dtype, scale)
        torch.testing.assert_close(table, expected, rtol=0, atol=0, equal_nan=True)
    assert paged_decode_cpu.fp8_table(cache_dtype)[1] > 0  # the smallest subnormal survives


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (8, 4, 64, 16), (16, 8, 128, 16), (9, 3, 64, 16), (6, 2, 24, 4),
])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decode_kernel_reads_a_narrow_cache_as_its_float32_values(
        rng, paged_batch, num_heads, num_kv_heads, head_dim, block_size, window, cache_dtype):
    requests = [(0, 1), (block_size - 1, 1), (3 * block_size, 1), (37, 1), (200, 1)]
    batch, k_narrow, v_narrow, scales = _narrow_batch(paged_batch, rng, requests, block_size,
                                            num_kv_heads, head_dim, cache_dtype)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=rng)
    rows = torch.arange(len(requests), dtype=torch.long)
    out = torch.full_like(q, float("nan"))

    paged_decode_cpu.paged_decode_attention(q, out, k_narrow, v_narrow, batch.block_tables, rows, rows,
                                            batch.seq_lens, 0.3, window, kv_scales=scales)

    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.3, window)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (8, 4, 64, 16), (16, 8, 128, 16), (9, 3, 64, 7),
])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_prefill_kernel_reads_a_narrow_cache_as_its_float32_values(
        rng, paged_batch, num_heads, num_kv_heads, head_dim, block_size, window, cache_dtype):
    requests = [(0, 37), (30, 16), (3 * block_size, 50), (0, 1)]
    batch, k_narrow, v_narrow, scales = _narrow_batch(paged_batch, rng, requests, block_size,
                                            num_kv_heads, head_dim, cache_dtype)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=rng)
    starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    spans = paged_prefill_cpu.prefill_spans_tensor(
        [(starts[r], starts[r + 1] - starts[r], r, seq_lens[r]) for r in range(len(requests))])
    out = torch.full_like(q, float("nan"))

    paged_prefill_cpu.paged_prefill_attention(q, out, k_narrow, v_narrow, batch.block_tables, spans,
                                              0.3, window, kv_scales=scales)

    expected = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                   batch.seq_lens, batch.block_tables, 0.3, window)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=5e-5)


def test_kernels_refuse_caches_of_two_types(rng, paged_batch):
    batch, k16, _, _ = _narrow_batch(paged_batch, rng, [(3, 1)], 4, 1, 16)
    q = torch.randn(1, 2, 16, generator=rng)
    rows = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="must both be of one of"):
        paged_decode_cpu.paged_decode_attention(q, q.clone(), k16, batch.v_cache,
                                                batch.block_tables, rows, rows,
                                                batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="must both be of one of"):
        paged_decode_cpu.paged_decode_attention(q, q.clone(), k16.half(), k16.half(),
                                                batch.block_tables, rows, rows,
                                                batch.seq_lens, 1.0)
    k8 = k16.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"kv_scales must be \(k_scale, v_scale\)"):
        paged_decode_cpu.paged_decode_attention(q, q.clone(), k8, k8, batch.block_tables,
                                                rows, rows, batch.seq_lens, 1.0,
                                                kv_scales=torch.ones(1))


def test_write_kv_copies_bf16_rows_into_their_slots(rng):
    k = torch.randn(5, 2, 16, generator=rng).bfloat16()
    v = torch.randn(5, 2, 16, generator=rng).bfloat16()
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 0, -1, 15, 6])

    cpu_ops.write_kv(k, v, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(16, 2, 16), v_cache.view(16, 2, 16)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[row]) and torch.equal(flat_v[slot], v[row])
    assert flat_k[[1, 2, 4, 5]].abs().sum() == 0  # slots nobody named (and the -1 row) untouched
    with pytest.raises(ValueError, match="must be a torch.bfloat16 CPU tensor"):
        cpu_ops.write_kv(k, v, k_cache.float(), v_cache, slots)


@pytest.mark.parametrize("requests", [
    [(30, 1), (0, 7), (12, 5), (3, 1), (64, 1)],  # decodes mixed with prefill chunks
    [(30, 1), (3, 1), (64, 1)],  # a pure decode step
])
@pytest.mark.parametrize("head_dim", [16, 24])  # the native prefill kernel; torch's SDPA
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_backend_on_a_bf16_model_equals_the_torch_backend(rng, paged_batch, requests,
                                                              head_dim, cache_dtype):
    batch = paged_batch(rng, requests, 4, 2, head_dim, shared_prefix_blocks=1)
    q = torch.randn(batch.num_tokens, 4, head_dim, generator=rng).bfloat16()
    k = torch.randn(batch.num_tokens, 2, head_dim, generator=rng).bfloat16()
    v = torch.randn(batch.num_tokens, 2, head_dim, generator=rng).bfloat16()
    k_cache, v_cache, scales = _narrow_caches(batch, cache_dtype)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outputs = []
    for backend, (k_cache, v_cache) in zip(
            (CpuAttentionBackend(torch.bfloat16), TorchAttentionBackend()), caches, strict=True):
        meta = backend.build_metadata(batch.metadata())
        outputs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 0.25, None,
                                       kv_scales=scales))
    assert outputs[0].dtype == torch.bfloat16
    # the step's rows written alike (float8: quantized by the one definition)
    for cpu_cache, torch_cache in zip(*caches, strict=True):
        assert torch.equal(cpu_cache.view(torch.uint8), torch_cache.view(torch.uint8))
    # the torch backend rounds its scores and probabilities to bfloat16; the native kernels
    # keep them in float32: a few bfloat16 ulps apart on outputs of size ~1
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2e-2, atol=2e-2)


def test_auto_picks_the_native_kernels_for_bf16_too():
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu, torch.bfloat16).name == "cpu"
    assert get_attention_backend("auto", cpu, torch.float16).name == "torch"
    with pytest.raises(ValueError, match="float32 and bfloat16 models only"):
        get_attention_backend("cpu", cpu, torch.float16)
