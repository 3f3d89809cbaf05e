"""GGUF weight types on the native CPU kernel against dense float32 / bfloat16 ``F.linear``, at
a 0.6B model's MLP shapes, in one process: ms per call at a few activation row counts and the
bytes each layout keeps per weight.

The blocks are random bytes with finite fp16 super-block scales (timing does not depend on
the values; ``tests/model/test_gguf_kquants.py`` checks them against the gguf package), turned
into the kernel's layout by the loader's own ``gguf_packed``: Q4_0 and Q8_0 as the file's
blocks, Q4_K repacked into int4 groups of 32, Q6_K kept as stored and decoded in the kernel.
Each (shape, rows) times every layout in turn, best of ``--repeat`` after a warm-up; the
machine's load moves every figure, compare within a row.

    .venv/bin/python bench/gguf_kquant_matmul.py [--rows 1,16,64] [--repeat 20] [--threads 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from shoal.runtime.model.gguf_checkpoint import GGUFTensor
from shoal.runtime.model.quant.gguf_int import BLOCK_BYTES, BLOCK_COLUMNS, gguf_packed

from shoal.kernels.int_matmul_cpu import SUB, compact, int_matmul

SHAPES = {"gate_up (1024 -> 6144)": (6144, 1024), "down (3072 -> 1024)": (1024, 3072)}
TYPES = ("Q4_0", "Q4_K", "Q6_K", "Q8_0")
SCALE_AT = {"Q4_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}  # fp16 fields per block


def random_tensor(kind: str, rows: int, cols: int, rng: np.random.Generator) -> GGUFTensor:
    per_row = cols // BLOCK_COLUMNS.get(kind, SUB)
    blocks = rng.integers(0, 256, (rows, per_row, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in SCALE_AT[kind]:
        halves = (rng.standard_normal((rows, per_row, 1)) * 1e-3).astype(np.float16)
        blocks[..., at:at + 2] = halves.view(np.uint8)
    return GGUFTensor("w", "w", kind, (rows, cols), blocks.reshape(rows, -1))


def best_ms(call, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}")
    for name, (n, k) in SHAPES.items():
        packed = {kind: gguf_packed(random_tensor(kind, n, k, rng)) for kind in TYPES}
        dense = torch.randn(n, k)
        bf16 = dense.bfloat16()
        kept = {kind: compact(p) for kind, p in packed.items() if p is not None}
        sizes = {kind: (p.codes.numel() + p.scales.numel() * p.scales.element_size()
                        + p.offsets.numel() * p.offsets.element_size()) * 8 / (n * k)
                 for kind, p in kept.items()}
        print(f"{name}: bits a weight " + ", ".join(f"{kind} {bits:.2f}"
                                                     for kind, bits in sizes.items()))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            f32 = best_ms(lambda x=x, w=dense: F.linear(x, w), args.repeat)
            b16 = best_ms(lambda xb=xb, w=bf16: F.linear(xb, w), args.repeat)
            cells = [f"f32 {f32:.3f}", f"bf16 {b16:.3f}"]
            for kind, p in kept.items():
                ms = best_ms(lambda x=x, p=p: int_matmul(x, p), args.repeat)
                cells.append(f"{kind} {ms:.3f} ({b16 / ms:.2f}x bf16)")
            print(f"  {rows:>3} rows, ms: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
