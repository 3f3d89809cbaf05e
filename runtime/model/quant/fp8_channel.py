"""compressed-tensors ``float-quantized`` FP8 weights: ``weight`` float8_e4m3fn [out, in] and
``weight_scale`` float32, one per output channel ([out, 1]) or one per tensor ([1]); ``W =
weight * scale``. Kept FP8 in memory; the matmul is the block path's with one block spanning
the input (``fp8_block.fp8_block_linear``)."""

from __future__ import annotations

import torch
from shoal.runtime.model.linear import _Linear
from shoal.runtime.model.quant.fp8_block import SCALE_DTYPES, fp8_block_linear
from shoal.runtime.model.quant.linear_method import check_tensor, quant_param, total_rows
from shoal.runtime.model.quant.spec import Fp8ChannelScheme


class Fp8ChannelMethod:
    def __init__(self, scheme: Fp8ChannelScheme) -> None:
        self.per_tensor = scheme.per_tensor

    def create_weights(self, layer: _Linear, prefix: str, slots: dict[object, tuple[int, int]],
                       in_features: int, dtype: torch.dtype, device: torch.device) -> None:
        out_rows = total_rows(slots)

        def load_weight(tensor: torch.Tensor, first: int, rows: int, what: str) -> None:
            check_tensor(tensor, (rows, in_features), (torch.float8_e4m3fn,), what)
            layer.weight.data.narrow(0, first, rows).copy_(tensor)

        def load_scale(tensor: torch.Tensor, first: int, rows: int, what: str) -> None:
            if self.per_tensor and tensor.dim() == 0:
                tensor = tensor.reshape(1)
            check_tensor(tensor, (1,) if self.per_tensor else (rows, 1), SCALE_DTYPES, what)
            rows_scale = tensor.float().reshape(-1, 1).expand(rows, 1)
            layer.weight_scale.data.narrow(0, first, rows).copy_(rows_scale)

        quant_param(layer, prefix, "weight", (out_rows, in_features), torch.float8_e4m3fn,
                    device, slots, load_weight)
        # per-tensor scales of fused parts differ: kept one per output row either way
        quant_param(layer, prefix, "weight_scale", (out_rows, 1), torch.float32, device,
                    slots, load_scale)

    def finalize(self, layer: _Linear) -> None:
        pass

    def apply(self, layer: _Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        return fp8_block_linear(x, weight, layer.weight_scale, weight.shape[1], bias)
