"""GGUF linear weights kept quantized: Q4_0, Q4_1 and Q8_0 blocks are the native int
kernel's layout (``shoal.kernels.int_matmul_cpu``) up to where the scales sit.

Each block is 32 weights of one row with an fp16 scale ``d`` (the gguf package's
``quants.py``, the reference transformers dequantizes with):

- Q4_0, 18 bytes: ``d``, 16 bytes of nibbles (weight i low, weight 16 + i high);
  ``W = d * (q - 8)`` -> codes as stored, scale ``d``, offset ``-8 d``;
- Q4_1, 20 bytes: ``d``, ``m``, the same nibbles; ``W = d * q + m`` -> offset ``m``;
- Q8_0, 34 bytes: ``d``, 32 signed bytes; ``W = d * q`` -> codes ``q + 128`` (unsigned, the
  kernel's 8-bit codes), offset ``-128 d``.

K-quants, 256-weight super-blocks:

- Q4_K, 144 bytes: fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and mins
  ``m``, 128 bytes of nibbles (each 64 columns: 32 bytes, column l low, 32 + l high);
  ``W = (d sc) q - dmin m`` per 32 columns: the kernel's int4 groups of 32 with scale
  ``d sc`` and offset ``-dmin m``, nibbles reordered to its sub-block order (lossless);
- Q6_K, 210 bytes: kept as stored, the kernel decodes its blocks (``int_matmul_cpu.c``).

``d * q`` is exact in float32 (an 11-bit significand times at most 8 bits; Q4_K's
``d sc q``: 11 + 6 + 4) and the kernel adds the offset with one rounding, so the weights it
multiplies equal the gguf package's dequantized values bit for bit; only the order of the
sums differs from a dense matmul.

A fused layer (q/k/v, gate/up) whose parts differ in type, as "_K_M" files mix Q4_K and
Q6_K, keeps each part in its own layout (``NativeParts``); a part of any other type (F16)
makes the layer dense, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from shoal.runtime.model.gguf_checkpoint import GGUFTensor, unpermute_rows
from shoal.runtime.model.linear import _Linear
from shoal.runtime.model.quant.spec import QuantizationError
from torch import nn

from shoal.kernels.int_matmul_cpu import (
    Q6_K,
    QK,
    SUB,
    IntPacked,
    compact,
    dequantize,
    int_matmul,
    pack_int4,
)

# GGUF type -> the kernel's code width
KERNEL_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q4_K": 4, "Q6_K": Q6_K}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
BLOCK_COLUMNS = {"Q4_K": QK, "Q6_K": QK}  # SUB for the others


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as float32 [rows, blocks]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def gguf_packed(tensor: GGUFTensor) -> IntPacked | None:
    """The tensor in the kernel's layout (llama's q/k rows un-permuted), None for a type the
    kernel does not take."""
    kind = tensor.ggml_type
    bits = KERNEL_TYPES.get(kind)
    block = BLOCK_COLUMNS.get(kind, SUB)
    if bits is None or len(tensor.shape) != 2 or tensor.shape[1] % block:
        return None
    rows, cols = tensor.shape
    raw = torch.from_numpy(np.array(tensor.blocks, dtype=np.uint8))  # a copy: the map is read-only
    blocks = raw.reshape(rows, cols // block, BLOCK_BYTES[kind])
    group = SUB
    if kind == "Q6_K":  # the blocks as stored
        empty = torch.empty(rows, 0)
        codes, scales, offsets, group = raw.reshape(rows, -1), empty, empty, QK
    elif kind == "Q4_K":
        codes, scales, offsets = _q4_k(blocks)
    else:
        scales = _half(blocks, 0)
        if kind == "Q4_0":
            codes, offsets = blocks[..., 2:], -8.0 * scales
        elif kind == "Q4_1":
            codes, offsets = blocks[..., 4:], _half(blocks, 2)
        else:
            codes, offsets = blocks[..., 2:] ^ 0x80, -128.0 * scales  # int8 q -> q + 128
    packed = [codes.reshape(rows, -1), scales, offsets]
    if tensor.unpermute_heads is not None:  # a permutation of whole rows
        packed = [unpermute_rows(t, tensor.unpermute_heads) for t in packed]
    return IntPacked(packed[0].contiguous(), packed[1].contiguous(), packed[2].contiguous(),
                     bits, group, cols)


def _q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [rows, n, 144] -> (the kernel's nibbles, scales, offsets) in groups of 32.
    The 12 scale bytes (gguf's ``Q4_K.get_scale_min``): bytes 0-3 hold sc[0:4] in their low
    6 bits, 4-7 m[0:4]; sc[4:8] and m[4:8] are bytes 8-11's low and high nibbles, their top
    2 bits in the top 2 bits of bytes 0-3 and 4-7."""
    rows = blocks.shape[0]
    packed = blocks[..., 4:16].reshape(*blocks.shape[:2], 3, 4)
    low, high, split = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([low & 63, (split & 15) | ((low >> 2) & 48)], dim=-1).float()
    mins = torch.cat([high & 63, (split >> 4) | ((high >> 2) & 48)], dim=-1).float()
    scales = (_half(blocks, 0).unsqueeze(-1) * sc).reshape(rows, -1)
    offsets = -(_half(blocks, 2).unsqueeze(-1) * mins).reshape(rows, -1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)  # 4 chunks of 64 columns
    values = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(rows, -1)  # column order
    return pack_int4(values), scales, offsets


