"""One decoder-only transformer, assembled from the config's features, not from its name.

What varies between families is a switch in ``ModelConfig`` (read by ``config.py`` from
transformers' config classes, plus ``families.py`` for what only the modeling code says):
where the norms sit (pre, post, sandwich), q/k norms (per head or over the projection),
biases, the activation, embedding / residual / logit multipliers, the attention scale and
logit softcaps, attention sinks, each layer's sliding window and rope table (or none). The feed-forward slot
is filled per layer by ``mlp.build_mlp``. Kernels are chosen once (``ops.Kernels``); no layer
asks which device or backend it runs on.

Batches are flat: ``input_ids[T]`` and ``positions[T]`` hold every scheduled token of every
request; the attention backend finds request boundaries and KV pages in ``AttentionMetadata``.
"""

from __future__ import annotations

import torch
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.attention.kv_cache_dtype import unit_scales
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.layers import RMSNorm, RotaryEmbedding, _param
from shoal.runtime.model.linear import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shoal.runtime.model.mla import MultiLatentAttention
from shoal.runtime.model.mlp import build_mlp
from shoal.runtime.model.ops import Kernels, kernels_for
from shoal.runtime.model.parallel import ParallelContext
from torch import nn

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]  # the step's cos and sin, [T, 1, rotary_dim/2]


