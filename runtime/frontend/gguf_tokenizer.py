"""A GGUF file's tokenizer: the ``tokenizer.json`` and ``tokenizer_config.json`` content its
metadata describes (vocabulary, merges, token types, special token ids, chat template).

The file is turned into a ``tokenizers`` tokenizer by transformers' own GGUF converter, the
one ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` runs, so token ids are the
reference's. That converter leaves BOS/EOS insertion to transformers' tokenizer class (from
``add_bos_token``/``add_eos_token``); here it is written into the post-processor instead,
the way a ``tokenizer.json`` carries it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing


def gguf_tokenizer(path: Path) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json source, tokenizer_config dict) for the GGUF file at ``path``."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    _add_special_tokens(backend, config)
    return backend.to_str(), config


def gguf_hf_tokenizer(path: Path) -> Any:
    """The same tokenizer as transformers' fast tokenizer object, for what takes one
    (xgrammar's ``TokenizerInfo``, in the worker's grammar backend).
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` converts the same vocabulary, but
    first parses every metadata field with the gguf package's reader: 4.9 CPU-s for the
    default model's file (49k tokens, 48k merges), against 0.7 s here."""
    from transformers import PreTrainedTokenizerFast

    source, config = gguf_tokenizer(path)
    specials = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                if isinstance(config.get(key), str)}
    return PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(source), **specials)


def _add_special_tokens(backend: HFTokenizer, config: dict[str, Any]) -> None:
    """BOS before / EOS after each sequence where the file's flags say so (as transformers'
    ``update_post_processor``)."""
    specials = []
    for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = config.get(key)
        if config.get(flag) and isinstance(token, str):
            specials.append((flag, token))
    if not specials:
        return
    bos = next((t for f, t in specials if f == "add_bos_token"), None)
    eos = next((t for f, t in specials if f == "add_eos_token"), None)

    def seq(name: str, type_id: int) -> str:
        parts = ([f"{bos}:{type_id}"] if bos else []) + [f"${name}:{type_id}"] \
            + ([f"{eos}:{type_id}"] if eos else [])
        return " ".join(parts)

    ids = [(t, backend.token_to_id(t)) for t in {bos, eos} if t is not None]
    backend.post_processor = TemplateProcessing(
        single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
        special_tokens=[(t, i) for t, i in ids if i is not None])
