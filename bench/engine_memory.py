"""Resident memory of ``shoal serve``'s engine-core process per checkpoint parameter.

Starts ``shoal serve`` on each model directory in turn with the same small KV cache, sends one
request, and reads the resident set of the engine-core process (psutil). The first directory
is the baseline (a tiny checkpoint: the same process, torch and kernels, almost no weights);
each other model's figure is its RSS minus the baseline's over its parameters minus the
baseline's, i.e. what a parameter costs in the serving dtype (bfloat16: 2 bytes at best).

    .venv/bin/python bench/engine_memory.py --dtype bfloat16 TINY_DIR MODEL_DIR [MODEL_DIR...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)

KV_CACHE_GIB = 1 / 16  # small and the same for every model: it is not the weights


def engine_rss(model_dir: Path, dtype: str) -> int:
    server = peers.start_shoal_server(model_dir, "m", 4, 256, 512, threads=1,
                                      kv_cache_gib=KV_CACHE_GIB, dtype=dtype)
    try:
        server.wait_up()
        httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True})
        time.sleep(1.0)
        root = psutil.Process(server.proc.pid)
        cores = [p for p in [root, *root.children(recursive=True)]
                 if "shoal.runtime.engine.core_proc" in " ".join(p.cmdline())]
        if len(cores) != 1:
            raise RuntimeError(f"expected one engine-core process, found {len(cores)}")
        return int(cores[0].memory_info().rss)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("baseline", type=Path, help="a tiny checkpoint directory")
    parser.add_argument("models", type=Path, nargs="+")
    args = parser.parse_args()
    print(f"load average {peers.load_average()}", flush=True)
    base_params = peers.checkpoint_parameters(args.baseline)
    base = engine_rss(args.baseline, args.dtype)
    print(f"baseline {args.baseline.name}: {base_params / 1e6:.2f} M parameters, engine core "
          f"{base / 2**20:.0f} MiB", flush=True)
    for model in args.models:
        params = peers.checkpoint_parameters(model)
        rss = engine_rss(model, args.dtype)
        print(f"{model.name} in {args.dtype}: {params / 1e6:.1f} M parameters, engine core "
              f"{rss / 2**20:.0f} MiB, {rss / params:.2f} bytes/parameter in all, "
              f"{(rss - base) / (params - base_params):.2f} above the baseline", flush=True)
    print(f"load average {peers.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
