"""compressed-tensors ``int-quantized`` tensors (W8A8's weights): ``weight`` int8 [out, in],
``weight_scale`` [out, 1]; ``W = weight * scale`` (symmetric)."""

from __future__ import annotations

import torch
from shoal.runtime.model.quant.int_weight import SCALE_DTYPES, IntWeights, TensorSpec
from shoal.runtime.model.quant.spec import IntWeightScheme


def tensor_names(scheme: IntWeightScheme) -> list[str]:
    return ["weight", "weight_scale"]


def tensor_spec(scheme: IntWeightScheme, name: str, rows: int, in_features: int) -> TensorSpec:
    return {"weight": ((rows, in_features), (torch.int8,)),
            "weight_scale": ((rows, 1), SCALE_DTYPES)}[name]


def part_rows(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor]) -> int:
    return int(tensors["weight"].shape[0])


def unpack(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor], rows: int,
           in_features: int) -> IntWeights:
    scales = tensors["weight_scale"].float()
    codes = (tensors["weight"].to(torch.int16) + 128).to(torch.uint8)
    return IntWeights(codes, scales, torch.full_like(scales, 128.0), 8, in_features)
