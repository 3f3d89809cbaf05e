"""The routed experts of an MoE block on CPU, float32 or bfloat16 weights
(``moe_experts_cpu.c`` in the native library): SiLU-and-mul experts, each chosen expert's
weights read from memory once per step and from cache for each of its tokens.

Same contract as ``moe_grouped.grouped_experts`` without biases and with SiLU:
``out[t] = sum_j topk_weights[t, j] * (w2[e] @ (silu(g) * u))`` where ``[g | u] =
w13[e] @ x[t]`` and ``e = topk_ids[t, j]``; ``w13 [E, 2I, H]``, ``w2 [E, H, I]``.

The arithmetic is float32 whatever the weights: bfloat16 activations are widened on the way
in and the output rounded once to bfloat16 on the way out (torch's grouped bfloat16 GEMMs
round after each GEMM and the activation; both are within bfloat16 noise of HF's loop).

``supports`` says which calls the kernel takes (CPU tensors of one dtype, float32 or
bfloat16, contiguous weights, H a multiple of 16 and I of 8); ``experts`` sends every other call to
the grouped torch path, so a caller can use it unconditionally.

``pack_experts`` lays the weights out in the kernel's panel order once (the loader does, in
place of the plain layout: the same bytes), and ``experts_packed`` runs on them: no packing
pass per step, and one row or hundreds, every expert multiplies its panels.

``experts_quantized``: the same with each projection's weights kept packed
(``int_matmul_cpu.IntPacked``: int4 / int8 codes, or FP8, the E experts' rows stacked), each
weight dequantized once per step into float32 inside the kernel; no torch fallback (the
loader keeps experts quantized only where the native library loads). The kernel's scratch (sorted
pairs, activations, per-pair outputs) is kept per thread and grown, not allocated per call.
"""

from __future__ import annotations

import threading

import torch

from shoal.kernels.int_matmul_cpu import IntPacked
from shoal.kernels.linear_panels_cpu import DTYPES, PANEL
from shoal.kernels.linear_panels_cpu import pack as pack_panels
from shoal.kernels.moe_grouped import grouped_experts
from shoal.kernels.native_cpu import load

HIDDEN_ALIGN = 16  # the down projection's items are 16 output features, with no tail
INTER_ALIGN = 8  # the AVX2 loops take 8 float32 per step, with no tail

_scratch = threading.local()


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The kernel takes this call (else the grouped torch path runs)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return False
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    if w13.dim() != 3 or w2.dim() != 3 or not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    return (x.shape[1] == hidden and two_inter % 2 == 0 and hidden % HIDDEN_ALIGN == 0
            and inter % INTER_ALIGN == 0 and tuple(w2.shape) == (experts, hidden, inter))


