"""The CPU decode-attention kernel (``paged_decode_cpu.c``, in the native library of
``native_cpu``): argument checks and the call."""

from __future__ import annotations

import torch

from shoal.kernels.native_cpu import load


def check_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype, dims: int,
                 rows_only: bool = False) -> None:
    """Device, type and rank; contiguous, or (``rows_only``) each row contiguous."""
    if tensor.device.type != "cpu" or tensor.dtype != dtype or tensor.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d {dtype} CPU tensor, got "
                         f"{tensor.dim()}-d {tensor.dtype} on {tensor.device}")
    if not (tensor.stride(-1) == 1 if rows_only else tensor.is_contiguous()):
        raise ValueError(f"{name} must be contiguous")


# the K/V cache element types the kernels read (widened to float32 as they load), in the
# order of the kernels' kv_kind argument; a float8 cache is read with its layer's scales
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def kv_kind(cache_dtype: torch.dtype) -> int:
    """The kernels' ``kv_kind`` argument for a cache of ``cache_dtype``."""
    return KV_DTYPES.index(cache_dtype)


def kv_scales_pointer(k_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> int | None:
    """The kernels' ``kv_scales`` argument: float32 ``[2]`` (k_scale, v_scale) of a float8
    cache, read by the kernel on each call; None (scales of 1, or a cache without scales)."""
    if kv_scales is None or k_cache.element_size() != 1:
        return None
    check_tensor("kv_scales", kv_scales, torch.float32, 1)
    if kv_scales.shape[0] != 2:
        raise ValueError(f"kv_scales must be (k_scale, v_scale), got {tuple(kv_scales.shape)}")
    return kv_scales.data_ptr()


def fp8_table(cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The kernels' table from each byte of a float8 ``cache_dtype`` to its float32 value
    times ``scale`` (``kv_fp8_cpu.c``; exposed so tests hold it to torch's own cast)."""
    table = torch.empty(256, dtype=torch.float32)
    load().shoal_fp8_table(kv_kind(cache_dtype), scale, table.data_ptr())
    return table


def check_paged_layout(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor,
                       block_tables: torch.Tensor) -> tuple[int, int, int, int]:
    """The layouts the paged CPU kernels read (q's tokens may be a view into wider rows);
    returns (num_heads, head_dim, block_size, num_kv_heads). q and out are float32; the
    caches of one of ``KV_DTYPES``, both the same."""
    check_tensor("q", q, torch.float32, 3, rows_only=True)
    if q.stride(1) != q.shape[2]:
        raise ValueError(f"q's heads must be contiguous within a token, strides {q.stride()}")
    check_tensor("out", out, torch.float32, 3)
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must both be of one of "
                         f"{', '.join(str(t) for t in KV_DTYPES)}, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, k_cache.dtype, 4)
    check_tensor("block_tables", block_tables, torch.int32, 2, rows_only=True)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    return num_heads, head_dim, block_size, num_kv_heads


def sinks_pointer(sinks: torch.Tensor | None, num_heads: int) -> int | None:
    """The kernels' ``sinks`` argument: None, or float32 ``[num_heads]`` (gpt-oss: one
    logit per query head in its softmax's denominator)."""
    if sinks is None:
        return None
    check_tensor("sinks", sinks, torch.float32, 1)
    if sinks.shape[0] != num_heads:
        raise ValueError(f"sinks has {sinks.shape[0]} entries for {num_heads} query heads")
    return sinks.data_ptr()


def paged_decode_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor,
                           q_rows: torch.Tensor, table_rows: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           kv_scales: torch.Tensor | None = None) -> None:
    """Writes ``out[q_rows[r]]``: request r's single query row attending over its first
    ``seq_lens[r]`` cached positions (the last ``sliding_window`` of them, if set), read
    through ``block_tables[table_rows[r]]``; with ``softcap``, each score becomes
    ``softcap * tanh(score / softcap)`` (Gemma 2); with ``sinks`` (``sinks_pointer``), each
    head's sink joins its softmax's denominator. Other rows of ``out`` are left untouched.
    A float8 cache holds ``value / scale`` (``kv_cache_dtype.quantize``), its (k, v) scales in
    ``kv_scales`` (None: 1); every element is read back as ``byte's value * scale``.

    q/out ``[T, Hq, D]`` float32; caches ``[blocks, block_size, Hk, D]`` of ``KV_DTYPES``;
    contiguous, except that q's tokens may be further apart than ``Hq * D`` (a view into the
    qkv rows).
    The caller guarantees indices are in range (they come from the engine's own plan)."""
    num_heads, head_dim, block_size, num_kv_heads = check_paged_layout(
        q, out, k_cache, v_cache, block_tables)
    check_tensor("q_rows", q_rows, torch.int64, 1)
    check_tensor("table_rows", table_rows, torch.int64, 1)
    check_tensor("seq_lens", seq_lens, torch.int32, 1)
    count = q_rows.numel()
    if table_rows.numel() != count or seq_lens.numel() != count:
        raise ValueError("q_rows, table_rows and seq_lens must have one entry per request")
    if count == 0:
        return
    failed = load().shoal_paged_decode(
        q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), q_rows.data_ptr(),
        table_rows.data_ptr(), seq_lens.data_ptr(), count, num_heads, num_kv_heads, head_dim,
        block_size, scale, sliding_window or 0, softcap or 0.0,
        kv_kind(k_cache.dtype), sinks_pointer(sinks, num_heads),
        kv_scales_pointer(k_cache, kv_scales))
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
