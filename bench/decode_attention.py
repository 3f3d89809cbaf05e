"""The CPU decode-attention kernel's read rate against a plain streaming read, same run.

Decode attention must read every cached K and V row of every request once per layer and
step; on a CPU that is memory-bound, so its ceiling is the machine's streaming read rate
(``bench/floor.py``'s ``read_rate``), which moves with the host's load. This measures both
within a few seconds of each other: the native kernel (``shoal.kernels.paged_decode_cpu``)
over random block tables (pages at scattered addresses, as a running server's are) for
several batch x context shapes, one call per layer over each layer's own cache as a model
step makes them (so a step's K/V is larger than the L3 and comes from DRAM, as it does in a
server), and once with every request reading the same pages of one cache (they stay in
cache: the kernel's compute ceiling). The bench model's heads and layers: 8 query heads,
4 kv heads of 64, 8 layers.

    .venv/bin/python bench/decode_attention.py [--threads 2] [--layers 8]
        [--shapes 128x400,48x250,...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from shoal.kernels.paged_decode_cpu import paged_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import read_rate  # noqa: E402  (bench/ is not a package)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * 4


def seconds_per_layer(batch: int, context: int, layers: int, shared_pages: bool,
                      repeats: int = 5) -> float:
    """The fastest of ``repeats`` passes over ``layers`` caches (one call each) of ``batch``
    requests of ``context`` tokens, per layer."""
    generator = torch.Generator().manual_seed(batch * 100_003 + context)
    blocks_each = -(-context // BLOCK)
    num_blocks = blocks_each * (1 if shared_pages else batch)
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator))
              for _ in range(layers)]
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = order.view(1, -1).expand(batch, -1) if shared_pages else order.view(batch, -1)
    tables = tables.contiguous()
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator)
    out = torch.empty_like(q)
    rows = torch.arange(batch)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)

    def step() -> None:
        for k_cache, v_cache in caches:
            paged_decode_attention(q, out, k_cache, v_cache, tables, rows, rows, seq_lens,
                                   HEAD_DIM ** -0.5)

    step()  # page faults, thread start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best / layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="caches read per step")
    parser.add_argument("--shapes", default="128x400,48x250,128x1000,32x960,8x2000",
                        help="BATCHxCONTEXT, comma-separated")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = read_rate()
    print(f"torch threads {torch.get_num_threads()}; streaming read {before / 1e9:.1f} GB/s")
    print(f"{'shape':<14} {'K/V MB/layer':>12} {'ms/layer':>9} {'GB/s':>7} {'of read':>8} "
          f"{'in-cache GB/s':>14}")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        nbytes = kv_bytes(batch, context)
        dram = seconds_per_layer(batch, context, args.layers, shared_pages=False)
        cached = seconds_per_layer(batch, context, 1, shared_pages=True)
        print(f"{shape:<14} {nbytes / 1e6:>12.1f} {dram * 1e3:>9.2f} {nbytes / dram / 1e9:>7.1f} "
              f"{100 * nbytes / dram / before:>7.0f}% {nbytes / cached / 1e9:>14.1f}")
    print(f"streaming read after: {read_rate() / 1e9:.1f} GB/s (the host's rate moves)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
