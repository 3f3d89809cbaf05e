"""compressed-tensors ``pack-quantized`` tensors: ``weight_packed`` (int32, codes packed along
the input dimension, signed codes offset by 2**(bits-1)), ``weight_scale`` [out, groups],
``weight_zero_point`` (asymmetric only; int32 packed along the output dimension) and
``weight_shape``. Unpacked with compressed-tensors' own ``unpack_from_int32``."""

from __future__ import annotations

import torch
from shoal.runtime.model.quant.int_weight import SCALE_DTYPES, IntWeights, TensorSpec, groups
from shoal.runtime.model.quant.spec import IntWeightScheme


def tensor_names(scheme: IntWeightScheme) -> list[str]:
    names = ["weight_packed", "weight_scale", "weight_shape"]
    return names if scheme.symmetric else [*names, "weight_zero_point"]


def tensor_spec(scheme: IntWeightScheme, name: str, rows: int, in_features: int) -> TensorSpec:
    n_groups = groups(scheme, in_features, name)
    words = -(-in_features * scheme.bits // 32)
    return {
        "weight_packed": ((rows, words), (torch.int32,)),
        "weight_scale": ((rows, n_groups), SCALE_DTYPES),
        "weight_shape": ((2,), (torch.int64, torch.int32)),
        "weight_zero_point": ((-(-rows * scheme.bits // 32), n_groups), (torch.int32,)),
    }[name]


def part_rows(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor]) -> int:
    return int(tensors["weight_packed"].shape[0])


def unpack(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor], rows: int,
           in_features: int) -> IntWeights:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from shoal.runtime.model.quant.spec import QuantizationError

    shape = [int(v) for v in tensors["weight_shape"].tolist()]
    if shape != [rows, in_features]:
        raise QuantizationError(f"weight_shape {shape} does not match the layer's "
                                f"[{rows}, {in_features}]")
    offset = 1 << (scheme.bits - 1)
    codes = unpack_from_int32(tensors["weight_packed"], scheme.bits, torch.Size(shape))
    scales = tensors["weight_scale"].float()
    if scheme.symmetric:
        zeros = torch.full_like(scales, float(offset))
    else:
        zero = unpack_from_int32(tensors["weight_zero_point"], scheme.bits,
                                 torch.Size(scales.shape), packed_dim=0)
        zeros = zero.float() + offset
    return IntWeights((codes.to(torch.int16) + offset).to(torch.uint8), scales, zeros,
                      scheme.bits, scheme.group_size or in_features)