def concat(parts: list[IntPacked]) -> IntPacked:
    """Fused parts (q/k/v, gate/up) stacked on the output rows."""
    first = parts[0]
    return IntPacked(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                     torch.cat([p.offsets for p in parts]), first.bits, first.group,
                     first.in_features)


class NativeParts:
    """A fused layer whose parts differ in layout (a Q6_K v beside Q4_K q and k): each part
    multiplied in its own, the outputs side by side. The parts' codes, scales and offsets
    are one flat buffer each (one storage, a view per part per call)."""

    def __init__(self, parts: list[IntPacked]) -> None:
        parts = [compact(part) for part in parts]
        for part in parts:
            part.check()
        self.parts: list[IntPacked] | None = parts

    def register(self, layer: nn.Module) -> None:
        parts = self.parts
        assert parts is not None
        for name in ("codes", "scales", "offsets"):
            flat = torch.cat([getattr(p, name).reshape(-1) for p in parts])
            layer.register_buffer(f"int_packed_{name}", flat)
        # (bits, group, in_features, rows, bytes a row, groups a row) per part
        self.layout = [(p.bits, p.group, p.in_features, p.out_features, p.row_bytes,
                        int(p.scales.shape[1])) for p in parts]
        self.parts = None

    def matmul(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        outs, at_code, at_scale = [], 0, 0
        for bits, group, k, rows, row_bytes, groups in self.layout:
            codes = layer.int_packed_codes[at_code:at_code + rows * row_bytes]
            scales = layer.int_packed_scales[at_scale:at_scale + rows * groups]
            offsets = layer.int_packed_offsets[at_scale:at_scale + rows * groups]
            at_code, at_scale = at_code + rows * row_bytes, at_scale + rows * groups
            outs.append(int_matmul(x, IntPacked(codes.view(rows, row_bytes),
                                                scales.view(rows, groups),
                                                offsets.view(rows, groups), bits, group, k)))
        return torch.cat(outs, dim=-1)


class GgufMethod:
    """``QuantMethod`` for a GGUF file's linear layers (see ``linear_method``)."""

    def create_weights(self, layer: _Linear, prefix: str, slots: dict[object, tuple[int, int]],
                       in_features: int, dtype: torch.dtype, device: torch.device) -> None:
        staged: dict[int, IntPacked | torch.Tensor] = {}  # first row -> the part
        layer.gguf_staged = staged  # type: ignore[assignment]
        layer.gguf_dtype = dtype  # type: ignore[assignment]

        def load(_param: nn.Parameter, tensor: GGUFTensor, shard_id: object) -> None:
            first, rows = slots[shard_id]
            if tensor.shape != (rows, in_features):
                raise QuantizationError(f"{tensor.gguf_name}: shape {tensor.shape}, "
                                        f"{prefix} takes ({rows}, {in_features})")
            staged[first] = gguf_packed(tensor) or tensor.dequantize()

        # an empty placeholder: the loader's bookkeeping needs a parameter per tensor
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device),
                             requires_grad=False)
        param.weight_loader = load  # type: ignore[attr-defined]
        # the loader hands this parameter GGUFTensor as stored, not dequantized values
        param.takes_gguf = True  # type: ignore[attr-defined]
        layer.register_parameter("weight", param)

    def finalize(self, layer: _Linear) -> None:
        from shoal.runtime.model.quant.int_kernels import NativeInt

        staged: dict[int, IntPacked | torch.Tensor] = layer.gguf_staged  # type: ignore[assignment]
        parts = [staged[first] for first in sorted(staged)]
        del layer.gguf_staged, layer._parameters["weight"]
        packed = [p for p in parts if isinstance(p, IntPacked)]
        if len(packed) == len(parts):
            same = len({(p.bits, p.group) for p in packed}) == 1
            kernel = NativeInt(concat(packed)) if same else NativeParts(packed)
            layer.int_kernel = kernel  # type: ignore[assignment]
            kernel.register(layer)
            return
        # mixed types: one dense weight, multiplied like any unquantized layer
        dense = torch.cat([dequantize(p) if isinstance(p, IntPacked) else p for p in parts])
        layer.weight = nn.Parameter(dense.to(layer.gguf_dtype),  # type: ignore[arg-type]
                                    requires_grad=False)
        layer.quant = None

    def apply(self, layer: _Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = layer.int_kernel.matmul(layer, x)  # type: ignore[attr-defined]
        return out if bias is None else out + bias
