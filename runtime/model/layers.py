"""Position-wise layers: RMSNorm and the rotary tables; their kernels come from ``ops``."""

from __future__ import annotations

import torch
from shoal.runtime.model.ops import Kernels, kernels_for
from shoal.runtime.model.rope import RopeSpec, rope_table, rotate
from torch import nn


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # uninitialised: every parameter is overwritten by the checkpoint loader
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """``weight_offset``: Gemma stores ``scale - 1`` and multiplies by ``1 + weight``; the
    loader adds the offset once, so every norm kernel computes the plain ``x * weight``."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 kernels: Kernels | None = None, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.size = size
        self.weight = _param((size,), dtype, device)
        self.kernels = kernels or kernels_for(device, dtype, "torch")
        if weight_offset:
            def load(param: nn.Parameter, st_slice, _shard: object) -> None:
                tensor = st_slice[:] if not isinstance(st_slice, torch.Tensor) else st_slice
                if tuple(tensor.shape) != (size,):
                    raise ValueError(f"norm weight has shape {tuple(tensor.shape)}, "
                                     f"expected ({size},)")
                param.data.copy_(tensor.float() + weight_offset)

            self.weight.weight_loader = load  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x [..., size]`` normalised. With ``residual`` (the pre-norm residual stream):
        returns ``(norm(x + residual), x + residual)``; the native path updates ``residual``
        in place."""
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """One rope table (``rope.RopeSpec``), precomputed for every position, stored in the
    model dtype; looked up once per step and shared by the layers that use it."""

    def __init__(self, spec: RopeSpec, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str, hf_config=None):
        super().__init__()
        cos, sin = rope_table(spec, hf_config, max_positions)
        self.spec = spec
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    @classmethod
    def default(cls, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype,
                device: torch.device | str) -> RotaryEmbedding:
        """Plain neox rope over whole heads (kernel tests)."""
        spec = RopeSpec(head_dim, {"rope_type": "default", "rope_theta": theta})
        return cls(spec, max_positions, dtype, device)

    def whole_head_neox(self, head_dim: int) -> bool:
        """The layout the fused kernels take: every component rotated, in halves."""
        return not self.spec.interleaved and self.spec.rotary_dim == head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's [T, 1, rotary_dim/2] cos and sin; looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated copies."""
        cos, sin = cos_sin
        interleaved = self.spec.interleaved
        return rotate(q, cos, sin, interleaved), rotate(k, cos, sin, interleaved)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(self.cos_sin(positions), q, k)
