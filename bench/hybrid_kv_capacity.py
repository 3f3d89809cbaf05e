"""KV capacity of a Gemma-3-shaped model with and without KV cache groups, same memory.

A Gemma 3 1B-shaped config (26 layers, 5 sliding (window 512) to 1 full, one KV head of
256, random weights: ``--load-format dummy``) is started twice as an engine core with one
``--kv-cache-memory``: with its KV cache groups (``runtime/kv/kv_groups.py``) and with
``--disable-hybrid-kv-cache-manager`` (one block table for every layer, as before). For
each it prints the blocks the budget holds, the longest request that fits, and how many
requests of each length the real KV manager holds at once (prompts prefilled in chunks of
``--max-num-batched-tokens``, the blocks behind the window freed between chunks, as the
scheduler does). No timing: the figures are block arithmetic of the real code.

    python bench/hybrid_kv_capacity.py [--kv-cache-memory BYTES] [--lengths 4096,32768]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LAYERS = 26
WINDOW = 512


def write_config(folder: Path) -> None:
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(LAYERS)]
    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "max_position_embeddings": 32768, "sliding_window": WINDOW,
        "layer_types": types, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": None, "bos_token_id": 2,
        "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "float32",
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))


@dataclass
class Seq:
    req_id: str
    all_token_ids: list[int]
    block_hashes: list[int] = field(default_factory=list)
    extra_digest: bytes = b""


def concurrent(core, length: int, step_tokens: int) -> int:
    """Requests of ``length`` tokens one fresh KV manager of the core's shape holds at once."""
    from shoal.runtime.kv.kv_manager import KVCacheManager

    old = core.scheduler.kv
    kv = KVCacheManager(old.num_blocks, old.block_size, 4096, length, False,
                        old.sliding_window, old.windows if old.num_groups > 1 else None)
    held = 0
    while True:
        seq = Seq(f"r{held}", [0] * length)
        done = 0
        while done < length:
            count = min(step_tokens, length - done)
            ok = (kv.allocate_slots(seq, done, count) if done == 0
                  else kv.extend_tables([seq.req_id], [done + count]))
            if not ok:
                return held
            done += count
            kv.free_outside_window([seq.req_id], np.array([done]),
                                   np.array([kv.rows[seq.req_id]]))
        held += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore

    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        write_config(Path(folder))
        rows = {}
        for label, disable in (("one table (before)", True), ("KV cache groups", False)):
            core = EngineCore(EngineConfig.from_kwargs(
                folder, load_format="dummy", dtype="float32", device="cpu", block_size=16,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=256,
                max_num_batched_tokens=args.max_num_batched_tokens,
                disable_hybrid_kv_cache_manager=disable))
            rows[label] = (core.scheduler.kv.num_blocks, core.executor.kv_bytes_per_block(),
                           core.max_model_len,
                           [concurrent(core, n, args.max_num_batched_tokens) for n in lengths])
            core.shutdown()
    print(f"Gemma-3-shaped: {LAYERS} layers (5 sliding of window {WINDOW} : 1 full), 1 KV head "
          f"x 256, float32; --kv-cache-memory {args.kv_cache_memory}, block 16, chunks of "
          f"{args.max_num_batched_tokens}")
    print(f"{'layout':<20} {'blocks':>7} {'bytes/block':>12} {'max_model_len':>14} "
          + " ".join(f"{f'{n}-tok reqs':>15}" for n in lengths))
    for label, (blocks, per_block, limit, held) in rows.items():
        print(f"{label:<20} {blocks:>7} {per_block:>12} {limit:>14} "
              + " ".join(f"{h:>15}" for h in held))
    (b0, _, _, h0), (b1, _, _, h1) = rows.values()
    print("ratio (groups / one table): blocks "
          f"{b1 / b0:.2f}x; concurrent " + ", ".join(
              f"{n}: {b / a:.2f}x" if a else f"{n}: {b} vs 0" for n, a, b in zip(lengths, h0, h1,
                                                                                 strict=True)))


if __name__ == "__main__":
    main()
