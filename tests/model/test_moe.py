"""The MoE block's parts: config reading and refusals, the routers against transformers' own
gating modules, expert loading from per-expert and fused checkpoint tensors, TP splitting."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from shoal.runtime.attention.selector import get_attention_backend
from shoal.runtime.distributed.shardability import shard_problems
from shoal.runtime.model.config import ModelConfig, load_model_config
from shoal.runtime.model.decoder import DecoderForCausalLM
from shoal.runtime.model.loader import load_weights
from shoal.runtime.model.moe import SparseMoeBlock, expert_checkpoint_target
from shoal.runtime.model.moe_config import MoeConfig, parse_moe_config
from shoal.runtime.model.moe_router import route
from shoal.runtime.model.parallel import ParallelContext

QWEN = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "intermediate_size": 64}


def test_dense_layer_patterns():
    qwen = parse_moe_config({**QWEN, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, "Q")
    assert qwen is not None
    assert [qwen.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    deepseek = parse_moe_config({"model_type": "deepseek_v3", "n_routed_experts": 8,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                 "first_k_dense_replace": 2, "n_shared_experts": 2}, "D")
    assert deepseek is not None
    assert [deepseek.is_sparse(i) for i in range(4)] == [False, False, True, True]
    assert deepseek.scoring == "sigmoid" and deepseek.correction_bias
    assert deepseek.shared_intermediate_size == 32 and not deepseek.shared_expert_gated
    assert parse_moe_config({"model_type": "qwen3", "intermediate_size": 64}, "Q") is None


def test_expert_counts_in_every_spelling():
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        raw = {k: v for k, v in QWEN.items() if k != "num_experts"} | {key: 6}
        config = parse_moe_config(raw, "Q")
        assert config is not None and config.num_experts == 6
    mixtral = parse_moe_config({"model_type": "mixtral", "num_local_experts": 4,
                                "num_experts_per_tok": 2, "intermediate_size": 24}, "M")
    assert mixtral is not None and mixtral.norm_topk_prob and mixtral.intermediate_size == 24


@pytest.mark.parametrize("change,field", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"scoring_func": "sqrtsoftplus"}, "scoring_func='sqrtsoftplus'"),
    ({"n_group": 3}, "n_group=3"),
])
def test_what_cannot_run_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=f"Qwen3MoeForCausalLM: {field}"):
        parse_moe_config({**QWEN, **change}, "Qwen3MoeForCausalLM")


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("n_group,topk_group,norm,scaling",
                         [(1, 1, True, 1.0), (4, 2, True, 2.5), (4, 3, False, 1.5)])
def test_sigmoid_group_limited_router_matches_transformers(family, n_group, topk_group, norm,
                                                           scaling):
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config_class, router_class = {"glm4_moe": (Glm4MoeConfig, Glm4MoeTopkRouter),
                                  "deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter)}[family]
    hf_config = config_class(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                             n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                             routed_scaling_factor=scaling, moe_intermediate_size=8)
    torch.manual_seed(n_group * 10 + topk_group)
    reference = router_class(hf_config)
    with torch.no_grad():
        reference.weight.normal_()
        reference.e_score_correction_bias.normal_(std=0.5)
    moe = parse_moe_config(hf_config.to_dict(), family)
    assert moe is not None and moe.correction_bias
    block = SparseMoeBlock(moe, 32, ParallelContext(), torch.float32, "cpu")
    block.gate.weight.data.copy_(reference.weight)
    assert block.gate.e_score_correction_bias is not None
    block.gate.e_score_correction_bias.data.copy_(reference.e_score_correction_bias)
    x = torch.randn(64, 32)
    _, want_weights, want_ids = reference(x)
    weights, ids = block.gate(x)
    # the same experts with the same weights, in whatever order topk returns them
    want = torch.zeros(64, 16).scatter_(1, want_ids, want_weights)
    got = torch.zeros(64, 16).scatter_(1, ids, weights)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_transformers(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_config = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                               norm_topk_prob=norm, moe_intermediate_size=8)
    reference = Qwen3MoeTopKRouter(hf_config)
    with torch.no_grad():
        reference.weight.normal_()
    moe = parse_moe_config(hf_config.to_dict(), "Qwen3MoeForCausalLM")
    assert moe is not None
    x = torch.randn(20, 32)
    _, want_weights, want_ids = reference(x)
    weights, ids = route(moe, x @ reference.weight.T)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


def test_checkpoint_names_map_to_stacked_experts():
    assert expert_checkpoint_target("model.layers.3.mlp.experts.7.up_proj.weight") == \
        ("model.layers.3.mlp.experts.gate_up_proj", (7, "up"))
    assert expert_checkpoint_target("model.layers.0.block_sparse_moe.experts.2.w2.weight") == \
        ("model.layers.0.mlp.experts.down_proj", (2, "down"))
    assert expert_checkpoint_target("model.layers.0.block_sparse_moe.gate.weight") == \
        ("model.layers.0.mlp.gate.weight", None)
    assert expert_checkpoint_target("model.layers.1.mlp.experts.gate_up_proj") == \
        ("model.layers.1.mlp.experts.gate_up_proj", "fused")
    assert expert_checkpoint_target("model.layers.1.mlp.shared_expert.up_proj.weight") is None
    # a quantized checkpoint's per-expert tensors: the quantized experts' placeholders
    assert expert_checkpoint_target("model.layers.3.mlp.experts.7.up_proj.weight_packed") == \
        ("model.layers.3.mlp.experts.gate_up_proj.weight_packed", (7, "up"))
    assert expert_checkpoint_target("model.layers.0.block_sparse_moe.experts.2.w2.qzeros") == \
        ("model.layers.0.mlp.experts.down_proj.qzeros", (2, "down"))


def _build(model_dir):
    config = load_model_config(model_dir)
    backend = get_attention_backend("torch", torch.device("cpu"), torch.float32)
    model = DecoderForCausalLM(config, ParallelContext(), backend, 64, torch.float32, "cpu")
    load_weights(model, model_dir)
    return model


def _fuse_experts(model_dir, out_dir):
    """The checkpoint with each layer's per-expert tensors stacked into transformers' fused
    in-memory layout (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue
        def stack(proj, prefix=prefix):
            return torch.stack([tensors[f"{prefix}.{e}.{proj}.weight"] for e in range(experts)])
        fused[f"{prefix}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
        fused[f"{prefix}.down_proj"] = stack("down_proj")
    out_dir.mkdir()
    for name in ("config.json", "generation_config.json"):
        (out_dir / name).write_text((model_dir / name).read_text())
    save_file(fused, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def test_fused_and_per_expert_checkpoints_load_the_same_weights(tiny_moe_model_dirs, tmp_path):
    per_expert = tiny_moe_model_dirs["qwen2_moe"]
    _fuse_experts(per_expert, tmp_path / "fused")
    a, b = _build(per_expert), _build(tmp_path / "fused")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    experts = a.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)


def test_a_checkpoint_missing_an_expert_is_refused(tiny_moe_model_dirs, tmp_path):
    source = tiny_moe_model_dirs["mixtral"]
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"mlp.experts.gate_up_proj\[\(5, 'up'\)\]"):
        _build(tmp_path)


def test_tp2_splits_every_experts_intermediate_dim():
    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=12, norm_topk_prob=True,
                    shared_intermediate_size=10, shared_expert_gated=True)
    block = SparseMoeBlock(moe, 16, ParallelContext(rank=1, world_size=2), torch.float32, "cpu")
    assert block.experts.gate_up_proj.shape == (4, 12, 16)
    assert block.experts.down_proj.shape == (4, 16, 6) and block.experts.start == 6
    config = ModelConfig(
        architecture="Qwen2MoeForCausalLM", vocab_size=8, hidden_size=16, num_layers=1,
        num_heads=4, num_kv_heads=4, head_dim=4, intermediate_size=32,
        moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=6, norm_topk_prob=True,
                      shared_intermediate_size=10))
    assert shard_problems(config, 4) == [
        "expert intermediate size 6 does not divide across 4 ranks",
        "shared expert intermediate size 10 does not divide across 4 ranks"]


