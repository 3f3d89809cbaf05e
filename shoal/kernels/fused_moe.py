"""Mixture of SwiGLU experts on the GPU: two launches of one grouped-GEMM Triton kernel.

The ``N = T * k`` (token, expert) assignments are sorted by expert and each expert's run is
padded to a multiple of ``BLOCK_M`` (``align_by_expert``, vectorised torch), so every block
of ``BLOCK_M`` sorted rows belongs to one expert. A program computes one ``BLOCK_M x
BLOCK_N`` output tile: it gathers its rows of the input (token ``a // k`` for the first
projection, assignment ``a`` for the second), multiplies by its expert's weight tile read
in place from the stacked ``[E, out, in]`` tensor, optionally scales each row by its routing
weight, and scatters the rows back to assignment order. Padding rows (index ``N``) are
masked. Between the launches, ``silu_and_mul`` (this package's kernel); after, the k rows
of each token are summed.

Accumulates in float32; results are rounded to the input dtype per projection, as the torch
path rounds.

``fused_moe_quantized``: the same two launches with the experts' weights kept quantized, in
the packed layout the loader stacks (``int_matmul_cpu.IntPacked``, the E experts' rows one
after another: ``[E * 2I, ...]`` and ``[E * H, ...]``): int4 / int8 codes with a scale and a
float offset per group (``W = code * scale + offset``) or FP8 with a scale per block, each
weight tile dequantized in registers (as ``dequant_gemm`` does for a dense layer), rounded to
the activation dtype and multiplied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.dequant_gemm import FP8, INT4, INT8
from shoal.kernels.launch import check_launchable
from shoal.kernels.silu_and_mul import silu_and_mul


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> (``sorted_ids [P]``: assignment indices grouped by expert, each
    expert's run padded with the sentinel ``N`` to a multiple of ``block_m``; ``block_expert
    [P / block_m]``: the expert of each block)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    expert_of_sorted = flat[order]
    rank = torch.arange(n, device=flat.device) - start[expert_of_sorted]
    total = int(padded.sum())
    sorted_ids = torch.full((total,), n, dtype=torch.int64, device=flat.device)
    sorted_ids[padded_start[expert_of_sorted] + rank] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device),
                                           padded // block_m)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
                         num_valid, N_OUT, K, stride_am, stride_we, stride_wn, stride_cm,
                         ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_valid
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = (ids // ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        # w[e] is [N_OUT, K]; the tile is read as [BLOCK_K, BLOCK_N] (a transposed view)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
                    + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    if MUL_WEIGHT:
        scale = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    tl.store(c_ptr + ids.to(tl.int64)[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, weights: torch.Tensor | None, row_div: int,
                  block_m: int) -> None:
    n_out, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, weights if weights is not None else out,
        out.shape[0], n_out, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROW_DIV=row_div, MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``,
    ``topk_weights``/``topk_ids [T, k]`` -> ``[T, H]``: each token's weighted sum of its k
    experts' SwiGLU MLPs."""
    tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {two_i // 2}], got "
                         f"{tuple(w2.shape)}")
    if tokens == 0:
        return torch.zeros_like(x)
    check_launchable(x, w13, w2, topk_ids)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    n = tokens * top_k
    gate_up = torch.empty(n, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, None, top_k, block_m)
    hidden_rows = silu_and_mul(gate_up)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(hidden_rows, w2, out, sorted_ids, block_expert, weights, 1, block_m)
    return out.view(tokens, top_k, hidden).sum(dim=1)


