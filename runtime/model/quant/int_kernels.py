"""CPU matmuls on integer weights that stay packed (what ``IntWeights`` becomes after loading).

- ``NativeInt``: the native weight-only int4/int8 kernel (``shoal.kernels.int_matmul_cpu``),
  wherever the native library builds and the columns and groups are multiples of 32: codes
  packed in its layout, a scale per group (16-bit where exact) and the integer zero point
  (4 bits, or one for the tensor; a float offset on CUDA), GPTQ act-order's permuted
  columns sorted once (the activations gathered to match). On CUDA the same layout goes to
  the Triton W4A16/W8A16 GEMM (``shoal.kernels.dequant_gemm``). torch's packed ops below ran
  10-50x slower than float32 ``F.linear`` on an AVX2 CPU (docs/benchmarks.md); they remain
  for a process without a C compiler.
- ``Int4Packed``: torch's packed int4 CPU GEMM (``aten._weight_int4pack_mm_for_cpu``; AVX2
  and AVX-512): two codes a byte in torch's tiled layout, a (scale, offset) pair per group of
  32/64/128/256 input columns, ``W = (code - 8) * scale + offset``. A checkpoint group larger
  than 256 (or per channel) is split into kernel groups sharing its scale; GPTQ act-order's
  permuted columns are sorted once and the activations gathered to match.
- ``Int8Channel``: torch's int8 weight-only GEMM (``aten._weight_int8pack_mm``), one scale per
  output channel; an asymmetric zero point is subtracted as ``sum(x) * zero * scale``.
- ``DequantRows``: anything else (int8 in groups, int4 shapes the packed op refuses: output
  features not a multiple of 16, groups under 32): one byte a code, a band of output rows
  dequantized at a time inside the matmul.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from shoal.runtime.model.quant.int_weight import IntWeights
from torch import nn

from shoal.kernels.int_matmul_cpu import IntPacked

INT4_GROUPS = (256, 128, 64, 32)  # the group sizes the packed int4 CPU op takes
BAND_ELEMENTS = 1 << 20  # DequantRows: weights dequantized per band


class IntKernel(Protocol):
    def register(self, layer: nn.Module) -> None: ...

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


def int4_group(weights: IntWeights) -> int | None:
    """The packed op's group size for these weights, None when it cannot take them."""
    out_features = weights.codes.shape[0]
    if weights.bits != 4 or out_features % 16:
        return None
    if weights.group_index is not None:
        counts = torch.bincount(weights.group_index, minlength=weights.scales.shape[1])
        if not bool((counts == weights.group_size).all()):
            return None  # act-order groups of unequal size cannot be made contiguous
    return next((g for g in INT4_GROUPS if weights.group_size % g == 0), None)


def native_fits(weights: IntWeights) -> bool:
    """The packed layout's kernels take these weights: columns and groups multiples of 32,
    act-order groups of equal size (so sorting makes each contiguous); on CPU the native
    library built, on CUDA the Triton kernel."""
    from shoal.kernels.int_matmul_cpu import SUB
    from shoal.kernels.native_cpu import unavailable_reason

    in_features = weights.codes.shape[1]
    device = weights.codes.device.type
    if device not in ("cpu", "cuda") or weights.bits not in (4, 8) or \
            in_features % SUB or weights.group_size % SUB:
        return False
    if weights.group_index is not None:
        counts = torch.bincount(weights.group_index, minlength=weights.scales.shape[1])
        if not bool((counts == weights.group_size).all()):
            return False
    return device == "cuda" or unavailable_reason() is None


def int_kernel(weights: IntWeights, dtype: torch.dtype = torch.float32) -> IntKernel:
    """``dtype``: the activations' (torch's packed ops keep the scales in it)."""
    if native_fits(weights):
        return NativeInt.from_weights(weights)
    group = int4_group(weights)
    if group is not None:
        return Int4Packed(weights, group, dtype)
    if weights.bits == 8 and weights.scales.shape[1] == 1:
        return Int8Channel(weights, dtype)
    return DequantRows(weights, dtype)


def _sorted_columns(weights: IntWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor | None]:
    """(codes, scales, zeros, permutation): act-order columns sorted by group, so each group
    is contiguous; the permutation gathers the activations the same way."""
    if weights.group_index is None:
        return weights.codes, weights.scales, weights.zeros, None
    perm = torch.argsort(weights.group_index, stable=True)
    return weights.codes[:, perm], weights.scales, weights.zeros, perm


