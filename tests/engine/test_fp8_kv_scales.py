"""KV cache scales from the checkpoint (``model/kv_scales.py``): a checkpoint calibrated for an
FP8 KV cache carries per-layer ``self_attn.k_scale`` / ``v_scale`` (llm-compressor's
``kv_cache_scheme``, ModelOpt, AutoFP8); ``--kv-cache-dtype fp8`` stores ``x / scale``.

The calibrated checkpoint is made here from the tiny Qwen3: HF transformers in float32 runs a
calibration prompt, and each layer's scale is the largest |K| (|V|) its cache holds divided
by e4m3's largest value, 448 (what llm-compressor's static per-tensor observer computes). Served
with the same prompt, every layer's largest stored float8 element must then be 448 itself:
with the scale ignored it would be the largest |K| (a few units), with another scale not 448.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.model.quant.ct_spec import parse_compressed_tensors
from shoal.runtime.model.quant.spec import QuantizationError
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

E4M3_MAX = 448.0
CALIBRATION = [random.Random(5).randrange(3, 1000) for _ in range(48)]


def _hf_cache_amax(model_dir) -> list[tuple[float, float]]:
    """(max |K|, max |V|) per layer of HF's cache after the calibration prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor([CALIBRATION]), use_cache=True).past_key_values
    return [(float(layer.keys.abs().max()), float(layer.values.abs().max()))
            for layer in cache.layers]


def _with_tensors(source, out, extra: dict[str, torch.Tensor]):
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    save_file({**tensors, **extra}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def calibrated(tiny_qwen3, tmp_path_factory):
    amax = _hf_cache_amax(tiny_qwen3)
    scales = [(k / E4M3_MAX, v / E4M3_MAX) for k, v in amax]
    extra = {}
    for i, (k, v) in enumerate(scales):
        extra[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k])
        extra[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    out = _with_tensors(tiny_qwen3, tmp_path_factory.mktemp("kv") / "calibrated", extra)
    return out, scales, amax


def _core(model_dir, kv_cache_dtype: str) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(model_dir), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=32,
        attention_backend="torch", kv_cache_dtype=kv_cache_dtype))


def _prefill(core: EngineCore, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id="p", prompt_token_ids=prompt,
                                       sampling_params=params))
    while core.has_unfinished_requests():
        core.step()


def test_checkpoint_kv_scales_are_what_an_fp8_cache_stores_by(calibrated):
    model_dir, scales, amax = calibrated
    core = _core(model_dir, "fp8")
    layers = core.executor.worker.runner.model.model.layers
    assert [tuple(layer.self_attn.kv_scales.tolist()) for layer in layers] == \
        [(torch.tensor(k).item(), torch.tensor(v).item()) for k, v in scales]
    _prefill(core, CALIBRATION)
    for i, (k_cache, v_cache) in enumerate(core.executor.worker.runner.kv_caches):
        assert k_cache.dtype == torch.float8_e4m3fn
        assert float(k_cache.float().abs().max()) == E4M3_MAX, f"layer {i} K"
        assert float(v_cache.float().abs().max()) == E4M3_MAX, f"layer {i} V"
    assert max(k for k, _ in amax) < E4M3_MAX / 8  # unscaled, the largest would be far below

    auto = _core(model_dir, "auto")  # the cache in the model's dtype: the scales unused
    _prefill(auto, CALIBRATION)
    k_cache = auto.executor.worker.runner.kv_caches[0][0]
    assert k_cache.dtype == torch.float32
    assert float(k_cache.abs().max()) == pytest.approx(amax[0][0], rel=1e-4)


def test_a_single_kv_scale_serves_both_and_per_head_scales_are_refused(tiny_qwen3, tmp_path):
    single = _with_tensors(tiny_qwen3, tmp_path / "single",
                           {"model.layers.0.self_attn.kv_scale": torch.tensor(0.5),
                            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.25])})
    layers = _core(single, "fp8").executor.worker.runner.model.model.layers
    assert layers[0].self_attn.kv_scales.tolist() == [0.5, 0.5]
    assert layers[1].self_attn.kv_scales.tolist() == [0.25, 0.25]  # one given: both (vLLM)

    heads = _with_tensors(tiny_qwen3, tmp_path / "heads",
                          {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(QuantizationError, match="has shape .2,.: only per-tensor KV cache"):
        _core(heads, "fp8")


def test_compressed_tensors_kv_cache_scheme_static_fp8_only():
    def config(kv: dict) -> dict:
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 128, "dynamic": False}}},
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                    "dynamic": False, "symmetric": True, **kv},
                "ignore": ["lm_head"], "quantization_status": "compressed"}

    assert parse_compressed_tensors(config({})).method == "compressed-tensors"
    with pytest.raises(QuantizationError, match="kv_cache_scheme int 8-bit tensor .*only "
                                                "static per-tensor FP8"):
        parse_compressed_tensors(config({"type": "int"}))
    with pytest.raises(QuantizationError, match="kv_cache_scheme float 8-bit attn_head"):
        parse_compressed_tensors(config({"strategy": "attn_head"}))
