"""``python -m shoal.kernels.gpu_check``: compile every registered variant, print a line per
variant and the summary line last; exit 1 on any compile error or broken limit.

Run with the triton to check installed (``make gpu-check`` makes one venv per version).
Results are cached per variant under ``--cache-dir`` by a hash of triton's version and the
kernel's source, so an unchanged kernel is not compiled again.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from shoal.kernels.gpu_check.compile import CompileResult, cache_key, compile_variant
from shoal.kernels.gpu_check.variants import REGISTERED, SHARED_MEMORY_LIMIT, KernelVariant

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shoal" / "gpu-check"


def collect(modules: tuple[str, ...] = REGISTERED) -> list[tuple[str, int, KernelVariant]]:
    """(module, index, variant) for every registered kernel module's variants."""
    found = []
    for name in modules:
        for index, variant in enumerate(importlib.import_module(name).gpu_variants()):
            found.append((name, index, variant))
    return found


def _compile_in_worker(module: str, index: int) -> dict:
    """In a pool process: rebuild the variant list (deterministic) and compile one."""
    variant = importlib.import_module(module).gpu_variants()[index]
    return compile_variant(variant).to_json()


def summary_line(results: list[CompileResult], triton_version: str) -> str:
    failed = sum(r.error is not None for r in results)
    max_shared = max((r.shared_bytes for r in results), default=0)
    spills = sum(r.spill_bytes > 0 for r in results)
    return (f"gpu-check: {len(results) - failed} kernel variants compiled for sm_90a "
            f"(triton {triton_version}), {failed} failed, max shared memory "
            f"{max_shared / 1024:.1f} KiB, {spills} spills")


def report_line(variant: KernelVariant, result: CompileResult, cached: bool) -> str:
    wgmma = "wgmma" if result.wgmma else ("NO wgmma" if variant.tags.get("wgmma_expected") else "-")
    status = "FAIL " + result.error if result.error else "ok"
    return (f"{variant.label:<60} smem {result.shared_bytes / 1024:6.1f}/"
            f"{SHARED_MEMORY_LIMIT // 1024} KiB  regs {result.registers:3d}  "
            f"spill {result.spill_bytes:5d} B  {wgmma:<8} warps {variant.num_warps}  "
            f"{'cached' if cached else f'{result.seconds:5.1f} s'}  {status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--expect-triton", help="fail unless this triton version is the one imported")
    parser.add_argument("--only", help="compile only variants whose label contains this")
    args = parser.parse_args(argv)

    import triton

    version = triton.__version__
    if args.expect_triton and version != args.expect_triton:
        print(f"gpu-check: expected triton {args.expect_triton}, imported {version} "
              f"from {triton.__file__}", file=sys.stderr)
        return 2
    variants = [v for v in collect() if not args.only or args.only in v[2].label]
    cache_dir = args.cache_dir / version
    cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[int, tuple[CompileResult, bool]] = {}
    pending = []
    for position, (module, index, variant) in enumerate(variants):
        path = cache_dir / f"{cache_key(variant)}.json"
        if not args.no_cache and path.exists():
            results[position] = (CompileResult(**json.loads(path.read_text())), True)
        else:
            pending.append((position, module, index, variant, path))
    print(f"gpu-check: triton {version} from {Path(triton.__file__).parent}, "
          f"{len(variants)} variants, {len(variants) - len(pending)} cached, "
          f"{args.jobs} compile processes", flush=True)

    # triton's own cache would hide ptxas's report; keep its files out of the home folder
    with tempfile.TemporaryDirectory(prefix="shoal-gpu-check-") as triton_cache:
        os.environ["TRITON_CACHE_DIR"] = triton_cache
        context = multiprocessing.get_context("fork")  # workers inherit the imported kernels
        with ProcessPoolExecutor(max_workers=max(args.jobs, 1), mp_context=context) as pool:
            futures = [(item, pool.submit(_compile_in_worker, item[1], item[2])) for item in pending]
            for (position, _, _, variant, path), future in futures:
                result = CompileResult(**future.result())
                result.label = variant.label
                if result.error is None:  # a failure is compiled again next time
                    path.write_text(json.dumps(result.to_json()))
                results[position] = (result, False)
                print(report_line(variant, result, False), flush=True)

    for position in sorted(results):
        result, cached = results[position]
        if cached:
            print(report_line(variants[position][2], result, True))
    ordered = [results[p][0] for p in sorted(results)]
    for result in ordered:
        if result.error:
            print(f"FAILED {result.label}: {result.error}")
    print(f"gpu-check: {time.perf_counter() - started:.0f} s")
    print(summary_line(ordered, version))
    return 1 if any(r.error for r in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
