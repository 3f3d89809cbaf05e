"""Integer weight-only linear layers (W4A16, W8A16): compressed-tensors ``pack-quantized``,
GPTQ and AWQ checkpoints share everything but their packing.

Loading: each checkpoint tensor of a (possibly fused) layer is checked against the shape and
dtype its format gives (``ct_pack``, ``gptq``, ``awq``) and kept as the checkpoint packed it
until the layer's parts are all read. ``finalize`` unpacks the parts into one ``IntWeights``
(unsigned codes, per-group scales and zero points, GPTQ's group index) and hands it to the
kernel (``int_kernels``), which keeps the weights packed in its own layout and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from shoal.runtime.model.linear import _Linear
from shoal.runtime.model.quant.linear_method import check_tensor, quant_param
from shoal.runtime.model.quant.spec import IntWeightScheme, QuantizationError

TensorSpec = tuple[tuple[int, ...], tuple[torch.dtype, ...]]  # shape, accepted dtypes
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class IntWeights:
    """One layer's weights, unpacked: ``W[r, c] = (codes[r, c] - zeros[r, g]) * scales[r, g]``
    with ``g = group_index[c]`` (``c // group_size`` when None)."""
    codes: torch.Tensor  # uint8 [out, in], in [0, 2**bits)
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # float32 [out, groups]: the unsigned zero point
    bits: int
    group_size: int  # columns per group (in_features for one scale per channel)
    group_index: torch.Tensor | None = None  # int64 [in]: GPTQ act-order's g_idx

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the reference the kernels are tested against."""
        index = self.group_index
        if index is None:
            index = torch.arange(self.codes.shape[1]) // self.group_size
        return (self.codes.float() - self.zeros[:, index]) * self.scales[:, index]


def layout_module(scheme: IntWeightScheme) -> ModuleType:
    if scheme.layout == "pack-quantized":
        from shoal.runtime.model.quant import ct_pack

        return ct_pack
    if scheme.layout == "int-quantized":
        from shoal.runtime.model.quant import ct_int

        return ct_int
    if scheme.layout == "gptq":
        from shoal.runtime.model.quant import gptq

        return gptq
    if scheme.layout == "awq":
        from shoal.runtime.model.quant import awq

        return awq
    raise QuantizationError(f"no loader for the {scheme.layout} layout")


def groups(scheme: IntWeightScheme, in_features: int, what: str) -> int:
    size = scheme.group_size or in_features
    if in_features % size:
        raise QuantizationError(f"{what}: {in_features} input features are not a multiple "
                                f"of group_size {size}")
    return in_features // size


class IntWeightMethod:
    def __init__(self, scheme: IntWeightScheme) -> None:
        self.scheme = scheme
        self.layout = layout_module(scheme)

    def create_weights(self, layer: _Linear, prefix: str, slots: dict[object, tuple[int, int]],
                       in_features: int, dtype: torch.dtype, device: torch.device) -> None:
        groups(self.scheme, in_features, prefix)
        staged: dict[int, dict[str, torch.Tensor]] = {}  # first row -> tensor name -> tensor
        layer.int_staged = staged  # type: ignore[assignment]
        layer.int_in_features = in_features  # type: ignore[assignment]
        layer.int_prefix = prefix  # type: ignore[assignment]
        layer.int_dtype = dtype  # type: ignore[assignment]
        for name in self.layout.tensor_names(self.scheme):
            def load(tensor: torch.Tensor, first: int, rows: int, what: str,
                     name: str = name) -> None:
                shape, dtypes = self.layout.tensor_spec(self.scheme, name, rows, in_features)
                check_tensor(tensor, shape, dtypes, what)
                staged.setdefault(first, {})[name] = tensor.to(device).clone()

            # an empty placeholder: the loader's bookkeeping needs a parameter per tensor
            quant_param(layer, prefix, name, (0,), torch.uint8, device, slots, load)
        layer.int_names = tuple(self.layout.tensor_names(self.scheme))  # type: ignore[assignment]

    def finalize(self, layer: _Linear) -> None:
        from shoal.runtime.model.quant.int_kernels import int_kernel

        staged: dict[int, dict[str, torch.Tensor]] = layer.int_staged  # type: ignore[assignment]
        parts = []
        for first in sorted(staged):
            tensors = staged[first]
            rows = self.layout.part_rows(self.scheme, tensors)
            parts.append(self.layout.unpack(self.scheme, tensors, rows, layer.int_in_features))
        weights = concat_parts(parts, layer.int_prefix)  # type: ignore[arg-type]
        for name in layer.int_names:  # type: ignore[attr-defined]
            del layer._parameters[name]
        del layer.int_staged
        layer.int_kernel = int_kernel(weights, layer.int_dtype)  # type: ignore[assignment]
        layer.int_kernel.register(layer)

    def apply(self, layer: _Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = layer.int_kernel.matmul(layer, x)  # type: ignore[attr-defined]
        return out if bias is None else out + bias


def concat_parts(parts: list[IntWeights], what: str) -> IntWeights:
    """q/k/v (gate/up) parts stacked on the output rows; they share the input, and so GPTQ's
    act-order group index (the same activations order the columns)."""
    first = parts[0]
    for part in parts[1:]:
        a, b = part.group_index, first.group_index
        same_index = (a is None and b is None) or (
            a is not None and b is not None and torch.equal(a, b))
        if not same_index:
            raise QuantizationError(f"{what}: fused parts have different g_idx")
    if len(parts) == 1:
        return first
    return IntWeights(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.zeros for p in parts]), first.bits, first.group_size,
                      first.group_index)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None
                 ) -> torch.Tensor:
    """Codes packed ``32 // bits`` to an int32 along ``dim``, lowest bits first (GPTQ, AWQ);
    ``order``: the column each successive field holds (AWQ interleaves). uint8 out."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    fields = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
    if order is not None:
        fields = fields[..., torch.tensor(order).argsort()]
    codes = fields.reshape(*moved.shape[:-1], moved.shape[-1] * per)
    return codes.to(torch.uint8).movedim(-1, dim)
