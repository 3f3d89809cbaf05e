"""quantization_config and --quantization: what is served, what is refused at startup (each
refusal names the method and the reason), and that no quantized tensor ever reaches a
full-precision parameter unscaled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from shoal.runtime.model.quant.spec import (
    Fp8BlockScheme,
    Fp8ChannelScheme,
    IntWeightScheme,
    QuantizationError,
    check_flag,
    parse_quantization,
)

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}


def _ct(weights: dict, fmt: str = "pack-quantized", **extra: object) -> dict:
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": 128, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**base, **weights}, **extra}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def test_schemes_read_from_quantization_config() -> None:
    assert parse_quantization({}) is None
    spec = parse_quantization({"quantization_config": FP8})
    assert spec is not None and spec.scheme == Fp8BlockScheme(128, 128)
    assert spec.ignore == ("lm_head",) and spec.name == "fp8"
    ct = parse_quantization({"quantization_config": _ct({"symmetric": False})})
    assert ct is not None and ct.scheme == IntWeightScheme(4, 128, False, "pack-quantized")
    channel = parse_quantization({"quantization_config": _ct(
        {"num_bits": 8, "strategy": "channel", "group_size": None})})
    assert channel is not None and channel.scheme == IntWeightScheme(8, None, True,
                                                                     "pack-quantized")
    gptq = parse_quantization({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}})
    assert gptq is not None and gptq.scheme == IntWeightScheme(4, 32, True, "gptq", True)
    awq = parse_quantization({"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
        "version": "gemm"}})
    assert awq is not None and awq.scheme == IntWeightScheme(4, 64, False, "awq")
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
            "symmetric": True}
    fp8 = parse_quantization({"quantization_config": _ct(
        {"type": "float", "num_bits": 8, "strategy": "channel", "group_size": None},
        fmt="float-quantized", input_activations=acts)})
    assert fp8 is not None and fp8.scheme == Fp8ChannelScheme(per_tensor=False)
    w8a8 = parse_quantization({"quantization_config": _ct(
        {"num_bits": 8, "strategy": "channel", "group_size": None}, fmt="int-quantized",
        input_activations={**acts, "type": "int"})})
    assert w8a8 is not None and w8a8.scheme == IntWeightScheme(8, None, True, "int-quantized")
    nested = parse_quantization({"text_config": {"quantization_config": FP8}})
    assert nested is not None and nested.method == "fp8"


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported"),
    ({**FP8, "fmt": "e5m2"}, "fp8: fmt 'e5m2' is not supported"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({**FP8, "weight_block_size": None}, "per-tensor FP8 is not served"),
    (_ct({}, fmt="marlin-24"), "format 'marlin-24' is not supported"),
    (_ct({}, input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                "dynamic": True}), "only weight-only schemes"),
    (_ct({"num_bits": 2}), "2-bit weights are not supported"),
    (_ct({"type": "float", "num_bits": 8, "strategy": "channel", "group_size": None},
         fmt="float-quantized", input_activations={"num_bits": 8, "type": "float",
                                                   "strategy": "tensor", "dynamic": False}),
     "activations with dynamic=False are not supported"),
    (_ct({"num_bits": 4, "strategy": "channel", "group_size": None}, fmt="int-quantized"),
     "int-quantized 4-bit channel weights are not supported"),
    (_ct({"strategy": "tensor", "group_size": None}), "strategy 'tensor' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq: 3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"},
     "checkpoint_format 'gptq_v2'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "awq: version 'gemv' is not supported"),
])
def test_unsupported_schemes_are_refused_with_the_reason(qc: dict, message: str) -> None:
    with pytest.raises(QuantizationError, match=message.replace("(", r"\(")):
        parse_quantization({"quantization_config": qc})


def test_quantization_flag_names_or_checks_the_method() -> None:
    spec = parse_quantization({"quantization_config": FP8})
    check_flag(spec, None)
    check_flag(spec, "fp8")
    check_flag(parse_quantization({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128}}), "gptq_marlin")
    with pytest.raises(QuantizationError, match="--quantization awq but the checkpoint is "
                                                "quantized with fp8"):
        check_flag(spec, "awq")
    with pytest.raises(QuantizationError, match="'int3' is not supported"):
        check_flag(spec, "int3")
    with pytest.raises(QuantizationError, match="no quantization_config"):
        check_flag(None, "fp8")


@pytest.fixture(scope="module")
def fp8_dir() -> Path:
    from shoal.runtime.model.make_quant_model import cached_quant_model

    return cached_quant_model("qwen3", "tiny", "fp8-block")


def _copy_with(src: Path, dst: Path, config_change=None, tensors_change=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if config_change:
        config_change(config)
    (dst / "config.json").write_text(json.dumps(config))
    if tensors_change:
        state = load_file(str(dst / "model.safetensors"))
        tensors_change(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


def _build(model_dir: Path, quantization: str | None = None, world: int = 1):
    from shoal.runtime.attention.selector import get_attention_backend
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.loader import build_model
    from shoal.runtime.model.parallel import ParallelContext

    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    backend = get_attention_backend("torch", cpu, torch.float32, config.attention_features)
    return build_model(config, model_dir, backend, ParallelContext(0, world), 64,
                       torch.float32, cpu, quantization=quantization)


def test_fp8_weights_stay_fp8_and_startup_refusals(fp8_dir: Path, tmp_path: Path) -> None:
    model = _build(fp8_dir, "fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.quant is not None
    assert model.lm_head.weight.dtype == torch.float32  # the checkpoint keeps it full
    with pytest.raises(QuantizationError, match="--quantization gptq but the checkpoint is "
                                                "quantized with fp8"):
        _build(fp8_dir, "gptq")
    with pytest.raises(QuantizationError, match="--tensor-parallel-size 1 only"):
        _build(fp8_dir, world=2)

    def drop_config(config: dict) -> None:
        del config["quantization_config"]

    with pytest.raises(QuantizationError, match=r"'model\.layers\.\d\.[\w.]+\.weight' is "
                                                "F8_E4M3, a quantized dtype"):
        _build(_copy_with(fp8_dir, tmp_path / "no_config", drop_config))

    def bad_scale(state: dict) -> None:
        key = "model.layers.1.mlp.down_proj.weight_scale_inv"
        state[key] = state[key][:, :-1].contiguous()

    with pytest.raises(QuantizationError, match=r"down_proj.weight_scale_inv: checkpoint "
                                                r"shape \(2, 3\), expected \(2, 4\)"):
        _build(_copy_with(fp8_dir, tmp_path / "bad_scale", tensors_change=bad_scale))

    def float_weight(state: dict) -> None:
        key = "model.layers.0.self_attn.o_proj.weight"
        state[key] = state[key].float()

    with pytest.raises(QuantizationError, match=r"o_proj.weight: checkpoint dtype torch.float32, "
                                                "expected torch.float8_e4m3fn"):
        _build(_copy_with(fp8_dir, tmp_path / "float_weight", tensors_change=float_weight))


def test_serve_refuses_a_mismatched_flag_before_the_engine_starts(fp8_dir: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "shoal.cli", "serve", "--model", str(fp8_dir),
                             "--quantization", "awq", "--host", "127.0.0.1", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().endswith(
        "shoal serve: --quantization awq but the checkpoint is quantized with fp8")


def test_quantized_experts_refusals_name_the_reason(tmp_path: Path) -> None:
    """What the quantized experts cannot serve is refused at startup with the reason: GPTQ
    act-order experts whose gate and up orders differ, a quantized tensor of the wrong shape, an expert missing a tensor."""
    from shoal.runtime.model.make_quant_model import cached_quant_model

    gptq = cached_quant_model("qwen3_moe", "tiny", "gptq-w4")

    def split_order(state: dict) -> None:  # an act-order expert whose gate and up differ
        key = "model.layers.0.mlp.experts.2.up_proj.g_idx"
        state[key] = state[key].flip(0).contiguous()

    with pytest.raises(QuantizationError, match=r"experts\.2: gate_proj and up_proj have "
                                                r"different g_idx"):
        _build(_copy_with(cached_quant_model("qwen3_moe", "tiny", "gptq-w4-actorder"),
                          tmp_path / "split_order", tensors_change=split_order))

    def short_scales(state: dict) -> None:
        key = "model.layers.1.mlp.experts.5.down_proj.scales"
        state[key] = state[key][:, :-8].contiguous()

    with pytest.raises(QuantizationError, match=r"experts\.5\.down_proj\.scales: checkpoint "
                                                r"shape \(1, 56\), expected \(1, 64\)"):
        _build(_copy_with(gptq, tmp_path / "short", tensors_change=short_scales))

    def drop_expert(state: dict) -> None:
        del state["model.layers.0.mlp.experts.3.up_proj.qzeros"]

    with pytest.raises(ValueError, match=r"lacks weights for: .*experts\.gate_up_proj\.qzeros"
                                         r"\[\(3, 'up'\)\]"):
        _build(_copy_with(gptq, tmp_path / "missing", tensors_change=drop_expert))
