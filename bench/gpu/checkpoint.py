"""A Qwen3-0.6B-shaped checkpoint with random weights, written once per machine.

Built with transformers' own Qwen3 classes (present on the GPU machine) on the device
itself, so nothing is downloaded; no tokenizer is written, the benchmark speaks token ids.
``--smoke`` uses a tiny shape with the same architecture.
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


def model_dir(smoke: bool) -> Path:
    default = Path(tempfile.gettempdir()) / ("shoal-bench-qwen3-tiny" if smoke else "shoal-bench-qwen3-0.6b")
    return Path(os.environ.get("SHOAL_BENCH_MODEL_DIR", default))


def ensure_checkpoint(smoke: bool) -> Path:
    out = model_dir(smoke)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = TINY if smoke else QWEN3_0_6B
    dtype = torch.float32 if smoke else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Qwen3Config(**shape, rms_norm_eps=1e-6, initializer_range=0.02,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, use_sliding_window=False)
    log(f"building a random {'tiny' if smoke else 'Qwen3-0.6B'}-shaped checkpoint on {device}")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    staging = Path(tempfile.mkdtemp(prefix="shoal-ckpt-", dir=out.parent))
    model.save_pretrained(staging)
    gen_path = staging / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    generation["eos_token_id"] = [EOS_TOKEN_ID]
    gen_path.write_text(json.dumps(generation))
    del model
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)  # atomic: a half-written checkpoint is never reused
    return out


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
