"""The feature-built decoder's decisions, without running a model: refusals at startup that
name the architecture and the field, the kernel choice per device and dtype, the attention
backend routed by the features a model needs, and rope tables equal to transformers' own."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from shoal.runtime.attention.backend_choice import choose_attention_backend
from shoal.runtime.model.config import load_model_config
from shoal.runtime.model.ops import choose_kernels


@pytest.fixture(scope="module")
def edited(tmp_path_factory, tiny_model_dirs):
    """edited(**fields) -> a copy of tiny llama's checkpoint with config.json fields changed
    (None deletes one)."""
    base = tiny_model_dirs["llama"]

    def make(**fields):
        out = tmp_path_factory.mktemp("edited")
        shutil.copy(base / "config.json", out / "config.json")
        raw = json.loads((out / "config.json").read_text())
        for key, value in fields.items():
            if value is None:
                raw.pop(key, None)
            else:
                raw[key] = value
        (out / "config.json").write_text(json.dumps(raw))
        return out

    return make


@pytest.mark.parametrize("fields,message", [
    ({"architectures": ["BertModel"]}, r"unsupported architecture 'BertModel' \(config.json "
                                       r"'architectures'\)"),
    ({"architectures": ["FooForCausalLM"], "model_type": "foo"},
     r"unsupported architecture 'FooForCausalLM'.*transformers cannot read"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     r"unsupported architecture 'GPT2LMHeadModel'"),
    ({"architectures": ["StableLmForCausalLM"], "model_type": "stablelm"},
     r"unsupported architecture 'StableLmForCausalLM': model_type 'stablelm' is not one of"),
    ({"hidden_act": "gelu_10"}, r"LlamaForCausalLM: hidden_act='gelu_10' is not supported"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0}},
     r"LlamaForCausalLM: rope_type 'proportional' in 'rope_parameters' is not supported"),
    ({"layer_types": ["chunked_attention", "full_attention"]},
     r"LlamaForCausalLM: 'layer_types' \['chunked_attention'\] not supported"),
])
def test_unsupported_models_are_refused_naming_the_architecture_and_field(edited, fields,
                                                                         message):
    with pytest.raises(ValueError, match=message):
        load_model_config(edited(**fields))


def test_a_nested_text_config_is_read_and_its_weights_unwrapped():
    from shoal.runtime.model.make_family_model import cached_family_model

    config = load_model_config(cached_family_model("gemma3_nested"))
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.model_type == "gemma3_text" and config.weight_prefix == "language_model"
    assert config.layer_windows == (16, None) and config.norm_weight_offset == 1.0
    assert set(config.ropes) == {"sliding_attention", "full_attention"}


@pytest.mark.parametrize("device,dtype,attention,triton,expected", [
    ("cpu", torch.float32, "cpu", False, ("native_cpu", "native_cpu", "torch", "onednn")),
    ("cpu", torch.float32, "torch", False, ("torch", "torch", "torch", "onednn")),
    ("cpu", torch.bfloat16, "torch", True, ("torch", "torch", "torch", "torch")),
    ("cpu", torch.bfloat16, "cpu", False, ("native_cpu", "native_cpu", "native_cpu", "native_bf16")),
    ("cuda", torch.bfloat16, "triton", True, ("triton", "triton", "triton", "torch")),
    ("cuda", torch.bfloat16, "torch", True, ("torch", "torch", "torch", "torch")),
])
def test_kernels_are_chosen_once_per_device_dtype_and_backend(device, dtype, attention, triton,
                                                              expected):
    choice = choose_kernels(device, dtype, attention, triton, onednn_available=True)
    assert (choice.norm, choice.silu_and_mul, choice.qk_norm_rotary, choice.linear) == expected


def test_linear_layers_take_the_panels_only_on_the_native_cpu_path_where_faster():
    def panels(device, dtype, attention, faster=True):
        return choose_kernels(device, dtype, attention, False, True,
                              panels_faster=faster).linear_panels

    assert panels("cpu", torch.float32, "cpu") and panels("cpu", torch.bfloat16, "cpu")
    assert not panels("cpu", torch.float32, "cpu", faster=False)  # oneDNN stays
    assert not panels("cpu", torch.float32, "torch")  # the plain-torch reference
    assert not panels("cpu", torch.float16, "cpu")
    assert not panels("cuda", torch.bfloat16, "cpu")


def test_a_backend_lacking_a_feature_the_model_needs_is_passed_over_or_refused(caplog,
                                                                             monkeypatch):
    from shoal.runtime.attention import backend_choice

    features = dict(backend_choice.BACKEND_FEATURES)
    # every backend auto picks implements what the models here need: a feature only torch
    # has shows the rule
    monkeypatch.setitem(backend_choice.BACKEND_FEATURES, "torch", features["torch"] | {"new"})
    needs = frozenset({"new", "sliding_window"})
    with caplog.at_level("WARNING"):
        assert choose_attention_backend("auto", "cuda", False, True, needs=needs) == "torch"
        assert choose_attention_backend("auto", "cpu", False, True, cpu_kernel=None,
                                        needs=needs) == "torch"
    assert "triton passed over: the model needs new" in caplog.text
    assert "cpu passed over: the model needs new" in caplog.text
    with pytest.raises(ValueError, match="the triton attention backend does not implement "
                                         "new.*backends that do: torch"):
        choose_attention_backend("triton", "cpu", False, True, triton_interpreted=True,
                                 needs=needs)
    sinks = frozenset({"sinks", "softcap", "sliding_window"})
    assert choose_attention_backend("auto", "cuda", False, True, needs=sinks) == "triton"
    with pytest.raises(ValueError, match="the flashinfer attention backend does not implement "
                                         "sinks"):
        choose_attention_backend("flashinfer", "cuda", True, True, needs=sinks)


def test_gpt_oss_config_reads_sinks_windows_yarn_and_its_router(tiny_moe_model_dirs):
    config = load_model_config(tiny_moe_model_dirs["gpt_oss"])
    assert config.architecture == "GptOssForCausalLM" and config.attention_sinks
    assert config.attention_features == {"sinks", "sliding_window"}
    assert config.layer_windows == (16, None) and config.sliding_window is None
    assert config.qkv_bias and config.o_proj_bias
    assert config.ropes["default"].rope_type == "yarn"
    assert config.moe is not None and config.moe.scoring == "topk_softmax"
    assert config.moe.router_bias and config.moe.gpt_oss_swiglu == (1.702, 1.5)


def test_an_mxfp4_gpt_oss_config_is_read_as_experts_dequantized_at_load(tiny_moe_model_dirs,
                                                                       tmp_path):
    """Published gpt-oss checkpoints ship MXFP4 experts: served by dequantizing them as they
    are read (tests/engine/test_mxfp4_gpt_oss.py)."""
    from shoal.runtime.model.quant.spec import Mxfp4Scheme

    raw = json.loads((tiny_moe_model_dirs["gpt_oss"] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = load_model_config(tmp_path).quantization
    assert spec is not None and spec.method == "mxfp4" and spec.scheme == Mxfp4Scheme()


def test_gpt_oss_yarn_table_equals_transformers_rotary_embedding(tiny_moe_model_dirs):
    from shoal.runtime.model.layers import RotaryEmbedding
    from transformers import AutoModelForCausalLM

    model_dir = tiny_moe_model_dirs["gpt_oss"]
    config = load_model_config(model_dir)
    ours = RotaryEmbedding(config.ropes["default"], 256, torch.float32, "cpu",
                           config.hf_config)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.rotary_emb
    positions = torch.arange(0, 256)
    cos, sin = hf(torch.zeros(1, 1, config.head_dim), positions[None, :])
    half = ours.cos.shape[1]
    torch.testing.assert_close(ours.cos[positions], cos[0, :, :half])
    torch.testing.assert_close(ours.sin[positions], sin[0, :, :half])


@pytest.mark.parametrize("family,layer_type", [("phi3_longrope", None),
                                               ("qwen2_yarn", None),
                                               ("gemma3", "full_attention")])
def test_rope_tables_equal_transformers_rotary_embedding(family, layer_type):
    """Our per-position table against the HF model's own rotary module: longrope's short
    factors below the original context and, past it, the long ones HF switches to."""
    from shoal.runtime.model.layers import RotaryEmbedding
    from shoal.runtime.model.make_family_model import cached_family_model
    from transformers import AutoModelForCausalLM

    model_dir = cached_family_model(family)
    config = load_model_config(model_dir)
    key = layer_type or "default"
    ours = RotaryEmbedding(config.ropes[key], 512, torch.float32, "cpu", config.hf_config)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.rotary_emb
    kwargs = {"layer_type": layer_type} if layer_type else {}
    x = torch.zeros(1, 1, config.head_dim)
    for positions in (torch.arange(0, 200), torch.arange(300, 400)):
        cos, sin = hf(x, positions[None, :], **kwargs)  # HF: from max(positions) + 1
        half = ours.cos.shape[1]
        torch.testing.assert_close(ours.cos[positions], cos[0, :, :half])
        torch.testing.assert_close(ours.sin[positions], sin[0, :, :half])
