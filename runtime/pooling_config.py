"""How an embedding checkpoint turns hidden states into one vector (``--runner pooling``).

vLLM's rules, read from the same files: a sentence-transformers checkpoint says its pooling in
``modules.json`` (a ``sentence_transformers.models.Pooling`` module whose folder holds
``config.json`` with ``pooling_mode_lasttoken`` / ``_mean_tokens`` / ``_cls_token``) and
whether it normalises (a ``sentence_transformers.models.Normalize`` module). Without them a
decoder pools its last token and normalises (vLLM's default for ``embed``). ``--pooler-config``
(JSON, vLLM's keys ``pooling_type`` and ``use_activation``) overrides both. Matryoshka
checkpoints (``is_matryoshka`` or ``matryoshka_dimensions`` in config.json) accept a request's
``dimensions``: the vector is cut to that many leading values, then normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shoal.runtime.json_flag import json_object_flag

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"  # LAST | MEAN | CLS
    normalize: bool = True  # vLLM: use_activation
    matryoshka: bool = False  # a request may ask for fewer dimensions
    matryoshka_dimensions: tuple[int, ...] = ()  # the ones allowed; empty: any up to hidden
    hidden_size: int = 0  # the vector's length (0: not known)

    @property
    def uses_every_prompt_token(self) -> bool:
        """MEAN and CLS need hidden states a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"


def sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers layout, or None without one."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    kinds = {m.get("type", ""): m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("sentence_transformers.models.Pooling")
    normalize = "sentence_transformers.models.Normalize" in kinds
    if pooling is None:
        return "LAST", normalize
    config_path = model_dir / pooling.get("path", "") / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    modes = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    others = [k for k, v in config.items()
              if k.startswith("pooling_mode") and v and k not in _ST_MODES]
    if others or len(modes) > 1:
        raise ValueError(f"{config_path}: pooling {', '.join(others + modes)} is not "
                         f"supported (one of {', '.join(_ST_MODES)})")
    return (modes[0] if modes else "LAST"), normalize


def load_pooler_config(model_dir: str | Path, override_json: str | None) -> PoolerConfig:
    """The checkpoint's pooling, ``--pooler-config`` winning; ValueError naming a bad value."""
    model_dir = Path(model_dir)
    pooling_type, normalize = sentence_transformers_pooling(model_dir) or ("LAST", True)
    if override_json:
        override = json_object_flag("--pooler-config", override_json,
                                    ("pooling_type", "seq_pooling_type", "use_activation"))
        pooling_type = override.get("seq_pooling_type") or override.get(
            "pooling_type") or pooling_type
        if override.get("use_activation") is not None:
            normalize = bool(override["use_activation"])
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling type {pooling_type!r} is not one of "
                         f"{', '.join(POOLING_TYPES)}")
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text()) if config_path.is_file() else {}
    dims = tuple(int(d) for d in raw.get("matryoshka_dimensions") or ())
    hidden = raw.get("hidden_size") or (raw.get("text_config") or {}).get("hidden_size") or 0
    return PoolerConfig(pooling_type, normalize, bool(raw.get("is_matryoshka") or dims), dims,
                        int(hidden))


def wants_pooling(runner: str, architecture: str) -> bool:
    """``--runner auto`` pools for base-model architectures (``*Model``, ``*EmbeddingModel``,
    ``*ForTextEncoding``) as vLLM converts them; ``*ForCausalLM`` generates."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner {runner!r} is not one of {', '.join(RUNNERS)}")
    if runner != "auto":
        return runner == "pooling"
    return architecture.endswith(("Model", "ForTextEncoding")) and \
        not architecture.endswith("ForCausalLM")
