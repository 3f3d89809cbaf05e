"""reshape_and_cache writes exactly the slots it is given, and nothing else: the Triton
kernel (GPU; here through triton's interpreter) and the native CPU one (float32) alike."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import cpu_ops, native_cpu
from shoal.kernels.reference import reshape_and_cache_ref
from shoal.kernels.reshape_and_cache import reshape_and_cache as triton_reshape_and_cache


def _native_or_skip(*args):
    if native_cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels unavailable: {native_cpu.unavailable_reason()}")
    cpu_ops.write_kv(*args)


KERNELS = {"triton": triton_reshape_and_cache, "native_cpu": _native_or_skip}


@pytest.fixture(params=list(KERNELS))
def reshape_and_cache(request):
    return KERNELS[request.param]


def _poisoned_cache(num_blocks, block_size, heads, dim, dtype):
    return torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dtype)


SHAPES = [(2, 8, 4, torch.float32), (3, 12, 16, torch.float32), (1, 16, 8, torch.float16)]


@pytest.mark.parametrize(
    "kernel,num_kv_heads,head_dim,block_size,dtype",
    [("triton", *shape) for shape in SHAPES]
    # the native CPU kernel writes the float32 caches of the CPU path only
    + [("native_cpu", *shape) for shape in SHAPES if shape[-1] == torch.float32],
)
def test_new_tokens_land_in_their_slots_and_nowhere_else(rng, kernel, num_kv_heads, head_dim,
                                                         block_size, dtype):
    reshape_and_cache = KERNELS[kernel]
    num_blocks, num_tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(dtype)
    k_cache = _poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_cache = _poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_expected, v_expected, slots)

    torch.testing.assert_close(k_cache, k_expected, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_expected, equal_nan=True, rtol=0, atol=0)
    written = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    assert not written.isnan().any()
    assert k_cache.isnan().flatten(2).all(-1).sum() == num_blocks * block_size - num_tokens


def test_negative_slots_are_padding_and_are_skipped(rng, reshape_and_cache):
    key = torch.randn(4, 2, 8, generator=rng)
    value = torch.randn(4, 2, 8, generator=rng)
    k_cache = _poisoned_cache(2, 4, 2, 8, torch.float32)
    v_cache = _poisoned_cache(2, 4, 2, 8, torch.float32)
    slots = torch.tensor([5, -1, 2, -1])

    reshape_and_cache(key, value, k_cache, v_cache, slots)

    torch.testing.assert_close(k_cache[1, 1], key[0])
    torch.testing.assert_close(v_cache[0, 2], value[2])
    assert k_cache.isnan().flatten(2).all(-1).sum() == 8 - 2


def test_strided_key_views_are_accepted(rng, reshape_and_cache):
    """The model slices K and V out of one fused qkv projection: rows are strided views."""
    qkv = torch.randn(5, 3, 2, 8, generator=rng)
    key, value = qkv[:, 1], qkv[:, 2]
    k_cache = _poisoned_cache(3, 4, 2, 8, torch.float32)
    v_cache = _poisoned_cache(3, 4, 2, 8, torch.float32)
    slots = torch.tensor([0, 1, 2, 3, 8])

    reshape_and_cache(key, value, k_cache, v_cache, slots)

    torch.testing.assert_close(k_cache.view(-1, 2, 8)[slots], key)
    torch.testing.assert_close(v_cache.view(-1, 2, 8)[slots], value)


def test_mismatched_shapes_are_rejected_with_a_clear_error(reshape_and_cache):
    key = torch.zeros(3, 2, 8)
    cache = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="do not match"):
        reshape_and_cache(key, key, cache, cache.clone(), torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8), torch.arange(2))
