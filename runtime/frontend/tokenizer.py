"""The front end's tokenizer: a checkpoint's ``tokenizer.json`` plus ``tokenizer_config.json``
and its chat templates, read the way transformers reads them.

Loaded with the ``tokenizers`` library directly (fast to import, no transformers machinery),
so the API process, the offline ``LLM`` and the router's precise mode encode exactly alike.
Special tokens (BOS) are added by ``tokenizer.json``'s post-processor, which is what
transformers' generic fast tokenizer runs (model-specific tokenizer classes that rebuild it
from tokenizer_config's ``add_bos_token`` are not imitated). Chat templates: ``chat_template.jinja`` and
``additional_chat_templates/*.jinja`` take priority over tokenizer_config's ``chat_template``
(a string, or the named-templates list).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.runtime.frontend.gguf_tokenizer import gguf_tokenizer
from shoal.runtime.model_source import gguf_file
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_TEMPLATE = "default"


def _token_content(value: object) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def configured_chat_templates(config: dict[str, Any]) -> dict[str, str]:
    """tokenizer_config's ``chat_template``: a string, or the named-templates list."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates[DEFAULT_TEMPLATE] = configured
    elif isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
        templates.update({t["name"]: t["template"] for t in configured
                          if isinstance(t, dict) and isinstance(t.get("template"), str)})
    return templates


def load_chat_templates(root: Path, config: dict[str, Any]) -> dict[str, str]:
    """Template name -> jinja source; the unnamed one is ``default``."""
    templates = configured_chat_templates(config)
    files: dict[str, str] = {}
    if (root / "chat_template.jinja").is_file():
        files[DEFAULT_TEMPLATE] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return files or templates  # template files replace the config's templates entirely


@dataclass
class Tokenizer:
    backend: HFTokenizer
    # the same tokenizer with special-token strings read as ordinary text (a separate object:
    # encode_special_tokens is a property of the tokenizer, and encoding runs in threads)
    plain_backend: HFTokenizer | None = None
    chat_templates: dict[str, str] = field(default_factory=dict)
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """From an HF checkpoint directory, or a GGUF file (or the directory holding one)."""
        gguf = gguf_file(model_dir)
        if gguf is not None:
            source, config = gguf_tokenizer(gguf)
            return cls._build(source, config, configured_chat_templates(config))
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json")
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls._build(path.read_text(encoding="utf-8"), config,
                          load_chat_templates(root, config))

    @classmethod
    def _build(cls, source: str, config: dict[str, Any],
               chat_templates: dict[str, str]) -> Tokenizer:
        tokens = {k: _token_content(config.get(k))
                  for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        backends = []
        for plain in (False, True):
            backend = HFTokenizer.from_str(source)
            backend.encode_special_tokens = plain
            backends.append(backend)
        special = {int(i) for i, tok in config.get("added_tokens_decoder", {}).items()
                   if isinstance(tok, dict) and tok.get("special")}
        special |= {i for i, tok in backends[0].get_added_tokens_decoder().items()
                    if tok.special}
        return cls(backend=backends[0], plain_backend=backends[1], chat_templates=chat_templates,
                   special_token_ids=frozenset(special), **tokens)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get(DEFAULT_TEMPLATE)

    def to_wire(self) -> dict[str, object]:
        """Everything this tokenizer is, as JSON-able data (the engine's ``GET /tokenizer``):
        a router rebuilds exactly the engine's tokenizer with ``from_wire``."""
        return {"tokenizer_json": self.backend.to_str(), "chat_templates": self.chat_templates,
                "bos_token": self.bos_token, "eos_token": self.eos_token,
                "unk_token": self.unk_token, "pad_token": self.pad_token,
                "special_token_ids": sorted(self.special_token_ids)}

    @classmethod
    def from_wire(cls, data: dict[str, object]) -> Tokenizer:
        def text(key: str) -> str | None:
            value = data.get(key)
            return value if isinstance(value, str) else None

        source = data.get("tokenizer_json")
        ids = data.get("special_token_ids") or []
        templates = data.get("chat_templates") or {}
        if not isinstance(source, str) or not isinstance(ids, list) \
                or not isinstance(templates, dict):
            raise ValueError("not a tokenizer: needs tokenizer_json (str), chat_templates "
                             "(object) and special_token_ids (list)")
        backends = []
        for plain in (False, True):
            backend = HFTokenizer.from_str(source)
            backend.encode_special_tokens = plain
            backends.append(backend)
        return cls(backend=backends[0], plain_backend=backends[1],
                   chat_templates={str(k): str(v) for k, v in templates.items()},
                   bos_token=text("bos_token"), eos_token=text("eos_token"),
                   unk_token=text("unk_token"), pad_token=text("pad_token"),
                   special_token_ids=frozenset(int(i) for i in ids))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> list[str]:
        """The strings of the special added tokens (what a template writes as control)."""
        tokens = (self.backend.id_to_token(i) for i in sorted(self.special_token_ids))
        return [t for t in tokens if t is not None]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As transformers' ``tokenizer.encode(text)``: BOS/EOS added as the checkpoint says
        unless ``add_special_tokens=False``; special-token strings in ``text`` are matched."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as ordinary characters: special-token strings are not matched and
        nothing is added (transformers' ``split_special_tokens=True``)."""
        backend = self.plain_backend or self.backend
        return backend.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def template_kwargs(self) -> dict[str, str]:
        """The special tokens a chat template may read (transformers passes its map)."""
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in names.items() if v is not None}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (a partial UTF-8 sequence shows as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)
