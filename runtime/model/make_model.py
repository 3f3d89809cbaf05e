"""``shoal make-model``: HF-format checkpoints with random weights, made offline.

Each checkpoint is what a real model directory holds (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json, a chat template), built
with transformers' own config and model classes so HF transformers loads it unchanged and
serves as the reference. The three archs cover the three ways checkpoints ship a tokenizer:
llama as modern Llama-style ones do (a BOS token the tokenizer adds, the template in
``chat_template.jinja``), qwen2 with the template string in tokenizer_config.json, qwen3
with tokenizer_config's named-templates list (``default`` and ``tool_use``). The byte-level BPE tokenizer is trained in seconds on the Python
standard library's own source files, read in a fixed order, so a seed gives the same bytes.

Random weights give near-flat logits; a larger ``initializer_range`` makes greedy argmax a
clear choice, and a zeroed EOS row keeps generation from stopping early in benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3")
SIZES = ("tiny", "small", "bench")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
BOS_TOKEN = "<|begin_of_text|>"  # llama only: the tokenizer adds it to every encoded text
BOS_ID = 3
EOS_TOKEN_IDS = [IM_END_ID, ENDOFTEXT_ID]
INITIALIZER_RANGE = 0.15
CORPUS_BYTES = 3_000_000
# what make_model writes; part of the cache key so a changed format is never read stale
FORMAT_VERSION = 2

# ChatML with tools as Qwen2.5 renders them: the tool list in the system turn, assistant
# tool calls as <tool_call> JSON, tool results as <tool_response> in a user turn
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
LLAMA_CHAT_TEMPLATE = "{{- bos_token }}\n" + CHAT_TEMPLATE  # llama writes BOS itself


def special_tokens(arch: str) -> list[str]:
    return SPECIAL_TOKENS + [BOS_TOKEN] if arch == "llama" else list(SPECIAL_TOKENS)


@dataclass(frozen=True)
class SizeSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 4096


def size_spec(arch: str, size: str) -> SizeSpec:
    """Shapes per (arch, size). qwen3 tiny/small use a head_dim unrelated to hidden/heads;
    llama tiny has a single KV head so TP=2 must replicate it."""
    _check_choice("arch", arch, ARCHS)
    _check_choice("size", size, SIZES)
    if size == "tiny":
        kv = {"llama": 1, "qwen2": 2, "qwen3": 2}[arch]
        head_dim = 32 if arch == "qwen3" else None
        return SizeSpec(1024, 64, 2, 4, kv, 128, head_dim)
    if size == "small":
        head_dim = 48 if arch == "qwen3" else None
        layers = 6 if _tied(arch) else 4  # a tied model needs more layers for the same size
        return SizeSpec(4096, 256, layers, 8, 4, 768, head_dim)
    return SizeSpec(8192, 512, 8, 8, 4, 1792 if _tied(arch) else 1536)


def count_params(arch: str, size: str) -> int:
    """Parameter count from the shapes alone (no weights built)."""
    s = size_spec(arch, size)
    head_dim = s.head_dim or s.hidden_size // s.num_heads
    q, kv = s.num_heads * head_dim, s.num_kv_heads * head_dim
    attn = s.hidden_size * (q + 2 * kv) + q * s.hidden_size
    if arch == "qwen2":
        attn += q + 2 * kv  # qkv bias
    if arch == "qwen3":
        attn += 2 * head_dim  # q/k norm
    mlp = 3 * s.hidden_size * s.intermediate_size
    layer = attn + mlp + 2 * s.hidden_size
    embed = s.vocab_size * s.hidden_size
    lm_head = 0 if _tied(arch) else embed
    return embed + lm_head + s.num_layers * layer + s.hidden_size


def _tied(arch: str) -> bool:
    return arch == "qwen2"


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def shared_config(bos_token_id: int | None = None) -> dict[str, Any]:
    """What every test checkpoint's config says alike: the trained tokenizer's special ids
    (BOS <|endoftext|> unless given), the RMSNorm epsilon and the confident initializer."""
    return dict(rms_norm_eps=1e-6, initializer_range=INITIALIZER_RANGE,
                bos_token_id=ENDOFTEXT_ID if bos_token_id is None else bos_token_id,
                eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID)


def hf_config(arch: str, size: str):  # -> transformers.PretrainedConfig
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    s = size_spec(arch, size)
    common: dict[str, Any] = dict(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        intermediate_size=s.intermediate_size, max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=_tied(arch), **shared_config(BOS_ID if arch == "llama" else None))
    if arch == "llama":
        # llama3 rope scaling with a short original context so every band of the rule is used
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512}
        return LlamaConfig(**common, rope_parameters=rope)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           use_sliding_window=False)
    return Qwen3Config(**common, head_dim=s.head_dim or s.hidden_size // s.num_heads,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       use_sliding_window=False)


def training_corpus(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Standard-library sources in sorted order: available offline, same on every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"no training text found under {stdlib}")
    return texts


def train_tokenizer(vocab_size: int, arch: str = "qwen2"):  # -> tokenizers.Tokenizer
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    if arch.startswith("qwen"):
        # Qwen's own split (and NFC), which transformers installs for a qwen2 checkpoint
        # whatever tokenizer.json says: the file must already hold it to agree with HF
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens(arch), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    if arch == "llama":  # as Llama 3's tokenizer.json: BOS before every encoded text
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0", pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_ID)])
    return tokenizer


def _tokenizer_config(arch: str) -> dict:
    added = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, tok in enumerate(special_tokens(arch))
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN if arch == "llama" else None,
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "unk_token": None,
        "additional_special_tokens": [SPECIAL_TOKENS[IM_START_ID]],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if arch == "qwen2":
        config["chat_template"] = CHAT_TEMPLATE
    elif arch == "qwen3":  # the named-templates form
        config["chat_template"] = [{"name": "default", "template": CHAT_TEMPLATE},
                                   {"name": "tool_use", "template": CHAT_TEMPLATE}]
    return config


def empty_dir(out_dir: str | Path) -> Path:
    """``out_dir``, created; an existing one must be empty."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    return out


