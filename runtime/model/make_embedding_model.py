"""A test embedding checkpoint laid out as Qwen3-Embedding ships: transformers' ``Qwen3Model``
saved as is (no LM head, tensor names without ``model.``), a sentence-transformers
``modules.json`` asking for last-token pooling and a Normalize module, and optionally
``is_matryoshka``. Random weights over a generating checkpoint's tokenizer and shape; the
tests serve it, and ``bench/embeddings_vllm_check.py`` gives the same files to vLLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def make_embedding_model(source: Path, out: Path, matryoshka: bool = False,
                         seed: int = 0) -> Path:
    """Writes into ``out`` a ``Qwen3Model`` with ``source``'s config and tokenizer (a qwen3
    checkpoint) and returns ``out``."""
    import torch
    from transformers import AutoConfig, Qwen3Model

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    config = AutoConfig.from_pretrained(source)
    config.architectures = ["Qwen3Model"]
    torch.manual_seed(seed)
    Qwen3Model(config).float().eval().save_pretrained(out)
    if matryoshka:  # a request may then ask for fewer dimensions
        raw = json.loads((out / "config.json").read_text())
        raw["is_matryoshka"] = True
        (out / "config.json").write_text(json.dumps(raw))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config.hidden_size, "pooling_mode_lasttoken": True,
        "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}))
    return out
