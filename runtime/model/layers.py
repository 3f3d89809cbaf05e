"""Position-wise layers: RMSNorm, rotary embedding (default, linear, llama3), SiLU-gated act."""

from __future__ import annotations

import math
from importlib.util import find_spec

import torch
import torch.nn.functional as F
from torch import nn


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # uninitialised: every parameter is overwritten by the checkpoint loader
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def native_cpu_ops(native_cpu: bool):
    """The native CPU position-wise ops (``shoal.kernels.cpu_ops``) when asked for, else None.
    The model asks when its attention backend is the native ``cpu`` one (float32 on CPU, the
    library already loaded); the ``torch`` backend keeps the whole model in plain torch."""
    if not native_cpu:
        return None
    from shoal.kernels import cpu_ops

    return cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 native_cpu: bool = False):
        super().__init__()
        self.eps = eps
        self.size = size
        self.weight = _param((size,), dtype, device)
        self.fused = None  # CUDA: one Triton kernel instead of four ops
        if torch.device(device).type == "cuda" and find_spec("triton"):
            from shoal.kernels.rms_norm import rms_norm

            self.fused = rms_norm
        self.native = native_cpu_ops(native_cpu)  # CPU: residual add + norm in one pass

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x [..., size]`` normalised. With ``residual`` (the pre-norm residual stream):
        returns ``(norm(x + residual), x + residual)``; the native path updates ``residual``
        in place."""
        if residual is None:
            return self._norm(x)
        if self.native is not None and x.dim() == 2:
            return self.native.rms_norm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2:
            return self.native.rms_norm(x, self.weight, self.eps)
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        # half precision: normalise in float32 like the reference implementation, then cast
        normed = F.rms_norm(x.float(), (self.size,), None, self.eps).to(x.dtype)
        return normed * self.weight


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (halves, not interleaved pairs) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's [T, 1, D/2] cos and sin; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
              k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated copies."""
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(self.cos_sin(positions), q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
