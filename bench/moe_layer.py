"""One MoE layer's experts on CPU: the grouped path against a per-expert Python loop.

Qwen3-MoE-shaped by default (hidden 1024, 64 experts of 256, top-8). For each token count,
the same random routing goes through ``grouped_experts`` (tokens sorted by expert, one
``torch._grouped_mm`` per projection, what the model runs) and through a loop over the hit
experts with two ``F.linear`` calls each (what transformers' eager MoE does); prints ms per
call of each, their ratio, the grouped path's GFLOP/s and the largest difference between
them. Same process, same inputs, interleaved rounds: the machine's load moves both.

    .venv/bin/python bench/moe_layer.py [--tokens 1,8,32,128,512] [--dtype float32]
        [--hidden 1024] [--experts 64] [--size 256] [--top-k 8] [--threads 0]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from shoal.kernels.moe_grouped import grouped_experts, silu_and_mul_torch


def loop_experts(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        hidden = silu_and_mul_torch(F.linear(x[token], w13[expert]))
        out.index_add_(0, token, F.linear(hidden, w2[expert]) * weights[token, slot, None]
                       .to(x.dtype))
    return out


def ms_per_call(call, min_seconds: float) -> float:
    call()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        call()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h, e, i, k = args.hidden, args.experts, args.size, args.top_k
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype)
    print(f"experts {e} x (2x{i}x{h} + {h}x{i}), top-{k}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'tokens':>6} {'grouped ms':>10} {'loop ms':>9} {'loop/grouped':>12} "
          f"{'GFLOP/s':>8} {'max diff':>9}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, h, generator=gen).to(dtype)
        weights, ids = torch.softmax(torch.randn(tokens, e, generator=gen), -1).topk(k, dim=-1)
        diff = float((grouped_experts(x, w13, w2, weights, ids)
                      - loop_experts(x, w13, w2, weights, ids)).abs().max())
        grouped, loop = [], []
        with torch.inference_mode():
            for _ in range(args.rounds):
                grouped.append(ms_per_call(lambda x=x, w=weights, d=ids: grouped_experts(
                    x, w13, w2, w, d), args.seconds))
                loop.append(ms_per_call(lambda x=x, w=weights, d=ids: loop_experts(
                    x, w13, w2, w, d), args.seconds))
        g, lp = min(grouped), min(loop)
        flop = 2 * tokens * k * 3 * i * h
        print(f"{tokens:>6} {g:>10.3f} {lp:>9.3f} {lp / g:>12.2f} {flop / g / 1e6:>8.1f} "
              f"{diff:>9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
