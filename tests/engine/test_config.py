"""EngineConfig checks itself: every ranged field is refused out of range wherever the
config is built (kwargs, ``replace``, ``shoal serve``'s flags), naming the field or flag."""

from __future__ import annotations

import subprocess
import sys

import pytest
from shoal.runtime.config import RANGES, ConfigRangeError, EngineConfig


def out_of_range(name: str) -> float:
    low, _high, low_allowed = RANGES[name]
    return low - 1 if low_allowed else low


@pytest.mark.parametrize("name", sorted(RANGES))
def test_each_ranged_field_is_refused_out_of_range_naming_it(name):
    with pytest.raises(ConfigRangeError, match=rf"^{name} must be ") as err:
        EngineConfig(model="m", **{name: out_of_range(name)})
    assert err.value.field == name
    with pytest.raises(ConfigRangeError, match=rf"^{name} must be "):
        EngineConfig(model="m").replace(**{name: out_of_range(name)})


def test_bounds_themselves_and_unset_values_are_accepted():
    config = EngineConfig(model="m", max_num_seqs=1, max_model_len=2, gpu_memory_utilization=1.0,
                          max_logprobs=0, num_kv_blocks=None, kv_cache_memory=None)
    assert config.max_model_len == 2
    with pytest.raises(ConfigRangeError, match="gpu_memory_utilization must be at most 1.0"):
        config.replace(gpu_memory_utilization=1.5)


def test_shoal_serve_names_the_flag_before_starting_anything(tiny_qwen3):
    result = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "serve", "--model", str(tiny_qwen3),
         "--port", "0", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "shoal serve: --max-num-seqs must be at least 1, got 0" in result.stderr


@pytest.mark.parametrize("text,message", [
    ("{", "--pooler-config is not JSON"), ("[1]", "--pooler-config must be a JSON object"),
    ('{"pooling_typ": "MEAN"}', r"--pooler-config: unknown key\(s\) pooling_typ \(known: "),
    ('{"pooling_type": "MAX"}', "pooling type 'MAX' is not one of LAST, MEAN, CLS"),
])
def test_a_bad_pooler_config_is_refused_naming_the_flag(tmp_path, text, message):
    """The JSON-object flags (--pooler-config, --kv-events-config) share one parser: the
    same messages, each naming its own flag (the kv-events cases: tests/api/test_kv_events.py)."""
    from shoal.runtime.pooling_config import load_pooler_config

    with pytest.raises(ValueError, match=message):
        load_pooler_config(tmp_path, text)


@pytest.mark.parametrize("mode,normalize,expected", [
    ("pooling_mode_mean_tokens", False, ("MEAN", False)),
    ("pooling_mode_lasttoken", True, ("LAST", True)),
    ("pooling_mode_cls_token", True, ("CLS", True)),
])
def test_pooling_is_what_the_sentence_transformers_modules_say(tmp_path, mode, normalize,
                                                               expected):
    """modules.json's Pooling module (its config's pooling_mode_*) and whether a Normalize
    module follows decide the pooling, as sentence-transformers applies them."""
    import json

    from shoal.runtime.pooling_config import load_pooler_config

    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 16, **dict.fromkeys(
            ("pooling_mode_mean_tokens", "pooling_mode_lasttoken", "pooling_mode_cls_token"),
            False), mode: True}))
    config = load_pooler_config(tmp_path, None)
    assert (config.pooling_type, config.normalize) == expected
    assert not config.matryoshka  # no is_matryoshka: a request may not ask for dimensions


def test_the_api_process_reads_the_checkpoint_without_torch(tiny_qwen3, tmp_path):
    """``shoal serve`` decides the runner and the chat format from config.json read as JSON
    (overrides merged): its API process imports neither torch nor transformers for it
    (runtime/checkpoint_json.py). The same answers as the model config's, the same
    refusals."""
    from shoal.runtime.checkpoint_json import architecture_and_model_type
    from shoal.runtime.model.config import load_model_config

    code = ("import sys; from shoal.runtime.checkpoint_json import architecture_and_model_type; "
            f"print(*architecture_and_model_type({str(tiny_qwen3)!r}, {{'model_type': 'x'}})); "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    config = load_model_config(tiny_qwen3)
    assert done.stdout.split("\n")[:2] == [f"{config.architecture} x", "[]"]
    assert architecture_and_model_type(tiny_qwen3) == (config.architecture, config.model_type)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        architecture_and_model_type(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="'architectures' is missing"):
        architecture_and_model_type(tmp_path)