def _load_into(block: SparseMoeBlock, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """What the loader does for one MoE block's checkpoint tensors."""
    params = dict(block.named_parameters())
    for ckpt_name, tensor in tensors.items():
        name, shard = expert_checkpoint_target(prefix + ckpt_name) or (prefix + ckpt_name, None)
        param = params[name.removeprefix(prefix)]
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
        else:
            loader(param, tensor, shard)


def test_gpt_oss_experts_match_transformers_at_tp1_and_split_over_two_ranks():
    """Clamped SwiGLU with biases, the router's bias and softmax over the chosen k, the
    interleaved [E, in, out] tensors; two ranks' partial sums add up to the whole."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6,
                             num_experts_per_tok=2, swiglu_limit=1.5)
    torch.manual_seed(0)
    reference = GptOssMLP(hf_config)
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(std=0.5)
    moe = parse_moe_config(hf_config.to_dict(), "GptOssForCausalLM")
    assert moe is not None and moe.gpt_oss_swiglu == (1.702, 1.5)
    tensors = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    x = torch.randn(40, 32) * 2  # large enough that the clamps bind
    want, _ = reference(x.unsqueeze(0))

    whole = SparseMoeBlock(moe, 32, ParallelContext(), torch.float32, "cpu")
    _load_into(whole, tensors, "model.layers.0.mlp.")
    torch.testing.assert_close(whole(x), want[0], rtol=1e-5, atol=1e-5)

    partials = []
    for rank in range(2):
        block = SparseMoeBlock(moe, 32, ParallelContext(rank=rank, world_size=2),
                               torch.float32, "cpu")
        _load_into(block, tensors, "model.layers.0.mlp.")
        partials.append(block.experts(x, block.gate(x)))
    torch.testing.assert_close(partials[0] + partials[1], want[0], rtol=1e-5, atol=1e-5)


def test_the_fused_moe_kernel_is_chosen_with_the_other_triton_ops():
    """One rule (ops.choose_kernels): Triton with the triton attention backend on CUDA, so
    --attention-backend torch runs no Triton code; the native experts kernel (float32 and
    bfloat16) with the native cpu backend; torch's grouped GEMM everywhere else."""
    from shoal.runtime.model.ops import Kernels, choose_kernels

    def moe(device, attention):
        return choose_kernels(device, torch.bfloat16, attention, True, True).moe

    assert moe("cuda", "triton") == "triton"
    assert moe("cuda", "torch") == moe("cuda", "flashinfer") == moe("cpu", "torch") == "grouped"
    assert moe("cpu", "cpu") == "native_cpu"
    assert choose_kernels("cpu", torch.float16, "cpu", True, True).moe == "grouped"
    config = MoeConfig(num_experts=4, top_k=2, intermediate_size=8, norm_topk_prob=True)
    assert choose_kernels("cpu", torch.float32, "cpu", True, True).moe == "native_cpu"
    assert choose_kernels("cpu", torch.float32, "torch", True, True).moe == "grouped"
    cpu = Kernels(choose_kernels("cpu", torch.float32, "cpu", True, True))
    assert SparseMoeBlock(config, 16, ParallelContext(), torch.float32, "cpu",
                          cpu).experts.impl == "native_cpu"
