"""CPU linear layers: MKL's ``F.linear`` against oneDNN on packed weights, at a model's shapes.

For each of one decoder layer's projections (qkv, o, gate_up, down) and the LM head, and each
row count, prints GFLOP/s of ``F.linear`` on the checkpoint's [out, in] weight and of
``torch.ops.mkldnn._linear_pointwise`` on the weight packed for several row hints (what
``pack_cpu_linear_weights`` does with ``PACK_ROWS_HINT``), and the largest difference of each
from a float64 reference. Same process, same inputs, one after the other: the machine's load
moves both. Used to choose the packed path and its hint.

    .venv/bin/python bench/linear_cpu.py [--arch llama] [--size bench] [--rows 1,8,32,128,512,2048]
        [--hints 1,128,2048] [--threads 0]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from shoal.runtime.model.config import load_model_config
from shoal.runtime.model.linear import onednn_linear, onednn_pack
from shoal.runtime.model.make_model import cached_model


def layer_shapes(arch: str, size: str) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of one layer's fused projections and the head"""
    mc = load_model_config(cached_model(arch, size))
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {"qkv": (mc.hidden_size, q + 2 * kv), "o": (q, mc.hidden_size),
            "gate_up": (mc.hidden_size, 2 * mc.intermediate_size),
            "down": (mc.intermediate_size, mc.hidden_size),
            "lm_head": (mc.hidden_size, mc.vocab_size)}


def gflops(call, flop: int, min_seconds: float = 0.2) -> float:
    for _ in range(3):
        call()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        call()
        calls += 1
    return flop * calls / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="bench")
    parser.add_argument("--rows", default="1,8,32,128,512,2048")
    parser.add_argument("--hints", default="1,128,2048")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        print("this torch has no oneDNN")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    hints = [int(h) for h in args.hints.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s "
          "(max |error| against float64)")
    for name, (k, n) in layer_shapes(args.arch, args.size).items():
        weight = torch.randn(n, k)
        packed = {h: onednn_pack(weight, h) for h in hints}
        for m in rows:
            x = torch.randn(m, k)
            flop = 2 * m * k * n
            exact = F.linear(x.double(), weight.double())
            err = (F.linear(x, weight).double() - exact).abs().max().item()
            rate = gflops(lambda x=x, w=weight: F.linear(x, w), flop)
            cells = [f"F.linear {rate:6.1f} ({err:.0e})"]
            for hint, p in packed.items():
                def onednn(p=p, x=x):
                    return onednn_linear(x, p)
                err = (onednn().double() - exact).abs().max().item()
                cells.append(f"packed/{hint} {gflops(onednn, flop):6.1f} ({err:.0e})")
            print(f"{name:8} {k:>5}x{n:<5} rows {m:>5}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
