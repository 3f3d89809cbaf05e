"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention slot of such a layer.

Per token: queries from ``q_proj`` (or the low-rank ``q_a_proj -> q_a_layernorm ->
q_b_proj`` when ``q_lora_rank`` is set), ``[heads, nope + rope]``; ``kv_a_proj_with_mqa``
gives the latent (``kv_lora_rank``, normalised by ``kv_a_layernorm``) and one rotary key
shared by all heads. Only the latent and the rotated key are cached (mla_config.py); the
per-head keys and values are the latent through ``kv_b_proj``, expanded for prefill or
absorbed into the query and output for decode (``attention/mla_torch.py``).

Tensor parallelism splits the heads: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` by output
rows, ``o_proj`` by input columns; the latent projections are replicated and every rank
caches the same latents (the cache is not split, as vLLM's is not).
"""

from __future__ import annotations

import torch
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.attention.mla_torch import mla_attention
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.layers import RMSNorm, RotaryEmbedding, _param
from shoal.runtime.model.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from shoal.runtime.model.ops import Kernels
from shoal.runtime.model.parallel import ParallelContext
from torch import nn

# transformers builds q_a_layernorm and kv_a_layernorm with the default epsilon, not
# ``rms_norm_eps`` (DeepseekV3RMSNorm(q_lora_rank))
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(nn.Module):
    """``kv_b_proj``, this rank's heads: ``weight [heads * (nope + v), kv_lora_rank]``.
    Not a packed linear layer: decode reads it as per-head matrices (``per_head``), so the
    dense weight must stay (oneDNN packing drops it)."""

    def __init__(self, heads: int, local_heads: int, rows_per_head: int, rank: int,
                 kv_lora_rank: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.local_heads, self.rows_per_head = local_heads, rows_per_head
        self.weight = _param((local_heads * rows_per_head, kv_lora_rank), dtype, device)
        start = rank * local_heads * rows_per_head
        expected = (heads * rows_per_head, kv_lora_rank)

        def load(param: nn.Parameter, st_slice, _shard: object) -> None:
            shape = tuple(st_slice.shape if isinstance(st_slice, torch.Tensor)
                          else st_slice.get_shape())
            if shape != expected:
                raise ValueError(f"kv_b_proj.weight has shape {shape}, expected {expected}")
            param.data.copy_(st_slice[start:start + param.shape[0]])

        self.weight.weight_loader = load  # type: ignore[attr-defined]

    def per_head(self) -> torch.Tensor:
        """``[heads, nope + v, kv_lora_rank]`` (a view)."""
        return self.weight.view(self.local_heads, self.rows_per_head, -1)


class MultiLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, parallel: ParallelContext,
                 rotary: RotaryEmbedding | None, backend: AttentionBackend, kernels: Kernels,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        mla = config.mla
        assert mla is not None
        heads, hidden, world = config.num_heads, config.hidden_size, parallel.world_size
        if heads % world:
            raise ValueError(f"{heads} attention heads do not divide across {world} ranks")
        if rotary is None:
            raise ValueError(f"{config.architecture}: latent attention needs a rope table")
        self.mla, self.rotary, self.backend = mla, rotary, backend
        self.num_heads = heads // world
        self.num_kv_heads = 1  # one latent per token, read by every head
        q_out = [heads * mla.qk_head_dim]
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, False, parallel, dtype, device)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, mla.bias, dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, device,
                                         kernels)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_out, False, parallel,
                                                 dtype, device)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.cache_width, mla.bias, dtype,
                                                   device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, device, kernels)
        self.kv_b_proj = LatentUpProjection(heads, self.num_heads,
                                            mla.qk_nope_head_dim + mla.v_head_dim,
                                            parallel.rank, mla.kv_lora_rank, dtype, device)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, mla.bias, parallel,
                                        dtype, device)

    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, first tensor's width, second's): one latent and one rotary key a token."""
        return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        mla = self.mla
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, :mla.kv_lora_rank].contiguous())
        k_pe = compressed[:, None, mla.kv_lora_rank:]
        if rope is None:
            rope = self.rotary.cos_sin(positions)
        q_pe, k_pe = self.rotary.rotate(rope, q_pe, k_pe)
        out = mla_attention(self.backend, q_nope, q_pe, latent, k_pe[:, 0], kv_cache[0],
                            kv_cache[1], meta, self.kv_b_proj.per_head(), mla.scale)
        return self.o_proj(out.reshape(out.shape[0], -1))
