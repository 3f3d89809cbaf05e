"""One decoder-only transformer covering Llama 2/3, Mistral, Qwen2 and Qwen3.

The differences are config switches, not classes: qkv bias (Qwen2), q/k RMSNorm and an
explicit head_dim (Qwen3), tied embeddings, rope scaling, sliding window (Mistral). Batches
are flat: ``input_ids[T]`` and ``positions[T]`` hold every scheduled token of every request;
the attention backend finds request boundaries and KV pages in ``AttentionMetadata``.
"""

from __future__ import annotations

from importlib.util import find_spec

import torch
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    native_cpu_ops,
    silu_and_mul,
)
from shoal.runtime.model.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shoal.runtime.model.moe import SparseMoeBlock
from shoal.runtime.model.parallel import ParallelContext
from torch import nn

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]  # the step's cos and sin, [T, 1, head_dim/2]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, rotary: RotaryEmbedding,
                 backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str,
                 native_cpu: bool = False):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.attention_bias, parallel,
                                          dtype, device)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        False, parallel, dtype, device)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) \
            if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) \
            if config.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.native = native_cpu_ops(native_cpu)  # CPU: rotary in place, one pass
        self.scale = config.head_dim ** -0.5
        self.sliding_window = config.sliding_window
        # CUDA: q/k norm + rotary as one Triton kernel per tensor instead of ~12 small ops
        self.fused_qk_norm_rotary = None
        if config.qk_norm and torch.device(device).type == "cuda" and find_spec("triton"):
            from shoal.kernels.qk_norm_rotary import qk_norm_rotary

            self.fused_qk_norm_rotary = qk_norm_rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rope: RopeTables | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.fused_qk_norm_rotary is not None and self.q_norm is not None \
                and self.k_norm is not None:
            fused, cos, sin = self.fused_qk_norm_rotary, self.rotary.cos, self.rotary.sin
            q = fused(q, self.q_norm.weight, positions, cos, sin, self.q_norm.eps)
            k = fused(k, self.k_norm.weight, positions, cos, sin, self.k_norm.eps)
        elif self.native is not None:
            cos, sin = (table[:, 0] for table in rope or self.rotary.cos_sin(positions))
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
                self.native.rotary_neox_(q, cos, sin)
                self.native.rotary_neox_(k, cos, sin)
            else:  # q's and k's heads sit side by side in each qkv row: one call rotates both
                heads = self.num_heads + self.num_kv_heads
                self.native.rotary_neox_(qkv[:, :q_size + kv_size].view(-1, heads, self.head_dim),
                                         cos, sin)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.rotate(rope or self.rotary.cos_sin(positions), q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   self.sliding_window)
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype,
                 device: torch.device | str, native_cpu: bool = False):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], False,
                                                 parallel, dtype, device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, parallel, dtype,
                                           device)
        self.act_fn = silu_and_mul  # CUDA: one Triton kernel instead of two ops; CPU: one pass
        if torch.device(device).type == "cuda" and find_spec("triton"):
            from shoal.kernels.silu_and_mul import silu_and_mul as fused_silu_and_mul

            self.act_fn = fused_silu_and_mul
        native = native_cpu_ops(native_cpu)
        if native is not None:
            self.act_fn = native.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, rotary: RotaryEmbedding,
                 backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str,
                 native: bool = False, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(config, parallel, rotary, backend, dtype, device, native)
        self.mlp: nn.Module = MLP(config, parallel, dtype, device, native)
        if config.moe is not None and config.moe.is_sparse(layer):  # the MoE block's slot
            self.mlp = SparseMoeBlock(config.moe, config.hidden_size, parallel, dtype, device,
                                      native)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device,
                                       native)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                device, native)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: KVCache, meta: AttentionMetadata,
                rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: the previous layer's output (layer 0: the embeddings, ``residual`` None);
        ``residual``: the stream it is added to. Returns this layer's (output, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, backend: AttentionBackend,
                 max_positions: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   parallel, dtype, device)
        # one table shared by all layers; computed in float32, stored in the model dtype
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                 config.rope_scaling, dtype, device)
        self.rotary = rotary
        # the native cpu attention backend brings the native position-wise ops along
        native = backend.name == "cpu"
        self.layers = nn.ModuleList(
            DecoderLayer(config, parallel, rotary, backend, dtype, device, native, layer)
            for layer in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, native)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.cos_sin(positions)  # looked up once per step, not once per layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, rope)
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, parallel: ParallelContext, backend: AttentionBackend,
                 max_positions: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, parallel, backend, max_positions, dtype, device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel, dtype,
                                      device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_rows)


MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "MixtralForCausalLM": DecoderForCausalLM,
    "Qwen2MoeForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": DecoderForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
