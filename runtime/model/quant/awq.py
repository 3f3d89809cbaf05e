"""AWQ tensors as AutoAWQ's GEMM kernels take them (``version: gemm``): ``qweight`` int32
[in, out / 8] (eight 4-bit codes per int32 along the output dimension, in AutoAWQ's
interleaved order), ``qzeros`` int32 [groups, out / 8] (same packing), ``scales`` [groups,
out]; ``W = (code - zero) * scale``."""

from __future__ import annotations

import torch
from shoal.runtime.model.quant.int_weight import (
    SCALE_DTYPES,
    IntWeights,
    TensorSpec,
    groups,
    unpack_int32,
)
from shoal.runtime.model.quant.spec import IntWeightScheme, QuantizationError

# the output column each successive 4-bit field of an int32 holds (AutoAWQ's pack order)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def tensor_names(scheme: IntWeightScheme) -> list[str]:
    return ["qweight", "qzeros", "scales"]


def tensor_spec(scheme: IntWeightScheme, name: str, rows: int, in_features: int) -> TensorSpec:
    n_groups = groups(scheme, in_features, name)
    if rows % 8:
        raise QuantizationError(f"awq: {rows} output features do not pack 8 codes to an int32")
    return {
        "qweight": ((in_features, rows // 8), (torch.int32,)),
        "qzeros": ((n_groups, rows // 8), (torch.int32,)),
        "scales": ((n_groups, rows), SCALE_DTYPES),
    }[name]


def part_rows(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor]) -> int:
    return int(tensors["scales"].shape[1])


def unpack(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor], rows: int,
           in_features: int) -> IntWeights:
    codes = unpack_int32(tensors["qweight"], 4, 1, AWQ_ORDER).t().contiguous()
    zeros = unpack_int32(tensors["qzeros"], 4, 1, AWQ_ORDER).t().float().contiguous()
    scales = tensors["scales"].t().float().contiguous()
    if scheme.symmetric:  # zero_point: false; AutoAWQ still writes qzeros (all 8)
        zeros = torch.full_like(scales, 8.0)
    return IntWeights(codes, scales, zeros, 4, scheme.group_size or in_features)
