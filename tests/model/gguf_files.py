"""Writing small GGUF files from the tiny HF checkpoints, as llama.cpp's convert_hf_to_gguf
does (its metadata keys, tensor names, the llama q/k row permutation, the tokenizer as
tokens + merges + token types), with the ``gguf`` package's writer and quantizers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[module]}.{kind}"


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's half-split rotary rows -> interleaved pairs."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(model_dir: Path, out: Path, arch: str, quant: str = "Q8_0",
               add_bos: bool = False, tensor_types: dict[str, str] | None = None) -> Path:
    """``model_dir`` (a make-model checkpoint) as a GGUF at ``out``: 2-D weights in ``quant``
    (``tensor_types`` overrides by GGUF name), norms and biases F32. ``arch`` is written as
    the GGUF architecture (a name the loader does not know tests its refusal)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    _write_tokenizer(writer, model_dir, tok, tok_config, config, arch, add_bos)

    permuted = arch == "llama"
    for hf_name, tensor in state.items():
        values = tensor.float().numpy()
        if permuted and ".q_proj." in hf_name:
            values = permute(values, heads)
        elif permuted and ".k_proj." in hf_name:
            values = permute(values, kv_heads)
        name = gguf_name(hf_name)
        qtype = Q[(tensor_types or {}).get(name, quant if values.ndim == 2 else "F32")]
        if qtype == Q.F32:
            writer.add_tensor(name, values)
        elif qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, _blocks(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _blocks(values: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if qtype == Q.Q4_K:
        return quantize_q4_k(values)
    if qtype == Q.Q6_K:
        return quantize_q6_k(values)
    try:
        return quants.quantize(values, qtype)
    except NotImplementedError:  # types without a quantizer: zero blocks of the right size
        block, type_size = quants.GGML_QUANT_SIZES[qtype]
        return np.zeros((values.shape[0], values.shape[1] // block * type_size), np.uint8)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """[rows, cols] -> Q4_K blocks [rows, cols / 256 * 144] in llama.cpp's block_q4_K layout
    (the gguf package dequantizes it, it has no quantizer): per 32 columns an asymmetric
    4-bit range (min/max, not llama.cpp's search: any values decode the same way)."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - low) / 15
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d[..., None], out=np.zeros_like(scale),
                                   where=d[..., None] > 0)), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(np.divide(-low, dmin[..., None], out=np.zeros_like(low),
                                     where=dmin[..., None] > 0)), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.rint(np.divide(x + (dmin[..., None] * mins)[..., None], step,
                          out=np.zeros_like(x), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(rows, cols // 256, 4, 2, 32)
    packed = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4)], axis=-1)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, cols // 256, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """[rows, cols] -> Q6_K blocks [rows, cols / 256 * 210] (block_q6_K: ql, qh, int8
    scales per 16 columns, fp16 d): symmetric 6-bit per 16 columns."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d[..., None], out=np.zeros_like(scale),
                                   where=d[..., None] > 0)), -128, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = np.rint(np.divide(x, step, out=np.zeros_like(x), where=step != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(rows, cols // 256, 2, 4, 32)
    ql = np.concatenate([q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
                         q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4], axis=-1)
    qh = (q[..., 0, :] >> 4) | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4 | \
        (q[..., 3, :] >> 4) << 6
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64),
                             sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    return blocks.reshape(rows, -1)


def _write_tokenizer(writer, model_dir: Path, tok: dict, tok_config: dict, config: dict,
                     arch: str, add_bos: bool) -> None:
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [""] * config["vocab_size"]
    types = [5] * config["vocab_size"]  # UNUSED padding past the trained vocabulary
    for text, index in vocab.items():
        tokens[index] = text
        types[index] = 3 if text in special else 1  # CONTROL / NORMAL
    for index, text in enumerate(tokens):
        if not text:
            tokens[index] = f"[PAD{index}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    bos = tok_config.get("bos_token") or tok_config.get("pad_token")
    writer.add_bos_token_id(vocab[bos])
    writer.add_eos_token_id(config["eos_token_id"] if isinstance(config["eos_token_id"], int)
                            else config["eos_token_id"][0])
    writer.add_add_bos_token(add_bos)
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        template = template[0]["template"]
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template is not None:
        writer.add_chat_template(template)


def hf_from_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own loading of the file: (model, tokenizer), the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def reference_checkpoint(path: Path) -> Path:
    """transformers' loading of a GGUF, saved once as an HF checkpoint (safetensors +
    tokenizer) under ``$SHOAL_CACHE_DIR/reference/<sha256 of the file>``: dequantizing a
    100 MB file in transformers takes a minute on a loaded 2-core machine, reading the saved
    float32 weights a second. The key is the file's content, so a changed file is reloaded."""
    import hashlib
    import os
    import shutil

    from shoal.runtime.model.make_model import cache_dir

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    target = cache_dir() / "reference" / f"{path.stem}-{digest.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    model, tokenizer = hf_from_gguf(path)
    # saved as plain float32 weights: without this, loading the folder would ask for GGUF
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    partial = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target) if not target.exists() else shutil.rmtree(partial)
    return target


def assert_greedy_equals_hf(llm, reference, tokenizer, max_tokens: int = 12) -> None:
    """The engine's greedy continuation of two fixed prompts equals HF ``generate``'s on the
    same file, token ids included."""
    from shoal.runtime.sampling_params import SamplingParams

    prompts = ["Once upon a time", "The weather today"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                          min_new_tokens=max_tokens)[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected
