"""``--hf-overrides`` (vLLM's flag): a JSON object merged into config.json wherever the engine
reads it. The tiny llama served with its rope theta overridden equals transformers' greedy
output for the checkpoint loaded with the same override, and the override reaches the
engine's model config; bad values are refused naming the flag."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.api.cli import parse_hf_overrides
from shoal.runtime.checkpoint_json import with_overrides
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.model.config import load_model_config
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

from tests.api.conftest import assert_equal_up_to_a_near_tie
from tests.hf_reference import greedy_with_margins

OVERRIDES = {"rope_parameters": {"rope_theta": 50.0}, "rms_norm_eps": 1e-3}


def test_nested_objects_merge_key_by_key_and_the_rest_replaces() -> None:
    raw = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}, "vocab_size": 8,
           "layer_types": ["a", "b"]}
    merged = with_overrides(raw, {"rope_parameters": {"rope_theta": 50.0},
                                  "layer_types": ["c"], "new": 1})
    assert merged == {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50.0},
                      "vocab_size": 8, "layer_types": ["c"], "new": 1}
    assert raw["rope_parameters"]["rope_theta"] == 5e5  # the original is left alone


@pytest.mark.parametrize("text,message", [
    ("{not json", "is not JSON"), ("[1, 2]", "must be a JSON object")])
def test_bad_overrides_are_refused_naming_the_flag(text, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_hf_overrides(text)
    assert "--hf-overrides" in str(info.value)
    assert parse_hf_overrides(None) == {}


def test_overridden_checkpoint_matches_transformers_with_the_same_override(tiny_llama) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = load_model_config(tiny_llama, OVERRIDES)
    assert config.ropes["default"].params["rope_theta"] == 50.0
    assert config.rms_norm_eps == 1e-3
    assert load_model_config(tiny_llama).ropes["default"].params["rope_theta"] == 5e5

    core = EngineCore(EngineConfig.from_kwargs(
        str(tiny_llama), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
        hf_overrides=OVERRIDES))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (40, 60)]
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt,
                                           sampling_params=SamplingParams(
                                               temperature=0.0, max_tokens=10, ignore_eos=True)))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    hf_config = AutoConfig.from_pretrained(tiny_llama)
    hf_config.rope_parameters["rope_theta"] = 50.0
    hf_config.rms_norm_eps = 1e-3
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, config=hf_config,
                                                 dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    differs = False
    for i, prompt in enumerate(prompts):
        want, margins = greedy_with_margins(model, prompt, 10)
        assert_equal_up_to_a_near_tie(outputs[str(i)], want, margins, 1e-4)
        differs |= greedy_with_margins(plain, prompt, 10)[0] != want
    assert differs  # the override changes the model: the test can tell it was applied


def test_overrides_travel_to_the_engine_core_process() -> None:
    """The engine core process decodes its EngineConfig from JSON (core_proc.py)."""
    import msgspec

    config = EngineConfig.from_kwargs("m", hf_overrides=OVERRIDES)
    decoded = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert decoded.hf_overrides == OVERRIDES
