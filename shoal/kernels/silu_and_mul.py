"""SwiGLU's activation in one kernel: ``silu(gate) * up`` from the fused gate/up projection.

In torch this is a SiLU pass and a multiply pass over ``[T, intermediate]`` (two launches,
an intermediate tensor); here one program per (row, column block) reads both halves once.
Rounds like the torch ops in half precision: SiLU's result to the input dtype, then the
product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.launch import check_launchable

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    x_ty = x_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def block_for(size: int) -> int:
    """The launcher's choice: columns per program for a ``size``-wide intermediate."""
    return min(BLOCK, triton.next_power_of_2(size))


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., 2 * I]`` (gate half, then up half) -> ``[..., I]`` (``out``: contiguous)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"the last dimension must hold gate and up halves, got {gate_up.shape[-1]}")
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    shape = (*gate_up.shape[:-1], size)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} tensor")
    out_rows = out.view(-1, size)
    if rows.shape[0] and size:
        check_launchable(rows, out_rows)
        block = block_for(size)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
            rows, out_rows, rows.stride(0), out_rows.stride(0), size, BLOCK_N=block)
    return out


def gpu_variants() -> list:
    """Every model's intermediate size per tensor-parallel rank, in every model dtype."""
    from shoal.kernels.gpu_check import variants as v

    out = []
    for model, tp in v.sharded_shapes():
        for dtype in v.KV_DTYPES:
            ty = v.triton_type(dtype)
            constexprs = dict(BLOCK_N=block_for(model.intermediate // tp))
            sig = v.signature(_silu_and_mul_kernel, constexprs, dict(x_ptr=ty, out_ptr=ty))
            out.append(v.KernelVariant(f"silu_and_mul {ty} block{constexprs['BLOCK_N']}",
                                       _silu_and_mul_kernel, sig, constexprs, tags=dict(dtype=ty)))
    return v.unique(out)
