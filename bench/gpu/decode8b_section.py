"""Section ``decode8b``: the decode step on the Qwen3-8B shape (bf16), eager vs CUDA graphs,
at batch 1 and 64 with 512 tokens of context, against the HBM floor (weights + K/V bytes over
the copy bandwidth: about 3.4 ms at batch 1 on an H200). No checkpoint: a config.json and
``--load-format dummy`` weights, made on the device."""

from __future__ import annotations

import decode_section
from checkpoint import QWEN3_8B, TINY, config_only_dir


def run(smoke: bool) -> dict:
    shape, name = (TINY, "tiny") if smoke else (QWEN3_8B, "qwen3-8b")
    return decode_section.run(smoke, config_only_dir(shape, name), load_format="dummy",
                              batches=[1, 2] if smoke else [1, 64],
                              label="tiny qwen3 (dummy weights)" if smoke
                              else "Qwen3-8B-shaped bf16 (dummy weights)")
