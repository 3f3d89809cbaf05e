"""Helpers shared by the GPU benchmark sections: device, timing, result files, imports.

The GPU machine has no network and does not install the project, so ``shoal.*`` is made
importable from the checkout by a folder of symbolic links (``shoal`` -> the repository's
top-level folders), and wheels carried in bench/gpu/wheels/ are unpacked next to it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(__file__).resolve().parent / "wheels"
PACKAGE_FOLDERS = {"runtime": "runtime", "operator": "operator"}  # shoal/kernels is in place


def make_shoal_importable() -> Path | None:
    """A folder to put first on sys.path when ``shoal`` is not installed; None when it is."""
    try:
        import shoal.runtime  # noqa: F401

        return None
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    package = shim / "shoal"
    package.mkdir()
    for item in (REPO / "shoal").iterdir():
        (package / item.name).symlink_to(item)
    for name, folder in PACKAGE_FOLDERS.items():
        (package / name).symlink_to(REPO / folder)
    for wheel in sorted(WHEELS.glob("*.whl")):  # pure unpack: what pip does, minus the network
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(shim)
    return shim


WORK_ENV = "SHOAL_BENCH_WORK"  # where sections write; bench.py archives it into $OUT


def out_dir() -> Path:
    path = Path(os.environ.get(WORK_ENV) or os.environ.get("OUT")
                or REPO / "bench" / "results" / "gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_result(section: str, result: dict) -> None:
    (out_dir() / f"{section}.json").write_text(json.dumps(result, indent=2, default=str))


def read_result(section: str) -> dict | None:
    path = out_dir() / f"{section}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def time_ms(fn: Callable[[], object], device_type: str, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``fn``; CUDA events on GPU, wall clock on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbps(device_type: str, nbytes: int) -> float:
    """Device copy bandwidth, bytes read + written per second (the roofline's memory rate)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device_type)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device_type, warmup=3, iters=10)
    return 2 * nbytes / (ms / 1e3) / 1e9


def python_version() -> str:
    return sys.version.split()[0]
