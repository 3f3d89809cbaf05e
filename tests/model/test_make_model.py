"""`shoal make-model` checkpoints: loadable by HF unchanged, deterministic, sized as promised."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open
from shoal.runtime.model import make_model as mm
from shoal.runtime.model.config import load_model_config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_loads_each_tiny_checkpoint_and_its_tokenizer(arch, tiny_model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 1_000_000
    assert n_params == mm.count_params(arch, "tiny")
    text = "def main():\n    return 42\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (ids[0] == mm.BOS_ID) == (arch == "llama")  # only llama's tokenizer adds BOS
    assert len(ids) < len(text)  # merges were learned
    assert max(ids) < model.config.vocab_size


def test_chat_template_renders_chatml_with_generation_prompt(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == mm.IM_START_ID and ids.count(mm.IM_END_ID) == 2
    assert tok.eos_token_id == mm.IM_END_ID


def test_architecture_specifics(tiny_model_dirs, small_qwen3):
    llama = load_model_config(tiny_model_dirs["llama"])
    assert llama.num_kv_heads == 1 and llama.ropes["default"].rope_type == "llama3"
    qwen2 = load_model_config(tiny_model_dirs["qwen2"])
    assert qwen2.tie_word_embeddings and qwen2.qkv_bias and not qwen2.o_proj_bias
    for qwen3 in (load_model_config(tiny_model_dirs["qwen3"]), load_model_config(small_qwen3)):
        assert qwen3.qk_norm == "per_head" and qwen3.head_dim != qwen3.hidden_size // qwen3.num_heads
    assert llama.eos_token_ids == mm.EOS_TOKEN_IDS


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_eos_rows_of_the_output_projection_are_zero(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    name = "model.embed_tokens.weight" if arch == "qwen2" else "lm_head.weight"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        rows = f.get_tensor(name)
    assert torch.count_nonzero(rows[mm.EOS_TOKEN_IDS]) == 0
    assert rows[3:].std() > 0.1  # "confident": initializer range well above HF's 0.02


def test_size_ranges_by_config_count(small_qwen3):
    for arch in mm.ARCHS:
        assert mm.count_params(arch, "tiny") < 1_000_000
        assert 5_000_000 <= mm.count_params(arch, "small") <= 20_000_000
        assert 30_000_000 <= mm.count_params(arch, "bench") <= 60_000_000
        bench = mm.size_spec(arch, "bench")
        assert (bench.hidden_size, bench.num_layers, bench.num_heads, bench.num_kv_heads) == \
            (512, 8, 8, 4) and bench.vocab_size >= 8192
    with safe_open(str(small_qwen3 / "model.safetensors"), "pt") as f:
        total = sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    assert total == mm.count_params("qwen3", "small")


def _numel(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    mm.make_model("qwen2", "tiny", a, seed=7)
    mm.make_model("qwen2", "tiny", b, seed=7)
    mm.make_model("qwen2", "tiny", c, seed=8)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((a / "generation_config.json").read_text())["eos_token_id"] == \
        mm.EOS_TOKEN_IDS


def test_cli_subcommand_writes_a_checkpoint(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="shoal")
    mm.register(parser.add_subparsers())
    out = tmp_path / "m"
    args = parser.parse_args(["make-model", "--arch", "llama", "--size", "tiny", "--out",
                              str(out), "--seed", "3"])
    assert args.func(args) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert "parameters" in capsys.readouterr().out
    with pytest.raises(FileExistsError):
        mm.make_model("llama", "tiny", out)
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", "--arch", "gpt2", "--out", str(out)])


def test_cached_model_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    first = mm.cached_model("llama", "tiny", seed=5)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert first == tmp_path / "models" / f"llama-tiny-s5-v{mm.FORMAT_VERSION}"
    assert mm.cached_model("llama", "tiny", seed=5) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]
    with pytest.raises(ValueError, match="unknown size"):
        mm.cached_model("llama", "huge")
