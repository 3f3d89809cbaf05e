"""The front end's tokenizer: a checkpoint's ``tokenizer.json`` plus ``tokenizer_config.json``.

Loaded with the ``tokenizers`` library directly (fast to import, no transformers machinery),
so the API process can encode prompts, decode outputs and render the chat template without
touching the engine. The same object serves the offline ``LLM``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


def _token_content(value: object) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        special = {int(i) for i, tok in config.get("added_tokens_decoder", {}).items()
                   if isinstance(tok, dict) and tok.get("special")}
        return cls(backend=backend, chat_template=template,
                   bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")),
                   special_token_ids=frozenset(special))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (a partial UTF-8 sequence shows as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)
