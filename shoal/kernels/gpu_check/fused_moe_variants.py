"""gpu-check's variants of the fused MoE grouped GEMM (``shoal/kernels/fused_moe.py``).

Its launcher picks the tiles inline, so the choice is read from the launcher itself: its
``_grouped_gemm`` is called on shape-only ("meta") tensors with the jit function swapped for
a recorder that keeps the constexprs it is launched with instead of running anything.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.kernels import fused_moe
from shoal.kernels.gpu_check import variants as v

# (name, hidden, moe intermediate, experts, top-k): the MoE families the engine serves
MOE_SHAPES = (
    ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    ("Qwen2-57B-A14B", 3584, 2560, 64, 8),
    ("Mixtral-8x7B", 4096, 14336, 8, 2),
)
BLOCK_M = 16  # fused_moe's default


class _Recorder:
    """Stands in for the jit function: ``kernel[grid](*args, **constexprs)`` records them."""

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
        return launch


def launcher_constexprs(n_out: int, k: int, weighted: bool, dtype: torch.dtype) -> dict:
    """The constexprs ``fused_moe._grouped_gemm`` launches with for a ``[E, n_out, k]`` weight."""
    def shaped(*size: int, of: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(size, dtype=of, device="meta")

    recorder = _Recorder()
    real = fused_moe._grouped_gemm_kernel
    fused_moe._grouped_gemm_kernel = recorder  # type: ignore[assignment]
    try:
        fused_moe._grouped_gemm(
            shaped(4, k), shaped(2, n_out, k), shaped(4, n_out),
            shaped(BLOCK_M, of=torch.int64), shaped(1, of=torch.int64),
            shaped(4, of=torch.float32) if weighted else None, 1 if weighted else 2, BLOCK_M)
    finally:
        fused_moe._grouped_gemm_kernel = real
    (constexprs,) = recorder.launches
    return constexprs


def quantized_constexprs(n_out: int, k: int, weighted: bool, bits: int,
                         dtype: torch.dtype) -> dict:
    """The constexprs ``fused_moe._grouped_gemm_q`` launches with for quantized experts."""
    from shoal.kernels.int_matmul_cpu import FP8, NO_OFFSET, OFFSETS, IntPacked

    def shaped(*size: int, of: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(size, dtype=of, device="meta")

    width = k // 2 if bits == 4 else k
    group = 32
    w = IntPacked(shaped(2 * n_out, width, of=torch.uint8), shaped(2 * n_out, k // group),
                  shaped(0, of=torch.uint8) if bits == FP8 else shaped(2 * n_out, k // group),
                  bits, group, k, NO_OFFSET if bits == FP8 else OFFSETS)
    recorder = _Recorder()
    real = fused_moe._grouped_gemm_q_kernel
    fused_moe._grouped_gemm_q_kernel = recorder  # type: ignore[assignment]
    try:
        fused_moe._grouped_gemm_q(
            shaped(4, k, of=dtype), w, n_out, shaped(4, n_out), shaped(BLOCK_M, of=torch.int64),
            shaped(1, of=torch.int64), shaped(4) if weighted else None,
            1 if weighted else 2, BLOCK_M)
    finally:
        fused_moe._grouped_gemm_q_kernel = real
    (constexprs,) = recorder.launches
    return constexprs


def quantized_variants() -> list:
    """The quantized experts' kernel: int4 / int8 codes (float offsets) and FP8, scales in
    float32 or 16 bits (kept so where exact), per MoE shape and model dtype."""
    out = []
    for name, hidden, intermediate, _experts, _top_k in MOE_SHAPES:
        for bits, fmt, w_ty in ((4, "int4", "u8"), (8, "int8", "u8"), (0, "fp8", "fp8e4nv")):
            for dtype in v.KV_DTYPES:
                ty = v.triton_type(dtype)
                for s_ty in ("fp32", "fp16", "bf16"):
                    for proj, n_out, k, weighted in (("w13", 2 * intermediate, hidden, False),
                                                     ("w2", hidden, intermediate, True)):
                        constexprs = quantized_constexprs(n_out, k, weighted, bits, dtype)
                        pointers = dict(a_ptr=ty, w_ptr=w_ty, s_ptr=s_ty, o_ptr=s_ty, c_ptr=ty,
                                        sorted_ids_ptr="i64", block_expert_ptr="i64",
                                        weights_ptr="fp32" if weighted else ty)
                        sig = v.signature(fused_moe._grouped_gemm_q_kernel, constexprs,
                                          pointers)
                        label = (f"fused_moe_q {fmt} {proj} {ty} scales {s_ty} "
                                 f"n{constexprs['BLOCK_N']} k{constexprs['BLOCK_K']}")
                        out.append(v.KernelVariant(label, fused_moe._grouped_gemm_q_kernel,
                                                   sig, constexprs,
                                                   tags=dict(model=name, format=fmt)))
    return v.unique(out)


def gpu_variants() -> list:
    out = quantized_variants()
    for name, hidden, intermediate, _experts, _top_k in MOE_SHAPES:
        for tp in v.TP_SIZES:
            shard = intermediate // tp
            for dtype in v.KV_DTYPES:
                ty = v.triton_type(dtype)
                # gate/up: [E, 2I/tp, H] over token rows; down: [E, H, I/tp], routing-weighted
                for proj, n_out, k, weighted in (("w13", 2 * shard, hidden, False),
                                                 ("w2", hidden, shard, True)):
                    constexprs = launcher_constexprs(n_out, k, weighted, dtype)
                    pointers = dict(a_ptr=ty, w_ptr=ty, c_ptr=ty, sorted_ids_ptr="i64",
                                    block_expert_ptr="i64",
                                    weights_ptr="fp32" if weighted else ty)
                    sig = v.signature(fused_moe._grouped_gemm_kernel, constexprs, pointers)
                    label = (f"fused_moe {proj} {ty} n{constexprs['BLOCK_N']} "
                             f"k{constexprs['BLOCK_K']} rowdiv{constexprs['ROW_DIV']}")
                    out.append(v.KernelVariant(label, fused_moe._grouped_gemm_kernel, sig,
                                               constexprs, tags=dict(model=name)))
    return v.unique(out)
