"""RMSNorm in one kernel: the model's half-precision path is four torch ops (upcast, norm,
downcast, scale), each a launch and a pass over memory; here one program per row does all
of it, rounding where HF's RMSNorm rounds (after normalising, and after the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.launch import check_launchable


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    out_ptr,
    weight_ptr,
    stride_x,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    x_ty = x_ptr.dtype.element_ty
    normed = (x * inv_rms).to(x_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(size: int) -> dict:
    """The launcher's choice for rows of ``size``: one program per row, the whole row in one
    block, more warps for wider rows."""
    block = triton.next_power_of_2(size)
    return dict(N=size, BLOCK_N=block, num_warps=min(max(block // 256, 1), 8))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape); ``out``: same shape,
    contiguous, written in place."""
    size = x.shape[-1]
    if weight.shape != (size,):
        raise ValueError(f"weight must be [{size}], got {tuple(weight.shape)}")
    rows = x.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} tensor")
    out_rows = out.view(-1, size)
    if rows.shape[0] == 0:
        return out
    check_launchable(rows, weight, out_rows)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, out_rows, weight.contiguous(), rows.stride(0), out_rows.stride(0), eps,
        **launch_config(size),
    )
    return out


def gpu_variants() -> list:
    """The model's norms (hidden size; head dim for q/k norms outside the fused kernel) in
    every model dtype (``make gpu-check``)."""
    from shoal.kernels.gpu_check import variants as v

    sizes = sorted({m.hidden for m in v.MODEL_SHAPES} | set(v.HEAD_DIMS))
    out = []
    for size in sizes:
        for dtype in v.KV_DTYPES:
            config = launch_config(size)
            num_warps = config.pop("num_warps")
            ty = v.triton_type(dtype)
            sig = v.signature(_rms_norm_kernel, config,
                              dict(x_ptr=ty, out_ptr=ty, weight_ptr=ty), floats=("eps",))
            out.append(v.KernelVariant(f"rms_norm {ty} n{size}", _rms_norm_kernel, sig, config,
                                       num_warps=num_warps, tags=dict(dtype=ty)))
    return v.unique(out)
