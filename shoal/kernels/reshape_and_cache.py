"""Write this step's new K/V into the paged cache through the slot mapping.

One program per token: it reads the token's ``[num_kv_heads, head_dim]`` key and value
rows and stores them at ``slot // block_size, slot % block_size``. A negative slot marks a
padding token (CUDA-graph batches are padded up to a captured size) and is skipped, so the
padded rows never touch a real block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.kv_layout import check_kv_write_shapes
from shoal.kernels.launch import check_launchable


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads: tl.constexpr,
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def launch_config(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """The launcher's constexprs: one program per token, all of its kv heads."""
    return dict(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                BLOCK_H=triton.next_power_of_2(num_kv_heads),
                BLOCK_D=triton.next_power_of_2(head_dim))


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64, negative = skip
) -> None:
    check_kv_write_shapes(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_launchable(key, value, k_cache, v_cache, slot_mapping)
    # the kernel addresses the last dimension as contiguous and the cache's two inner ones
    # through strides; make the token rows contiguous in head_dim if a view broke that
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides and be contiguous in head_dim")
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        **launch_config(num_kv_heads, head_dim, k_cache.shape[1]),
    )


def gpu_variants() -> list:
    """kv heads per rank of every model shape and TP size, every cache dtype, the engine's
    block sizes; the step's K/V arrive in the model dtype."""
    from shoal.kernels.gpu_check import variants as v

    out = []
    for model, tp in v.sharded_shapes():
        for dtype in v.KV_DTYPES:
            for block_size in v.BLOCK_SIZES:
                ty = v.triton_type(dtype)
                heads = max(model.num_kv_heads // tp, 1)
                constexprs = launch_config(heads, model.head_dim, block_size)
                pointers = dict(key_ptr=ty, value_ptr=ty, k_cache_ptr=ty, v_cache_ptr=ty,
                                slot_mapping_ptr="i64")
                sig = v.signature(_reshape_and_cache_kernel, constexprs, pointers)
                out.append(v.KernelVariant(
                    f"reshape_and_cache {ty} kv_heads{heads} d{model.head_dim} page{block_size}",
                    _reshape_and_cache_kernel, sig, constexprs, tags=dict(dtype=ty)))
    return v.unique(out)
