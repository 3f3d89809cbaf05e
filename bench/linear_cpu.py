"""CPU linear layers: MKL's ``F.linear``, oneDNN on packed weights and the native panel
kernel, at a model's shapes.

For each of one decoder layer's projections (qkv, o, gate_up, down) and the LM head, and each
row count, prints GFLOP/s of ``F.linear`` on the checkpoint's [out, in] weight, of
``torch.ops.mkldnn._linear_pointwise`` on the weight packed for several row hints (what
``pack_cpu_linear_weights`` does with ``PACK_ROWS_HINT``) and of ``linear_panels_cpu`` on the
weight in panels, and the largest difference of each from a float64 reference. bfloat16
(``--dtype bfloat16``): torch's bfloat16 ``F.linear``, ``linear_bf16_cpu`` (the widened
GEMM) and the panels; oneDNN where it packs bfloat16 on this CPU. The last column is the
panels' rate over the best of the others: a same-run ratio (same process, same inputs, one
after the other: the machine's load moves all of them). Used to choose the packed path and
its hint, and the rows the panels take.

    .venv/bin/python bench/linear_cpu.py [--arch llama] [--size bench] [--rows 1,8,32,128,512,2048]
        [--hints 1,128,2048] [--threads 0] [--dtype float32] [--shapes 4096x4096,...]
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

from shoal.kernels import linear_panels_cpu
from shoal.kernels.linear_bf16_cpu import linear_bf16


def layer_shapes(arch: str, size: str) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of one layer's fused projections and the head"""
    mc = load_model_config(cached_model(arch, size))
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {"qkv": (mc.hidden_size, q + 2 * kv), "o": (q, mc.hidden_size),
            "gate_up": (mc.hidden_size, 2 * mc.intermediate_size),
            "down": (mc.intermediate_size, mc.hidden_size),
            "lm_head": (mc.hidden_size, mc.vocab_size)}


def gflops(call, flop: int, min_seconds: float = 0.2, warmup: int = 3) -> float:
    for _ in range(warmup):
        call()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        call()
        calls += 1
    return flop * calls / (time.perf_counter() - start) / 1e9


def best_rates(calls: dict, flop: int, rounds: int = 5) -> dict[str, float]:
    """Each call's best rate over ``rounds`` short turns, the calls taking turns: on a shared
    machine another process's burst then costs every call alike, and one turn each without
    it is enough (with two threads on two busy cores a turn can run 10-100x slow)."""
    best = dict.fromkeys(calls, 0.0)
    for turn in range(rounds):
        for label, call in calls.items():
            best[label] = max(best[label], gflops(call, flop, 0.04, 3 if turn == 0 else 0))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="bench")
    parser.add_argument("--rows", default="1,8,32,128,512,2048")
    parser.add_argument("--hints", default="1,128,2048")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--shapes", default="",
                        help="INxOUT,... in place of the model's layers (e.g. 4096x4096)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not torch.backends.mkldnn.is_available():
        print("this torch has no oneDNN")
        return 1
    onednn = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    rows = [int(r) for r in args.rows.split(",")]
    hints = [int(h) for h in args.hints.split(",")] if onednn else []
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; "
          "GFLOP/s, best of 5 turns (max |error| against float64); panels / best other")
    shapes = ({shape: (int(shape.split("x")[0]), int(shape.split("x")[1]))
               for shape in args.shapes.split(",")} if args.shapes
              else layer_shapes(args.arch, args.size))
    for name, (k, n) in shapes.items():
        weight = torch.randn(n, k).to(dtype)
        calls = {"F.linear": lambda x, w=weight: F.linear(x, w)}
        if dtype == torch.bfloat16:
            calls["linear_bf16"] = lambda x, w=weight: linear_bf16(x, w)
        for hint in hints:
            calls[f"packed/{hint}"] = lambda x, p=onednn_pack(weight, hint): onednn_linear(x, p)
        calls["panels"] = (lambda x, p=linear_panels_cpu.pack(weight), n=n:
                           linear_panels_cpu.linear(x, p, n))
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            flop = 2 * m * k * n
            exact = F.linear(x.double(), weight.double())
            rates = best_rates({label: lambda call=call, x=x: call(x)
                                for label, call in calls.items()}, flop)
            cells = [f"{label} {rates[label]:6.1f} "
                     f"({(call(x).double() - exact).abs().max().item():.0e})"
                     for label, call in calls.items()]
            best_other = max(rate for label, rate in rates.items() if label != "panels")
            print(f"{name:8} {k:>5}x{n:<5} rows {m:>5}  " + "  ".join(cells)
                  + f"  {rates['panels'] / best_other:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
