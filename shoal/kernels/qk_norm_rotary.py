"""Fused per-head RMSNorm + rotary embedding (Qwen3's q/k path) in one pass over memory.

Qwen3 normalises every query and key head over ``head_dim`` and then rotates it; done as
two torch ops that is four reads/writes of q and k per layer, here one read and one write.
One program per token handles all of its heads. Rotary is the neox form used by Llama and
Qwen: the head's two halves ``(x1, x2)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)``,
with ``cos[position]`` and ``sin[position]`` each ``head_dim / 2`` wide (the tables the
model's rotary embedding already holds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.launch import check_launchable


@triton.jit
def _qk_norm_rotary_kernel(
    x_ptr,
    out_ptr,
    weight_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    eps,
    num_heads: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    base = x_ptr + token * stride_xt + heads * stride_xh
    x1 = tl.load(base + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + dims, mask=mask, other=0.0).to(tl.float32)

    mean_square = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
    inv_rms = 1.0 / tl.sqrt(mean_square + eps)
    w1 = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    # round where HF's RMSNorm rounds: after normalising, and after scaling by the weight
    x_ty = x_ptr.dtype.element_ty
    n1 = ((x1 * inv_rms[:, None]).to(x_ty).to(tl.float32) * w1).to(x_ty).to(tl.float32)
    n2 = ((x2 * inv_rms[:, None]).to(x_ty).to(tl.float32) * w2).to(x_ty).to(tl.float32)

    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_sin + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    out_base = out_ptr + token * stride_ot + heads * stride_oh
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_base + dims, (n1 * cos - n2 * sin).to(out_ty), mask=mask)
    tl.store(out_base + HALF + dims, (n2 * cos + n1 * sin).to(out_ty), mask=mask)


def launch_config(num_heads: int, head_dim: int) -> dict:
    """The launcher's constexprs: all of a token's heads in one program."""
    half = head_dim // 2
    return dict(num_heads=num_heads, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
                BLOCK_HALF=triton.next_power_of_2(half))


def qk_norm_rotary(
    x: torch.Tensor,  # [T, num_heads, head_dim]
    weight: torch.Tensor,  # [head_dim]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_position, head_dim // 2]
    sin: torch.Tensor,  # [max_position, head_dim // 2]
    eps: float,
    out: torch.Tensor | None = None,  # may be x itself: each program reads before it writes
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if weight.shape != (head_dim,):
        raise ValueError(f"weight must be [{head_dim}], got {tuple(weight.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2:
            raise ValueError(f"{name} must be [max_position, {head_dim // 2}], got {tuple(table.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if out is None:
        out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    check_launchable(x, weight, positions, cos, sin, out)
    if any(t.stride(-1) != 1 for t in (x, out, cos, sin)):
        raise ValueError("x, out, cos and sin must be contiguous in their last dimension")
    _qk_norm_rotary_kernel[(num_tokens,)](
        x, out, weight.contiguous(), positions, cos, sin,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        eps,
        **launch_config(num_heads, head_dim),
    )
    return out


def gpu_variants() -> list:
    """Query and key heads per rank of every model shape and TP size, in every model dtype;
    the cos/sin tables are float32 (the rotary embedding's)."""
    from shoal.kernels.gpu_check import variants as v

    out = []
    for model, tp in v.sharded_shapes():
        for heads in (model.num_heads // tp, max(model.num_kv_heads // tp, 1)):
            for dtype in v.KV_DTYPES:
                ty = v.triton_type(dtype)
                constexprs = launch_config(heads, model.head_dim)
                pointers = dict(x_ptr=ty, out_ptr=ty, weight_ptr=ty, positions_ptr="i64",
                                cos_ptr="fp32", sin_ptr="fp32")
                sig = v.signature(_qk_norm_rotary_kernel, constexprs, pointers, floats=("eps",))
                out.append(v.KernelVariant(f"qk_norm_rotary {ty} heads{heads} d{model.head_dim}",
                                           _qk_norm_rotary_kernel, sig, constexprs,
                                           tags=dict(dtype=ty)))
    return v.unique(out)