def random_model(config, seed: int, model_class: Any = None):  # -> transformers model
    """transformers' own model for ``config`` (``AutoModelForCausalLM`` unless a class is
    named), float32 random weights from ``seed``, made confident: random biases and norm
    gains (so the reference tests exercise them), EOS rows of the output projection zeroed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = (model_class(config) if model_class is not None
             else AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * INITIALIZER_RANGE)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        rows = model.get_output_embeddings().weight
        rows[EOS_TOKEN_IDS] = 0.0
    return model


def save_checkpoint(model, out: Path, vocab_size: int, arch: str = "qwen2",
                    bos_token_id: int | None = None) -> Path:
    """The model and its tokenizer as a checkpoint directory: weights, config.json,
    generation_config.json (EOS = <|im_end|> and <|endoftext|>), the trained tokenizer and
    tokenizer_config.json in ``arch``'s flavour (qwen2: the template string inside)."""
    model.generation_config.eos_token_id = list(EOS_TOKEN_IDS)
    model.generation_config.pad_token_id = ENDOFTEXT_ID
    if bos_token_id is not None:
        model.generation_config.bos_token_id = bos_token_id
    model.save_pretrained(out)
    train_tokenizer(vocab_size, arch).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(arch), indent=2) + "\n")
    return out


def make_model(arch: str, size: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a checkpoint to ``out_dir`` (created; must be empty if it exists)."""
    out = empty_dir(out_dir)
    config = hf_config(arch, size)
    save_checkpoint(random_model(config, seed), out, config.vocab_size, arch,
                    bos_token_id=config.bos_token_id)
    if arch == "llama":  # transformers >= 4.43 saves the template beside the config
        (out / "chat_template.jinja").write_text(LLAMA_CHAT_TEMPLATE)
    specials_map = {"eos_token": SPECIAL_TOKENS[IM_END_ID],
                    "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
                    "additional_special_tokens": [SPECIAL_TOKENS[IM_START_ID]]}
    if arch == "llama":
        specials_map["bos_token"] = BOS_TOKEN
    (out / "special_tokens_map.json").write_text(json.dumps(specials_map, indent=2) + "\n")
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_CACHE_DIR", Path.home() / ".cache" / "shoal"))


def cached_build(name: str, build: Callable[[Path], object]) -> Path:
    """``cache_dir()/models/<name>``, made once by ``build(directory)``; concurrent builders
    race safely (each builds into a temp dir, then renames it into place)."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race to a complete build: fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def cached_model(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """``make_model`` once into the cache."""
    _check_choice("arch", arch, ARCHS)
    _check_choice("size", size, SIZES)
    return cached_build(f"{arch}-{size}-s{seed}-v{FORMAT_VERSION}",
                        lambda out: make_model(arch, size, out, seed))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-model", help="write an HF-format checkpoint with random weights and a tokenizer")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    out = make_model(args.arch, args.size, args.out, args.seed)
    print(f"wrote {args.arch}-{args.size} ({count_params(args.arch, args.size):,} parameters) "
          f"to {out}")
    return 0