class NativeInt:
    def __init__(self, packed: IntPacked, perm: torch.Tensor | None = None) -> None:
        """``perm``: the activations' columns in the order of the packed ones (act-order).
        Scales (and float offsets) are kept in 16 bits where that is exact (``compact``)."""
        from shoal.kernels.int_matmul_cpu import compact

        packed = compact(packed)
        packed.check()
        self.packed: IntPacked | None = packed
        self.perm = perm

    @classmethod
    def from_weights(cls, weights: IntWeights) -> NativeInt:
        codes, scales, zeros, perm = _sorted_columns(weights)
        sorted_weights = IntWeights(codes, scales, zeros, weights.bits, weights.group_size)
        return cls(packed_int(sorted_weights, weights.codes.device.type == "cpu"), perm)

    def register(self, layer: nn.Module) -> None:
        assert self.packed is not None
        layer.register_buffer("int_packed_codes", self.packed.codes)
        layer.register_buffer("int_packed_scales", self.packed.scales)
        layer.register_buffer("int_packed_offsets", self.packed.offsets)
        if self.perm is not None:
            layer.register_buffer("int_packed_perm", self.perm)
        # the layer's buffers are the tensors; the view on them is rebuilt per call, so a
        # module moved or loaded from a state dict stays consistent
        self.bits, self.group, self.in_features, self.zero_mode = (
            self.packed.bits, self.packed.group, self.packed.in_features,
            self.packed.zero_mode)
        self.packed = None
        del self.perm

    def matmul(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        from shoal.kernels.int_matmul_cpu import int_matmul

        perm = getattr(layer, "int_packed_perm", None)
        if perm is not None:
            x = x[..., perm]
        if x.is_cuda:
            from shoal.kernels.dequant_gemm import INT4, INT8, dequant_gemm

            return dequant_gemm(x, layer.int_packed_codes, layer.int_packed_scales,
                                layer.int_packed_offsets, INT4 if self.bits == 4 else INT8,
                                self.group)
        return int_matmul(x, IntPacked(layer.int_packed_codes, layer.int_packed_scales,
                                       layer.int_packed_offsets, self.bits, self.group,
                                       self.in_features, self.zero_mode))


def packed_int(weights: IntWeights, zero_points: bool = True) -> IntPacked:
    """The kernels' layout of ``weights`` (no act-order index: columns already sorted), kept
    as small as is exact: integer zero points as such (one byte for a tensor whose groups
    share one, 4 bits each where they fit; the CPU kernel forms ``-z * scale`` itself) rather
    than a float offset per group, and scales in 16 bits where every one is exact there.
    ``zero_points`` False (the Triton GEMM reads offsets): float offsets."""
    from shoal.kernels.int_matmul_cpu import OFFSETS, compact, pack_int4
    from shoal.kernels.int_matmul_cpu import zero_points as narrow_zeros

    assert weights.group_index is None
    codes, scales = weights.codes, weights.scales.float().contiguous()
    packed = pack_int4(codes) if weights.bits == 4 else codes.contiguous()
    found = narrow_zeros(weights.zeros, weights.bits) if zero_points else None
    if found is not None:
        offsets, mode = found
    else:
        offsets, mode = (-weights.zeros * weights.scales).float().contiguous(), OFFSETS
    return compact(IntPacked(packed, scales, offsets, weights.bits, weights.group_size,
                             int(codes.shape[1]), mode))


class Int4Packed:
    def __init__(self, weights: IntWeights, group: int, dtype: torch.dtype) -> None:
        codes, scales, zeros, perm = _sorted_columns(weights)
        repeat = weights.group_size // group
        scales = scales.repeat_interleave(repeat, dim=1)
        zeros = zeros.repeat_interleave(repeat, dim=1)
        self.group = group
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1)
        # W = (code - zero) * scale = (code - 8) * scale + (8 - zero) * scale
        self.scale_zeros = torch.stack([scales, (8 - zeros) * scales], dim=-1).transpose(
            0, 1).contiguous().to(dtype)
        self.perm = perm

    def register(self, layer: nn.Module) -> None:
        layer.register_buffer("int4_weight", self.weight)
        layer.register_buffer("int4_scale_zeros", self.scale_zeros)
        if self.perm is not None:
            layer.register_buffer("int4_perm", self.perm)
        del self.weight, self.scale_zeros, self.perm  # the layer's buffers are the copies

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        perm = getattr(layer, "int4_perm", None)
        if perm is not None:
            rows = rows[:, perm]
        scale_zeros = layer.int4_scale_zeros
        if scale_zeros.dtype != x.dtype:
            scale_zeros = scale_zeros.to(x.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), layer.int4_weight,
                                                         self.group, scale_zeros)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Int8Channel:
    def __init__(self, weights: IntWeights, dtype: torch.dtype) -> None:
        self.weight = (weights.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
        self.scales = weights.scales[:, 0].contiguous().to(dtype)
        zero = weights.zeros[:, 0] - 128
        self.correction = (zero * weights.scales[:, 0]).to(dtype) if bool(zero.any()) else None

    def register(self, layer: nn.Module) -> None:
        layer.register_buffer("int8_weight", self.weight)
        layer.register_buffer("int8_scales", self.scales)
        if self.correction is not None:
            layer.register_buffer("int8_zero_correction", self.correction)
        del self.weight, self.scales, self.correction

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        scales = layer.int8_scales.to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(rows, layer.int8_weight, scales)
        correction = getattr(layer, "int8_zero_correction", None)
        if correction is not None:
            out = out - rows.sum(-1, keepdim=True) * correction.to(x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class DequantRows:
    def __init__(self, weights: IntWeights, dtype: torch.dtype) -> None:
        self.weights = weights

    def register(self, layer: nn.Module) -> None:
        w = self.weights
        layer.register_buffer("int_codes", w.codes.contiguous())
        layer.register_buffer("int_scales", w.scales.contiguous())
        layer.register_buffer("int_zeros", w.zeros.contiguous())
        index = w.group_index if w.group_index is not None else (
            torch.arange(w.codes.shape[1]) // w.group_size)
        layer.register_buffer("int_group_index", index)
        del self.weights

    def matmul(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        codes, index = layer.int_codes, layer.int_group_index
        out_rows, in_features = codes.shape
        band = max(1, BAND_ELEMENTS // max(1, in_features))
        out = torch.empty(*x.shape[:-1], out_rows, dtype=x.dtype, device=x.device)
        for start in range(0, out_rows, band):
            end = min(out_rows, start + band)
            scales = layer.int_scales[start:end][:, index]
            zeros = layer.int_zeros[start:end][:, index]
            w = ((codes[start:end].float() - zeros) * scales).to(x.dtype)
            out[..., start:end] = F.linear(x, w)
        return out