class WholeProjectionNorm(nn.Module):
    """OLMo 2's q/k norm: RMS over all heads of the projection, not per head. Under tensor
    parallelism each rank holds some heads, so the sum of squares is all-reduced."""

    def __init__(self, local_size: int, total_size: int, eps: float, parallel: ParallelContext,
                 dtype: torch.dtype, device: torch.device | str, start: int):
        super().__init__()
        self.eps, self.total_size, self.parallel = eps, total_size, parallel
        self.weight = _param((local_size,), dtype, device)

        def load(param: nn.Parameter, st_slice, _shard: object) -> None:
            param.data.copy_(st_slice[start:start + local_size])

        self.weight.weight_loader = load  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, local_size]``."""
        xf = x.float()
        sum_sq = self.parallel.all_reduce(xf.square().sum(-1, keepdim=True))
        return (xf * torch.rsqrt(sum_sq / self.total_size + self.eps)).to(x.dtype) * self.weight


def _sinks(config: ModelConfig, local_heads: int, parallel: ParallelContext,
           device: torch.device | str) -> nn.Parameter:
    """gpt-oss's ``self_attn.sinks``: one logit per query head, this rank's heads, kept in
    float32 whatever the model dtype (they join a float32 softmax)."""
    sinks = _param((local_heads,), torch.float32, device)
    start = parallel.rank * local_heads

    def load(param: nn.Parameter, st_slice, _shard: object) -> None:
        full = st_slice if isinstance(st_slice, torch.Tensor) else st_slice[:]
        if tuple(full.shape) != (config.num_heads,):
            raise ValueError(f"self_attn.sinks has shape {tuple(full.shape)}, expected "
                             f"({config.num_heads},)")
        param.data.copy_(full[start:start + local_heads].float())

    sinks.weight_loader = load  # type: ignore[attr-defined]
    return sinks


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, parallel: ParallelContext,
                 rotary: RotaryEmbedding | None, backend: AttentionBackend, kernels: Kernels,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.head_dim = head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_heads,
                                          config.num_kv_heads, config.qkv_bias, parallel,
                                          dtype, device)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * head_dim, config.hidden_size,
                                        config.o_proj_bias, parallel, dtype, device)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm == "per_head":
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, device, kernels,
                                  config.norm_weight_offset)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, device, kernels,
                                  config.norm_weight_offset)
        elif config.qk_norm == "whole":
            qkv = self.qkv_proj
            self.q_norm = WholeProjectionNorm(qkv.q_size, config.num_heads * head_dim,
                                              config.rms_norm_eps, parallel, dtype, device,
                                              parallel.rank * qkv.q_size)
            self.k_norm = WholeProjectionNorm(qkv.kv_size, config.num_kv_heads * head_dim,
                                              config.rms_norm_eps, parallel, dtype, device,
                                              qkv.kv_head_start * head_dim)
        self.whole_norm = config.qk_norm == "whole"
        self.rotary = rotary
        self.backend = backend
        self.kernels = kernels
        self.scale = config.attention_scale or head_dim ** -0.5
        self.sliding_window = config.layer_windows[layer_index]
        self.softcap = config.attn_logit_softcap
        self.sinks = _sinks(config, self.num_heads, parallel, device) \
            if config.attention_sinks else None
        # (k_scale, v_scale) of a float8 KV cache (kv_cache_dtype.py); unused otherwise
        self.register_buffer("kv_scales", unit_scales(device), persistent=False)
        self.query_beta = config.query_scaling_beta
        self.query_original = config.query_scaling_original
        whole_neox = rotary is not None and rotary.whole_head_neox(head_dim)
        # CUDA: per-head q/k norm + rotary as one Triton kernel per tensor instead of ~12 ops
        self.fused_qk_norm_rotary = kernels.qk_norm_rotary \
            if whole_neox and config.qk_norm == "per_head" else None
        # native CPU: rotary in place, one pass (q's and k's heads side by side in qkv rows)
        self.rotate_in_place = whole_neox and kernels.rotates_in_place
        # native CPU, bfloat16: the per-head q/k norm and the rotary too, in the qkv rows
        self.qk_norm_rotary_in_place = kernels.qk_norm_rotary_in_place \
            if whole_neox and config.qk_norm == "per_head" else None

    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(KV heads on this rank, K width, V width) of one token in this layer's cache."""
        return self.num_kv_heads, self.head_dim, self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rope: RopeTables | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q_flat, k_flat = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        if self.whole_norm:
            assert self.q_norm is not None and self.k_norm is not None
            q_flat, k_flat = self.q_norm(q_flat), self.k_norm(k_flat)
        q = q_flat.reshape(-1, self.num_heads, self.head_dim)
        k = k_flat.reshape(-1, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        per_head_norm = self.q_norm is not None and not self.whole_norm
        if self.rotary is not None and rope is None:
            rope = self.rotary.cos_sin(positions)
        if self.qk_norm_rotary_in_place is not None and rope is not None:
            assert self.q_norm is not None and self.k_norm is not None
            self.qk_norm_rotary_in_place(
                qkv[:, :q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                               self.head_dim),
                self.num_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rope[0][:, 0], rope[1][:, 0])
        elif self.fused_qk_norm_rotary is not None and self.rotary is not None:
            fused, cos, sin = self.fused_qk_norm_rotary, self.rotary.cos, self.rotary.sin
            assert self.q_norm is not None and self.k_norm is not None
            q = fused(q, self.q_norm.weight, positions, cos, sin, self.q_norm.eps)
            k = fused(k, self.k_norm.weight, positions, cos, sin, self.k_norm.eps)
        else:
            if per_head_norm:
                assert self.q_norm is not None and self.k_norm is not None
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None and self.rotary is not None:
                q, k = self._rotate(qkv, q, k, rope, per_head_norm or self.whole_norm)
        if self.query_beta is not None:  # Ministral 3: queries sharpened far into the context
            far = torch.floor(positions.float() / self.query_original)
            q = q * (1 + self.query_beta * torch.log1p(far)).to(q.dtype)[:, None, None]
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   self.sliding_window, self.softcap, self.sinks,
                                   self.kv_scales)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _rotate(self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rope: RopeTables,
                normed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.rotary is not None
        native = self.kernels.native
        if not self.rotate_in_place or native is None:
            return self.rotary.rotate(rope, q, k)
        cos, sin = rope[0][:, 0], rope[1][:, 0]
        if normed:  # q and k are fresh tensors
            native.rotary_neox_(q, cos, sin)
            native.rotary_neox_(k, cos, sin)
        else:  # q's and k's heads sit side by side in each qkv row: one call rotates both
            q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
            heads = self.num_heads + self.num_kv_heads
            native.rotary_neox_(qkv[:, :q_size + kv_size].view(-1, heads, self.head_dim),
                                cos, sin)
        return q, k


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, parallel: ParallelContext,
                 rotary: RotaryEmbedding | None, backend: AttentionBackend, kernels: Kernels,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        lin = config.linear_attn
        # the token mixer, under its checkpoint name: ``linear_attn`` (Gated DeltaNet, state
        # in the layer's ``kv_caches`` slot) or ``self_attn``
        self.mixer_name = "linear_attn" if lin is not None and lin.linear_layers[layer_index] \
            else "self_attn"
        if self.mixer_name == "linear_attn":
            from shoal.runtime.model.gated_deltanet import GatedDeltaNet

            assert lin is not None
            self.linear_attn = GatedDeltaNet(lin, config.hidden_size, config.rms_norm_eps,
                                             parallel, kernels, dtype, device)
        else:
            attention: type[nn.Module] = Attention
            if config.mla is not None:
                attention = MultiLatentAttention
            elif config.attn_output_gate:  # imported here: it subclasses Attention
                from shoal.runtime.model.gated_attention import GatedAttention

                attention = GatedAttention
            self.self_attn = attention(config, layer_index, parallel, rotary, backend, kernels,
                                       dtype, device)
        self.mlp = build_mlp(config, layer_index, parallel, kernels, dtype, device)
        self.rope_key = config.layer_ropes[layer_index]
        self.residual_multiplier = config.residual_multiplier
        # the norms keep their checkpoint names as attributes; ``roles`` says which is which
        self.roles = config.norms
        for name in config.norms.names():
            self.add_module(name, RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                          device, kernels, config.norm_weight_offset))

    def _norm(self, name: str | None) -> RMSNorm | None:
        return None if name is None else getattr(self, name)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: KVCache, meta: AttentionMetadata,
                rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: the previous sub-block's output, not yet added to ``residual`` (layer
        0: the embeddings, ``residual`` None). Returns this layer's (output, residual)."""
        x, residual = _join(self._norm(self.roles.attn_in), hidden, residual)
        mixer = getattr(self, self.mixer_name)
        hidden = self._leave(self._norm(self.roles.attn_out),
                             mixer(positions, x, kv_cache, meta, rope))
        x, residual = _join(self._norm(self.roles.mlp_in), hidden, residual)
        return self._leave(self._norm(self.roles.mlp_out), self.mlp(x)), residual

    def _leave(self, norm: RMSNorm | None, out: torch.Tensor) -> torch.Tensor:
        """A sub-block's output as it joins the residual stream."""
        if norm is not None:
            out = norm(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


def _join(norm: RMSNorm | None, hidden: torch.Tensor, residual: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``hidden`` to the residual stream; return the next sub-block's input (normalised
    if the family normalises inputs) and the stream."""
    if residual is None:
        return (hidden if norm is None else norm(hidden)), hidden
    if norm is None:
        residual = hidden + residual
        return residual, residual
    return norm(hidden, residual)  # the add fused into the norm


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, backend: AttentionBackend,
                 max_positions: int, dtype: torch.dtype, device: torch.device | str,
                 kernels: Kernels):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   parallel, dtype, device)
        self.embed_scale = config.embed_scale
        # one table per distinct rope (Gemma 3: local and global), shared by its layers
        self.rotary = nn.ModuleDict({
            key: RotaryEmbedding(spec, max_positions, dtype, device, config.hf_config)
            for key, spec in config.ropes.items() if key in set(config.layer_ropes)})
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel,
                         self.rotary[key] if key is not None else None, backend, kernels,
                         dtype, device)
            for i, key in enumerate(config.layer_ropes))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, kernels,
                            config.norm_weight_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        # looked up once per step, not once per layer
        ropes: dict[str, RopeTables] = {}
        for key, rotary in self.rotary.items():
            assert isinstance(rotary, RotaryEmbedding)
            ropes[key] = rotary.cos_sin(positions)
        metas, groups = meta.group_metas, meta.layer_group  # several KV cache groups
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, DecoderLayer)
            rope = ropes[layer.rope_key] if layer.rope_key is not None else None
            layer_meta = meta if metas is None else metas[groups[i]]
            hidden, residual = layer(positions, hidden, residual, kv_cache, layer_meta, rope)
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
                 max_positions: int, dtype: torch.dtype, device: torch.device | str,
                 kernels: Kernels | None = None):
        super().__init__()
        self.config = config
        self.kernels = kernels or kernels_for(device, dtype, backend.name)
        self.model = DecoderModel(config, parallel, backend, max_positions, dtype, device,
                                  self.kernels)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel, dtype,
                                      device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = config.final_logit_softcap
        self.logits_divisor = config.logits_divisor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_rows)
        if self.logits_divisor != 1.0:  # Granite
            logits = logits / self.logits_divisor
        if self.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """Every supported architecture is this one decoder; ``config.load_model_config`` has
    already refused the others, naming the field."""
    return DecoderForCausalLM
