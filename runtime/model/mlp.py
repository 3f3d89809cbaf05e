"""The decoder layer's feed-forward slot: what fills it for each layer.

``build_mlp`` is the one place that decides; the dense MLP below is the default. A block
that replaces it (mixture of experts) takes the same ``forward(x [T, hidden]) -> [T, hidden]``
and is chosen here per layer from the config, so the layer itself never changes.
"""

from __future__ import annotations

import torch
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.linear import ColumnParallelLinear, RowParallelLinear
from shoal.runtime.model.moe import SparseMoeBlock
from shoal.runtime.model.ops import Kernels
from shoal.runtime.model.parallel import ParallelContext
from torch import nn


class DenseMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up packed in one matmul (the checkpoint's
    ``gate_proj``/``up_proj``, or Phi-3's and GLM-4's fused ``gate_up_proj``)."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, kernels: Kernels,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        size, bias = config.intermediate_size, config.mlp_bias
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias,
                                                 parallel, dtype, device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, parallel, dtype,
                                           device)
        self.act_fn = kernels.gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class PlainMLP(nn.Module):
    """``down(act(up(x)))``: one input projection, no gate (Arcee's ReLU^2 MLP)."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, kernels: Kernels,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        size, bias = config.intermediate_size, config.mlp_bias
        self.up_proj = ColumnParallelLinear(config.hidden_size, [size], bias, parallel, dtype,
                                            device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, parallel, dtype,
                                           device)
        self.act_fn = kernels.activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def build_mlp(config: ModelConfig, layer_index: int, parallel: ParallelContext,
              kernels: Kernels, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The feed-forward block of layer ``layer_index``: the MoE block where the config's
    sparse-layer pattern puts one, else the dense MLP."""
    if config.moe is not None and config.moe.is_sparse(layer_index):
        return SparseMoeBlock(config.moe, config.hidden_size, parallel, dtype, device, kernels)
    if not config.gated_mlp:
        return PlainMLP(config, parallel, kernels, dtype, device)
    return DenseMLP(config, parallel, kernels, dtype, device)
