"""A Qwen3-0.6B-shaped checkpoint with random weights, written once per machine.

Built with transformers' own Qwen3 classes (present on the GPU machine) on the device
itself, so nothing is downloaded; no tokenizer is written, the benchmark speaks token ids.
Should that fail (another transformers version), the same HF-named tensors and config are
written directly with safetensors. ``--smoke`` uses a tiny shape with the same architecture.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from common import log

# Qwen3-0.6B's published shape
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                  max_position_embeddings=40960, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128,
            max_position_embeddings=4096, tie_word_embeddings=True)
EOS_TOKEN_ID = 2
# Qwen3-8B's published shape: measured with --load-format dummy, from config.json alone
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                max_position_embeddings=40960, tie_word_embeddings=False)


def config_only_dir(shape: dict, name: str) -> Path:
    """A model folder holding only a Qwen3 config.json (weights come from --load-format dummy)."""
    out = Path(tempfile.gettempdir()) / f"shoal-bench-config-{name}"
    out.mkdir(parents=True, exist_ok=True)
    config = dict(shape, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                  rms_norm_eps=1e-6, rope_theta=1e6, torch_dtype="bfloat16", hidden_act="silu",
                  bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, attention_bias=False,
                  use_sliding_window=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def model_dir(smoke: bool) -> Path:
    default = Path(tempfile.gettempdir()) / ("shoal-bench-qwen3-tiny" if smoke else "shoal-bench-qwen3-0.6b")
    return Path(os.environ.get("SHOAL_BENCH_MODEL_DIR", default))


def ensure_checkpoint(smoke: bool) -> Path:
    out = model_dir(smoke)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    shape = TINY if smoke else QWEN3_0_6B
    dtype = torch.float32 if smoke else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"building a random {'tiny' if smoke else 'Qwen3-0.6B'}-shaped checkpoint on {device}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="shoal-ckpt-", dir=out.parent))
    try:
        if os.environ.get("SHOAL_BENCH_CHECKPOINT") == "direct":
            raise RuntimeError("direct checkpoint writer requested")
        _write_with_transformers(staging, shape, dtype, device)
    except Exception as exc:  # noqa: BLE001 - any transformers trouble: write it ourselves
        log(f"transformers checkpoint failed ({type(exc).__name__}: {exc}); writing it directly")
        shutil.rmtree(staging)
        staging.mkdir()
        write_direct(staging, shape, dtype, device)
    gen_path = staging / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    generation["eos_token_id"] = [EOS_TOKEN_ID]
    gen_path.write_text(json.dumps(generation))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)  # atomic: a half-written checkpoint is never reused
    return out


def _write_with_transformers(staging: Path, shape: dict, dtype: torch.dtype, device: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, rms_norm_eps=1e-6, initializer_range=0.02,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, use_sliding_window=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(staging)


def write_direct(staging: Path, shape: dict, dtype: torch.dtype, device: str) -> None:
    """config.json + model.safetensors with HF's Qwen3 tensor names, random normal(0, 0.02)."""
    from safetensors.torch import save_file

    hidden, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, inter = shape["head_dim"], shape["intermediate_size"]
    gen = torch.Generator(device=device).manual_seed(0)

    def normal(*dims: int) -> torch.Tensor:
        return (torch.randn(dims, generator=gen, device=device) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": normal(shape["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=dtype, device=device)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype, device=device),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype, device=device),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=dtype, device=device),
            p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=dtype, device=device),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        })
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(shape["vocab_size"], hidden)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(staging / "model.safetensors"))
    config = dict(shape, architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
                  rope_theta=1e6, dtype=str(dtype).removeprefix("torch."), use_sliding_window=False,
                  attention_bias=False, hidden_act="silu", bos_token_id=EOS_TOKEN_ID,
                  eos_token_id=EOS_TOKEN_ID)
    (staging / "config.json").write_text(json.dumps(config, indent=2))


def count_weight_bytes(config_path: Path, bytes_per_param: int) -> int:
    """Weight bytes a decode step reads: every layer, the final norm and the LM head."""
    cfg = json.loads(config_path.read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    attn = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 2 * head_dim
    mlp = 3 * hidden * cfg["intermediate_size"]
    layers = cfg["num_hidden_layers"] * (attn + mlp + 2 * hidden)
    lm_head = cfg["vocab_size"] * hidden  # tied or not, the head matrix is read once per step
    return (layers + hidden + lm_head) * bytes_per_param
