"""MoeConfig: a mixture-of-experts checkpoint's routing and expert shapes, read from config.json.

One reader for the spellings the families use: ``num_experts`` (Qwen2-MoE, published
Qwen3-MoE), ``num_local_experts`` (Mixtral, and what transformers 5 writes for Qwen3-MoE),
``n_routed_experts`` (DeepSeek, GLM-4.5); dense-layer patterns ``decoder_sparse_step`` +
``mlp_only_layers`` (Qwen) and ``first_k_dense_replace`` (DeepSeek, GLM-4.5). What the model
cannot run is refused here, naming the field, instead of being served wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # one routed expert's
    norm_topk_prob: bool  # renormalise the chosen k weights to sum to 1
    # "softmax", "sigmoid" (DeepSeek-V3 / GLM-4.5) or "topk_softmax" (gpt-oss: the k best
    # logits, then a softmax over those k)
    scoring: str = "softmax"
    n_group: int = 1  # sigmoid: experts fall in n_group groups; topk_group of them compete
    topk_group: int = 1
    correction_bias: bool = False  # sigmoid: e_score_correction_bias shifts the choice only
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared(x)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    first_k_dense_replace: int = 0
    router_bias: bool = False  # gpt-oss
    # gpt-oss experts: (alpha, limit) of the clamped SwiGLU ``(up + 1) * g * sigmoid(alpha * g)``
    # (g = gate clamped above at limit, up clamped to +-limit); biases on both projections;
    # checkpoint tensors [E, in, out] with gate and up columns interleaved
    gpt_oss_swiglu: tuple[float, float] | None = None

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has the MoE block in its MLP slot."""
        if layer in self.mlp_only_layers or layer < self.first_k_dense_replace:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0


def _num_experts(raw: dict) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(key):
            return int(raw[key])
    return 0


def parse_moe_config(raw: dict, architecture: str) -> MoeConfig | None:
    """The MoE settings of a checkpoint's config.json, or None for a dense model."""
    num_experts = _num_experts(raw)
    if num_experts == 0:
        return None
    model_type = raw.get("model_type", "")
    gpt_oss = model_type == "gpt_oss"
    act = raw.get("hidden_act", "silu")
    if act != "silu" and not gpt_oss:
        raise ValueError(f"{architecture}: hidden_act={act!r} is not supported for experts "
                         "(supported: silu)")
    top_k = int(raw["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{architecture}: num_experts_per_tok={top_k} must be in "
                         f"1..{num_experts}")
    # Mixtral's experts are as wide as its (otherwise unused) dense intermediate_size
    size = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
    scoring = "topk_softmax" if gpt_oss else raw.get(
        "scoring_func", "sigmoid" if model_type in ("deepseek_v3", "glm4_moe") else "softmax")
    if scoring not in ("softmax", "sigmoid", "topk_softmax"):
        raise ValueError(f"{architecture}: scoring_func={scoring!r} is not supported "
                         "(supported: softmax, sigmoid)")
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"{architecture}: n_group={n_group}, topk_group={topk_group} do not "
                         f"partition {num_experts} experts")
    shared, gated = 0, False
    if raw.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one gated shared expert
        shared, gated = int(raw["shared_expert_intermediate_size"]), True
    elif raw.get("n_shared_experts"):  # DeepSeek / GLM-4.5: always-on experts, one MLP
        shared = int(raw["n_shared_experts"]) * size
    default_norm = model_type in ("mixtral", "glm4_moe", "deepseek_v3")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=size,
        # Mixtral always renormalises (its config has no such field)
        norm_topk_prob=True if model_type == "mixtral"
        else bool(raw.get("norm_topk_prob", default_norm)),
        scoring=scoring,
        n_group=n_group,
        topk_group=topk_group,
        correction_bias=scoring == "sigmoid" and (
            model_type in ("glm4_moe", "deepseek_v3") or raw.get("topk_method") == "noaux_tc"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_intermediate_size=shared,
        shared_expert_gated=gated,
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        router_bias=gpt_oss,
        gpt_oss_swiglu=(float(raw.get("swiglu_alpha", 1.702)),
                        float(raw.get("swiglu_limit", 7.0))) if gpt_oss else None,
    )
