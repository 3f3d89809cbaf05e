"""Weight-only quantized GEMM on the GPU: ``out = x @ W.T`` with W dequantized tile by tile in
registers, never whole in memory. One Triton kernel for the formats the linear layers keep:

- int4 / int8 (W4A16, W8A16): the layout of the CPU kernel (``int_matmul_cpu.IntPacked``):
  uint8 codes, 4-bit in sub-blocks of 32 columns (byte i: column i low nibble, column 16 + i
  high), a scale and offset per group (float32, or float16 / bfloat16 where exact),
  ``W = code * scale + offset``. compressed-tensors,
  GPTQ and AWQ weights are unpacked into it once at load (``runtime/model/quant/int_kernels``).
- FP8 block-scaled (W8A16): float8_e4m3fn weights with one float32 scale per row and block
  of ``block_in`` columns (``fp8_block``'s kept layout; per-channel FP8 is one block).

A program computes a ``BLOCK_M x BLOCK_N`` output tile: for each ``BLOCK_K`` step it loads
the activations and the weight tile's codes (read as a ``[BLOCK_K, BLOCK_N]`` transposed
view), dequantizes them in float32 with their groups' scales, rounds to the activation dtype
(as the torch dequantize-then-matmul path does) and accumulates ``tl.dot`` in float32.
Decode (a few rows) is bound by the weight bytes, so the tiles are chosen to spread the
output columns over the SMs (``choose_tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.kernels.launch import check_launchable

INT4, INT8, FP8 = 4, 8, 0  # the kernel's FORMAT


@triton.jit
def _dequant_gemm_kernel(x_ptr, w_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, group,
                         stride_xm, stride_wn, stride_sn, stride_om,
                         FORMAT: tl.constexpr, BY_SUB: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    w_rows = cols.to(tl.int64)[None, :] * stride_wn
    s_rows = cols.to(tl.int64)[None, :] * stride_sn
    ks = tl.arange(0, BLOCK_K)
    # int4: column c of a step (a whole number of 32-column sub-blocks) is in byte
    # 16 * (c // 32) + c % 16 of the step's bytes, in the high nibble when c % 32 >= 16
    byte_in_step = (ks // 32) * 16 + ks % 16
    shift = ((ks // 16) % 2) * 4
    subs = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        if BY_SUB:
            # groups are whole 32-column sub-blocks: one scale (offset) load per sub-block
            # and column, broadcast over its 32 columns; far fewer pointers in registers
            first = k0 + subs * 32
            s_at = s_rows + (first // group)[:, None]
            s_ok = (first < K)[:, None] & col_ok[None, :]
            scale = tl.reshape(tl.broadcast_to(
                tl.load(scales_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)[:, None, :],
                (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
            if FORMAT != 0:
                offset = tl.reshape(tl.broadcast_to(
                    tl.load(offsets_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)[:, None, :],
                    (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:
            s_at = s_rows + (kk // group)[:, None]
            scale = tl.load(scales_ptr + s_at, mask=w_ok, other=0.0).to(tl.float32)
            if FORMAT != 0:
                offset = tl.load(offsets_ptr + s_at, mask=w_ok, other=0.0).to(tl.float32)
        if FORMAT == 4:
            byte = tl.load(w_ptr + w_rows + (k0 // 2 + byte_in_step)[:, None], mask=w_ok,
                           other=0)
            code = ((byte.to(tl.int32) >> shift[:, None]) & 15).to(tl.float32)
            w = code * scale + offset
        elif FORMAT == 8:
            code = tl.load(w_ptr + w_rows + kk[:, None], mask=w_ok, other=0).to(tl.float32)
            w = code * scale + offset
        else:
            w = tl.load(w_ptr + w_rows + kk[:, None], mask=w_ok, other=0.0).to(tl.float32)
            w = w * scale
        acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def constexprs(self, fmt: int, by_sub: bool = True) -> dict[str, int]:
        return dict(FORMAT=fmt, BY_SUB=by_sub, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    BLOCK_K=self.block_k)


def choose_tiles(m: int, dtype: torch.dtype) -> Tiles:
    """The launcher's tiles for ``m`` activation rows. Few rows (decode) read every weight
    once: narrow column tiles give enough programs to cover the SMs with a 0.6B model's
    1024-wide outputs; from 64 rows the tiles widen for reuse. ``BLOCK_K`` is a whole number
    of the int4 layout's 32-column sub-blocks. float32 activations multiply on CUDA cores
    (an exact fp32 dot), where the half-precision tiles spilled kilobytes (gpu-check)."""
    if dtype == torch.float32:
        return Tiles(16 if m <= 16 else 32, 32, 32, 4, 2)
    if m <= 16:
        return Tiles(16, 32, 128, 4, 3)
    if m <= 64:
        return Tiles(64 if m > 32 else 32, 64, 64, 4, 3)
    return Tiles(64, 128, 64, 8, 3)


def dequant_gemm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, fmt: int, group: int) -> torch.Tensor:
    """``x [..., K]`` (fp16, bf16 or fp32) @ W.T -> ``[..., N]`` in x's dtype. ``weight``:
    uint8 ``[N, K / 2]`` (INT4), uint8 ``[N, K]`` (INT8) or float8_e4m3fn ``[N, K]`` (FP8);
    ``scales`` (and ``offsets`` for the ints, of the scales' dtype) ``[N, ceil(K / group)]``,
    float32 (FP8) or float32 / float16 / bfloat16 (ints)."""
    n = weight.shape[0]
    k = x.shape[-1]
    width = k // 2 if fmt == INT4 else k
    if weight.shape[1] != width or scales.shape != (n, -(-k // group)):
        raise ValueError(f"weight {tuple(weight.shape)} / scales {tuple(scales.shape)} do not "
                         f"fit {k} input columns in groups of {group}")
    if fmt != FP8 and (k % 32 or group % 32 or offsets is None):
        raise ValueError("int weights need columns and groups multiples of 32 and offsets")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        weight, scales = weight.contiguous(), scales.contiguous()
        offsets = scales if offsets is None else offsets.contiguous()
        check_launchable(rows, weight, scales, offsets, out)
        tiles = choose_tiles(rows.shape[0], x.dtype)
        grid = (triton.cdiv(rows.shape[0], tiles.block_m), triton.cdiv(n, tiles.block_n))
        _dequant_gemm_kernel[grid](
            rows, weight, scales, offsets, out, rows.shape[0], n, k, group, rows.stride(0),
            weight.stride(0), scales.stride(0), out.stride(0),
            **tiles.constexprs(fmt, by_sub=group % 32 == 0),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out.reshape(*x.shape[:-1], n)


def gpu_variants() -> list:
    """Every format in every model dtype at every tile the launcher picks over the decode
    batch sizes (``make gpu-check``); the shapes are runtime arguments."""
    from shoal.kernels.gpu_check import variants as v

    out = []
    # ints: groups of whole sub-blocks always; FP8: 128-column blocks, or any block width
    # (a per-channel block is the input width)
    formats = [(INT4, "int4", "u8", s_ty, True) for s_ty in ("fp32", "fp16", "bf16")] + \
        [(INT8, "int8", "u8", s_ty, True) for s_ty in ("fp32", "fp16", "bf16")] + \
        [(FP8, "fp8", "fp8e4nv", "fp32", by_sub) for by_sub in (True, False)]
    for fmt, name, w_ty, s_ty, by_sub in formats:
        for dtype in v.KV_DTYPES:
            ty = v.triton_type(dtype)
            for batch in v.BATCH_SIZES:
                tiles = choose_tiles(batch, dtype)
                constexprs = tiles.constexprs(fmt, by_sub)
                sig = v.signature(_dequant_gemm_kernel, constexprs,
                                  dict(x_ptr=ty, w_ptr=w_ty, scales_ptr=s_ty,
                                       offsets_ptr=s_ty, out_ptr=ty))
                label = (f"dequant_gemm {name} {ty} scales {s_ty}{'' if by_sub else ' per column'} "
                         f"m{tiles.block_m} n{tiles.block_n} k{tiles.block_k}")
                out.append(v.KernelVariant(label, _dequant_gemm_kernel, sig, constexprs,
                                           num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages,
                                           tags=dict(dtype=ty, format=name)))
    return v.unique(out)
