"""Shape checks for writing a step's new K/V into the paged cache (``[num_blocks,
block_size, num_kv_heads, head_dim]``, a flat slot per token): one set of rules and messages
for every kernel that writes it (the Triton ``reshape_and_cache``, the CPU ``write_kv``)."""

from __future__ import annotations

import torch


def check_kv_write_shapes(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``key``/``value`` ``[T, num_kv_heads, head_dim]`` match each other and the caches'
    inner dimensions; ``slot_mapping`` has one entry per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, heads, dim]")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} do not match key "
                         f"{(num_kv_heads, head_dim)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
