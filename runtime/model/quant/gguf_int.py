"""GGUF linear weights kept quantized: Q4_0, Q4_1 and Q8_0 blocks are the native int
kernel's layout (``shoal.kernels.int_matmul_cpu``) up to where the scales sit.

Each block is 32 weights of one row with an fp16 scale ``d`` (the gguf package's
``quants.py``, the reference transformers dequantizes with):

- Q4_0, 18 bytes: ``d``, 16 bytes of nibbles (weight i low, weight 16 + i high);
  ``W = d * (q - 8)`` -> codes as stored, scale ``d``, offset ``-8 d``;
- Q4_1, 20 bytes: ``d``, ``m``, the same nibbles; ``W = d * q + m`` -> offset ``m``;
- Q8_0, 34 bytes: ``d``, 32 signed bytes; ``W = d * q`` -> codes ``q + 128`` (unsigned, the
  kernel's 8-bit codes), offset ``-128 d``.

``d * q`` is exact in float32 (an 11-bit significand times at most 8 bits) and the kernel
adds the offset with one rounding, so the weights it multiplies equal the gguf package's
dequantized values bit for bit; only the order of the sums differs from a dense matmul.

A layer whose parts are not all one of these types with the same width (a Q6_K or F16 part,
as mixed "_K_M" files have) is dequantized whole into a dense weight, as before.
"""

from __future__ import annotations

import numpy as np
import torch
from shoal.runtime.model.gguf_checkpoint import GGUFTensor, unpermute_rows
from shoal.runtime.model.linear import _Linear
from shoal.runtime.model.quant.spec import QuantizationError
from torch import nn

from shoal.kernels.int_matmul_cpu import SUB, IntPacked, dequantize

KERNEL_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # GGUF type -> the kernel's code width
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as float32 [rows, blocks]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def gguf_packed(tensor: GGUFTensor) -> IntPacked | None:
    """The tensor in the kernel's layout (llama's q/k rows un-permuted), None for a type the
    kernel does not take."""
    bits = KERNEL_TYPES.get(tensor.ggml_type)
    if bits is None or len(tensor.shape) != 2 or tensor.shape[1] % SUB:
        return None
    rows, cols = tensor.shape
    raw = torch.from_numpy(np.array(tensor.blocks, dtype=np.uint8))  # a copy: the map is read-only
    blocks = raw.reshape(rows, cols // SUB, BLOCK_BYTES[tensor.ggml_type])
    scales = _half(blocks, 0)
    if tensor.ggml_type == "Q4_0":
        codes, offsets = blocks[..., 2:], -8.0 * scales
    elif tensor.ggml_type == "Q4_1":
        codes, offsets = blocks[..., 4:], _half(blocks, 2)
    else:
        codes, offsets = blocks[..., 2:] ^ 0x80, -128.0 * scales  # int8 q -> q + 128
    packed = [codes.reshape(rows, -1), scales, offsets]
    if tensor.unpermute_heads is not None:  # a permutation of whole rows
        packed = [unpermute_rows(t, tensor.unpermute_heads) for t in packed]
    return IntPacked(packed[0].contiguous(), packed[1].contiguous(), packed[2].contiguous(),
                     bits, SUB, cols)


def concat(parts: list[IntPacked]) -> IntPacked:
    """Fused parts (q/k/v, gate/up) stacked on the output rows."""
    first = parts[0]
    return IntPacked(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                     torch.cat([p.offsets for p in parts]), first.bits, first.group,
                     first.in_features)


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
        if len(packed) == len(parts) and len({p.bits for p in packed}) == 1:
            layer.int_kernel = NativeInt(concat(packed))  # type: ignore[assignment]
            layer.int_kernel.register(layer)
            return
        # mixed types: one dense weight, multiplied like any unquantized layer
        dense = torch.cat([dequantize(p) if isinstance(p, IntPacked) else p for p in parts])
        layer.weight = nn.Parameter(dense.to(layer.gguf_dtype),  # type: ignore[arg-type]
                                    requires_grad=False)
        layer.quant = None

    def apply(self, layer: _Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = layer.int_kernel.matmul(layer, x)  # type: ignore[attr-defined]
        return out if bias is None else out + bias