@triton.jit
def _grouped_gemm_q_kernel(a_ptr, w_ptr, s_ptr, o_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr,
                           weights_ptr, num_valid, N_OUT, K, group, stride_am, stride_wn,
                           stride_sn, stride_cm, ROW_DIV: tl.constexpr,
                           MUL_WEIGHT: tl.constexpr, FORMAT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_valid
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = (ids // ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    w_rows = (expert * N_OUT + cols.to(tl.int64))[None, :]  # the stacked matrix's rows
    ks = tl.arange(0, BLOCK_K)
    # int4: column c of a step (whole 32-column sub-blocks) is in byte 16 * (c // 32) + c % 16
    # of the step's bytes, the high nibble when c % 32 >= 16 (dequant_gemm's layout)
    byte_in_step = (ks // 32) * 16 + ks % 16
    shift = ((ks // 16) % 2) * 4
    subs = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        # groups are whole 32-column sub-blocks: one scale (offset) load per sub-block and
        # column, broadcast over its 32 columns (as dequant_gemm's BY_SUB)
        first = k0 + subs * 32
        s_at = w_rows * stride_sn + (first // group)[:, None]
        s_ok = (first < K)[:, None] & col_ok[None, :]
        scale = tl.reshape(tl.broadcast_to(
            tl.load(s_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)[:, None, :],
            (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
        if FORMAT != 0:
            offset = tl.reshape(tl.broadcast_to(
                tl.load(o_ptr + s_at, mask=s_ok, other=0.0).to(tl.float32)[:, None, :],
                (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
        if FORMAT == 4:
            byte = tl.load(w_ptr + w_rows * stride_wn + (k0 // 2 + byte_in_step)[:, None],
                           mask=w_ok, other=0)
            code = ((byte.to(tl.int32) >> shift[:, None]) & 15).to(tl.float32)
            w = code * scale + offset
        elif FORMAT == 8:
            code = tl.load(w_ptr + w_rows * stride_wn + kk[:, None], mask=w_ok,
                           other=0).to(tl.float32)
            w = code * scale + offset
        else:
            w = tl.load(w_ptr + w_rows * stride_wn + kk[:, None], mask=w_ok,
                        other=0.0).to(tl.float32) * scale
        acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
    if MUL_WEIGHT:
        routing = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        acc = acc * routing[:, None]
    tl.store(c_ptr + ids.to(tl.int64)[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def quantized_format(bits: int) -> int:
    """``IntPacked.bits`` -> the kernels' FORMAT."""
    return {4: INT4, 8: INT8, 0: FP8}[bits]


def _grouped_gemm_q(a: torch.Tensor, w, n_out: int, out: torch.Tensor,
                    sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                    weights: torch.Tensor | None, row_div: int, block_m: int) -> None:
    """``w``: an ``IntPacked`` of the experts' rows stacked, float offsets (or FP8)."""
    from shoal.kernels.int_matmul_cpu import NO_OFFSET, OFFSETS

    if w.zero_mode not in (OFFSETS, NO_OFFSET):
        raise ValueError("the Triton experts read float offsets, not zero points")
    fmt = quantized_format(w.bits)
    k = w.in_features
    if w.group % 32:
        raise ValueError(f"quantized experts: groups of {w.group} columns (need multiples of 32)")
    # float32 activations multiply on CUDA cores (an exact fp32 dot): narrower tiles, as
    # dequant_gemm's, where 64 x 64 spilled 11 KB a thread (gpu-check)
    wide = a.dtype != torch.float32
    block_n = min(64 if wide else 32, max(16, triton.next_power_of_2(n_out)))
    block_k = 64 if wide and k % 64 == 0 else 32
    codes = w.codes.view(torch.float8_e4m3fn) if fmt == FP8 else w.codes
    offsets = w.offsets if w.zero_mode == OFFSETS else w.scales
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_gemm_q_kernel[grid](
        a, codes, w.scales, offsets, out, sorted_ids, block_expert,
        weights if weights is not None else out, out.shape[0], n_out, k, w.group, a.stride(0),
        codes.stride(0), w.scales.stride(0), out.stride(0), ROW_DIV=row_div,
        MUL_WEIGHT=weights is not None, FORMAT=fmt, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)


def fused_moe_quantized(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, num_experts: int,
                        block_m: int = 16) -> torch.Tensor:
    """``fused_moe`` with ``w13`` (``[E * 2I, H]``) and ``w2`` (``[E * H, I]``) packed."""
    tokens, top_k = topk_ids.shape
    hidden, inter = w13.in_features, w2.in_features
    if w13.out_features != num_experts * 2 * inter or w2.out_features != num_experts * hidden:
        raise ValueError(f"quantized experts: w13 {w13.out_features} rows, w2 "
                         f"{w2.out_features} rows do not fit {num_experts} experts of "
                         f"{hidden} -> {inter}")
    if tokens == 0:
        return torch.zeros_like(x)
    check_launchable(x, w13.codes, w2.codes, topk_ids)
    x = x.contiguous()
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    n = tokens * top_k
    gate_up = torch.empty(n, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_gemm_q(x, w13, 2 * inter, gate_up, sorted_ids, block_expert, None, top_k, block_m)
    hidden_rows = silu_and_mul(gate_up)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm_q(hidden_rows, w2, hidden, out, sorted_ids, block_expert, weights, 1,
                    block_m)
    return out.view(tokens, top_k, hidden).sum(dim=1)
