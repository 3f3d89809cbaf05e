"""GPTQ tensors as AutoGPTQ / GPTQModel write them (``checkpoint_format: gptq``, v1):
``qweight`` int32 [in * bits / 32, out] (codes packed along the input dimension, lowest bits
first), ``qzeros`` int32 [groups, out * bits / 32] holding zero point minus one, ``scales``
[groups, out], ``g_idx`` int32 [in] (each input column's group; act-order permutes it)."""

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


def tensor_names(scheme: IntWeightScheme) -> list[str]:
    return ["qweight", "qzeros", "scales", "g_idx"]


def tensor_spec(scheme: IntWeightScheme, name: str, rows: int, in_features: int) -> TensorSpec:
    n_groups = groups(scheme, in_features, name)
    per = 32 // scheme.bits
    if in_features % per or rows % per:
        raise QuantizationError(f"gptq: {rows}x{in_features} does not pack {per} codes to "
                                "an int32")
    return {
        "qweight": ((in_features // per, rows), (torch.int32,)),
        "qzeros": ((n_groups, rows // per), (torch.int32,)),
        "scales": ((n_groups, rows), SCALE_DTYPES),
        "g_idx": ((in_features,), (torch.int32, torch.int64)),
    }[name]


def part_rows(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor]) -> int:
    return int(tensors["qweight"].shape[1])


def unpack(scheme: IntWeightScheme, tensors: dict[str, torch.Tensor], rows: int,
           in_features: int) -> IntWeights:
    codes = unpack_int32(tensors["qweight"], scheme.bits, 0).t().contiguous()
    zeros = unpack_int32(tensors["qzeros"], scheme.bits, 1).t().float() + 1  # v1: stored - 1
    scales = tensors["scales"].t().float().contiguous()
    size = scheme.group_size or in_features
    index = tensors["g_idx"].long()
    if int(index.min()) < 0 or int(index.max()) >= scales.shape[1]:
        raise QuantizationError(f"gptq: g_idx outside 0..{scales.shape[1] - 1}")
    trivial = torch.equal(index, torch.arange(in_features) // size)
    return IntWeights(codes, scales, zeros.contiguous(), scheme.bits, size,
                      None if trivial else index)