def _scratch_buffer(nbytes: int) -> torch.Tensor:
    """This thread's scratch, at least ``nbytes``: grown (by a quarter more, so a step
    slightly larger than the last does not reallocate), never shrunk."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8)
        _scratch.buffer = buffer
    return buffer


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` in x's dtype: the kernel where ``supports``, else ``grouped_experts``."""
    if not supports(x, w13, w2):
        return grouped_experts(x, w13, w2, topk_weights, topk_ids)
    num_experts, two_inter, hidden = w13.shape
    return _run("shoal_moe_experts", x, w13, w2, topk_weights, topk_ids, num_experts, hidden,
                two_inter // 2)


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights in the kernel's panel order, once (at load; ``experts_packed`` reads
    them): ``w13 [E, 2I, H]`` -> ``[E, I/8, H, 16]``, each 16-row panel item g's gate rows
    8g..8g+7 then the same up rows, column by column; ``w2 [E, H, I]`` -> ``[E, H/16, I, 16]``.
    The same bytes as the inputs (the caller drops those); packed expert by expert, so the
    copy in flight is one expert's. Only for weights ``supports`` takes."""
    num_experts, two_inter, hidden = w13.shape
    inter, half = two_inter // 2, PANEL // 2
    w13p = torch.empty(num_experts, inter // half, hidden, PANEL, dtype=w13.dtype)
    w2p = torch.empty(num_experts, hidden // PANEL, inter, PANEL, dtype=w2.dtype)
    for e in range(num_experts):
        gate = w13[e, :inter].reshape(inter // half, half, hidden)
        up = w13[e, inter:].reshape(inter // half, half, hidden)
        w13p[e] = torch.cat([gate, up], 1).transpose(1, 2)
        w2p[e] = pack_panels(w2[e])  # a dense layer's panels (H is a multiple of PANEL)
    return w13p, w2p


def experts_packed(x: torch.Tensor, w13p: torch.Tensor, w2p: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``experts`` on weights from ``pack_experts`` (x in their dtype)."""
    num_experts, groups, hidden, _ = w13p.shape
    if x.dtype != w13p.dtype or x.shape[-1] != hidden:
        raise ValueError(f"packed experts: x {tuple(x.shape)} {x.dtype} against weights "
                         f"{tuple(w13p.shape)} {w13p.dtype}")
    return _run("shoal_moe_experts_packed", x, w13p, w2p, topk_weights, topk_ids, num_experts,
                hidden, groups * (PANEL // 2))


def _run(entry: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
         topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, hidden: int,
         inter: int) -> torch.Tensor:
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype)
    library = load()
    xf = x.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    sizes = (tokens, hidden, inter, num_experts, top_k)
    nbytes = library.shoal_moe_experts_scratch_bytes(*sizes)
    scratch = _scratch_buffer(nbytes)
    rc = getattr(library, entry)(xf.data_ptr(), *sizes, ids.data_ptr(), weights.data_ptr(),
                                 w13.data_ptr(), w2.data_ptr(), int(x.dtype == torch.bfloat16),
                                 scratch.data_ptr(), scratch.numel(), out.data_ptr())
    if rc != 0:  # sized on this thread just above: cannot happen unless the pool changed
        raise RuntimeError(f"moe_experts_cpu: {scratch.numel()} bytes of scratch refused")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def experts_quantized(x: torch.Tensor, w13: IntPacked, w2: IntPacked,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """``[T, H]`` in x's dtype (float32 or bfloat16): ``w13`` the experts' gate and up rows
    stacked (``[E * 2I, H]`` as packed), ``w2`` their down rows (``[E * H, I]``), one format
    (``bits``) for both."""
    tokens, top_k = topk_ids.shape
    hidden = w13.in_features
    inter = w2.in_features
    if w13.out_features != num_experts * 2 * inter or w2.out_features != num_experts * hidden \
            or w13.bits != w2.bits or x.shape[-1] != hidden:
        raise ValueError(f"quantized experts: w13 {w13.out_features}x{hidden}, w2 "
                         f"{w2.out_features}x{inter} do not fit {num_experts} experts and x "
                         f"{tuple(x.shape)}")
    if hidden % HIDDEN_ALIGN or inter % INTER_ALIGN:
        raise ValueError(f"quantized experts: hidden {hidden} must be a multiple of "
                         f"{HIDDEN_ALIGN} and the intermediate size {inter} of {INTER_ALIGN}")
    if tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype)
    library = load()
    xf = x.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    sizes = (tokens, hidden, inter, num_experts, top_k)
    nbytes = library.shoal_moe_experts_scratch_bytes(*sizes)
    scratch = _scratch_buffer(nbytes)
    rc = library.shoal_moe_experts_q(
        xf.data_ptr(), *sizes, ids.data_ptr(), weights.data_ptr(),
        w13.codes.data_ptr(), w13.scales.data_ptr(), w13.offsets.data_ptr(), w13.group,
        w13.scale_format, w2.codes.data_ptr(), w2.scales.data_ptr(), w2.offsets.data_ptr(),
        w2.group, w2.scale_format, w13.bits, scratch.data_ptr(), scratch.numel(),
        out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"moe_experts_cpu: {scratch.numel()} bytes of scratch refused")
    return out if x.dtype == torch.float32 else out.to(x.dtype)
