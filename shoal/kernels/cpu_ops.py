"""The decoder's position-wise ops for CPU float32 (``cpu_ops.c``) and bfloat16
(``cpu_ops_bf16.c``), in the native library of ``native_cpu``: RMSNorm with an optional
fused residual add, SiLU-and-mul, the neox rotary embedding in place (bfloat16 also: the
per-head q/k norm and the rotary in one pass), and the new K/V rows' write into their cache
slots. Each is one pass over its rows where torch runs several ops.

The inputs come from the model's own layers, so checks are of kind, not of every index:
float32 or bfloat16 CPU tensors (all of one call's the same) whose last dimension is
contiguous.
"""

from __future__ import annotations

import torch

from shoal.kernels.kv_layout import check_kv_write_shapes
from shoal.kernels.native_cpu import load

DTYPES = (torch.float32, torch.bfloat16)


def _suffix(dtype: torch.dtype) -> str:
    """The C function's suffix for this element type."""
    return "f32" if dtype == torch.float32 else "bf16"


def _check_rows(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``dtype``: the type the call's other tensors have (None: this one sets it)."""
    if tensor.device.type != "cpu" or tensor.dtype not in DTYPES or (
            dtype is not None and tensor.dtype != dtype):
        wanted = "float32 or bfloat16" if dtype is None else str(dtype).removeprefix("torch.")
        raise ValueError(f"{name} must be a {wanted} CPU tensor, got {tensor.dtype} on "
                         f"{tensor.device}")
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be 2-d with contiguous rows, got shape "
                         f"{tuple(tensor.shape)} strides {tensor.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension of ``x [rows, size]``. With
    ``residual``: ``residual += x`` in place first, and the updated residual is normalised."""
    _check_rows("x", x)
    rows, size = x.shape
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be {x.dtype} like x, got {weight.dtype}")
    if weight.shape != (size,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{size}] vector, got {tuple(weight.shape)}")
    out = torch.empty(rows, size, dtype=x.dtype)
    residual_ptr, residual_stride = 0, 0
    if residual is not None:
        _check_rows("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
        residual_ptr, residual_stride = residual.data_ptr(), residual.stride(0)
    if rows:
        getattr(load(), f"shoal_rms_norm_{_suffix(x.dtype)}")(
            x.data_ptr(), x.stride(0), residual_ptr or None, residual_stride,
            weight.data_ptr(), out.data_ptr(), size, rows, size, eps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [rows, 2 * size]`` = [gate | up]."""
    _check_rows("gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {width}")
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    if rows:
        getattr(load(), f"shoal_silu_and_mul_{_suffix(gate_up.dtype)}")(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width // 2, rows, width // 2)
    return out


def rotary_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``x [tokens, heads, head_dim]`` in place (neox halves); ``cos``/``sin``
    ``[tokens, head_dim / 2]`` hold each token's position's table row. ``x`` may be a view
    whose heads are contiguous within a token (e.g. the q and k heads of fused qkv rows)."""
    tokens, heads, head_dim = _check_heads(x, cos, sin)
    if tokens:
        getattr(load(), f"shoal_rotary_neox_{_suffix(x.dtype)}")(
            x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            cos.stride(0), tokens)


def qk_norm_rotary_(qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> None:
    """bfloat16: ``qk [tokens, q_heads + k_heads, head_dim]`` (q's and k's heads side by side,
    e.g. in the fused qkv rows), each head RMS-normalised with ``q_weight`` (the first
    ``q_heads``) or ``k_weight`` (the rest) and then rotated (neox halves), in place: what
    ``rms_norm`` per head and then ``rotary_neox_`` do, in one pass."""
    tokens, heads, head_dim = _check_heads(qk, cos, sin)
    if qk.dtype != torch.bfloat16:
        raise ValueError(f"qk must be bfloat16, got {qk.dtype}")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.dtype != qk.dtype or weight.shape != (head_dim,) or \
                not weight.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {qk.dtype} [{head_dim}] vector")
    if not 0 <= q_heads <= heads:
        raise ValueError(f"q_heads {q_heads} is not within the {heads} heads")
    if tokens:
        load().shoal_qk_norm_rotary_bf16(qk.data_ptr(), qk.stride(0), q_heads, heads - q_heads,
                                         head_dim, q_weight.data_ptr(), k_weight.data_ptr(),
                                         eps, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                                         tokens)


def _check_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int]:
    """``x [tokens, heads, head_dim]`` with heads contiguous within a token, and its
    ``[tokens, head_dim / 2]`` rotary table rows of the same type."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 3:
        raise ValueError(f"x must be a 3-d float32 or bfloat16 CPU tensor, got {x.dim()}-d "
                         f"{x.dtype}")
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"x's heads must be contiguous within a token, strides {x.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table, x.dtype)
        if table.shape != (tokens, head_dim // 2):
            raise ValueError(f"{name} must be [{tokens}, {head_dim // 2}], got "
                             f"{tuple(table.shape)}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must have the same row stride")
    return tokens, heads, head_dim


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``reshape_and_cache`` for CPU float32 or bfloat16 (rows copied as bytes): token t's ``k[t]``/``v[t]`` ``[Hk, D]`` go to
    flat slot ``slot_mapping[t]`` (int64; negative: padding, skipped) of the
    ``[blocks, block_size, Hk, D]`` caches. ``k``/``v`` may be views into wider rows (the
    fused qkv rows) whose heads are contiguous within a token."""
    check_kv_write_shapes(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64, got {slot_mapping.dtype}")
    if k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"key must be float32 or bfloat16, got {k.dtype}")
    for name, x in (("key", k), ("value", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device.type != "cpu" or x.dtype != k.dtype:
            raise ValueError(f"{name} must be a {k.dtype} CPU tensor, got {x.dtype} on "
                             f"{x.device}")
    for name, x in (("key", k), ("value", v)):
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(f"{name}'s heads must be contiguous within a token, strides "
                             f"{x.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if num_tokens:
        size = k.element_size()
        load().shoal_write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(),
                              v.stride(0) * size, k_cache.data_ptr(), v_cache.data_ptr(),
                              slot_mapping.data_ptr(), num_tokens,
                              num_kv_heads * head_dim * size)
