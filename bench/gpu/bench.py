"""The prepared GPU benchmark: every section in its own process, the table printed last.

    OUT=/some/folder python3 bench/gpu/bench.py            # H200: <= 8 minutes
    OUT=/tmp/x python3 bench/gpu/bench.py --smoke          # CPU: tiny shapes, checks it runs

Sections (a crash, hang or error in one leaves the others' results; a timeout keeps the
rows a section wrote before it): env (versions, copy bandwidth), kernels (copy and bf16 GEMM
ceilings, decode attention vs the K/V floor at batch 1/64 x context 512/8k/32k with
split-K, an 8k prefill's TFLOP/s), attention (backends vs reference on Qwen3-0.6B shapes), decode (step time at
batch 1/16/64/256, eager vs CUDA graphs, vs the bandwidth floor), throughput (nano-vllm's
workload: 256 requests, in/out uniform 100-1024, ignore_eos, eager vs graphs). Each writes
``<section>.json`` and ``<section>.log`` in a work folder archived to ``$OUT/bench.tar.gz``;
the table goes to stdout (last) and ``$OUT/table.txt``, all numbers to ``$OUT/results.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    WORK_ENV,
    log,
    make_shoal_importable,
    out_dir,
    read_result,
    write_result,
)
from table import render_table  # noqa: E402

# section -> (module, seconds allowed on the GPU, seconds allowed in --smoke / --dry-run)
SECTIONS = {
    "env": ("env_section", 30, 60),
    "kernels": ("kernels_section", 60, 60),
    "attention": ("attention_section", 60, 60),
    "decode": ("decode_section", 90, 90),
    "decode8b": ("decode8b_section", 70, 90),
    "serving": ("serving_section", 70, 90),
    "throughput": ("throughput_section", 70, 90),
}
ARCHIVE = "bench.tar.gz"  # every section's log and JSON; beside it only the table and results


def run_section(name: str, smoke: bool) -> int:
    """In the child process: run one section, record its result or its error."""
    module = importlib.import_module(SECTIONS[name][0])
    started = time.perf_counter()
    try:
        result = module.run(smoke)
        result["seconds"] = round(time.perf_counter() - started, 1)
        write_result(name, result)
        return 0
    except Exception as exc:  # noqa: BLE001 - the error goes into the table, the run goes on
        traceback.print_exc()
        write_result(name, {"error": f"{type(exc).__name__}: {exc}"})
        return 1


def run_all(smoke: bool, only: list[str]) -> int:
    """Sections write into a work folder; $OUT gets the archive of it, the table and the
    results (the device tool brings back at most 8 files)."""
    final = out_dir()
    work = Path(tempfile.mkdtemp(prefix="shoal-gpu-bench-"))
    os.environ[WORK_ENV] = str(work)
    out = out_dir()
    env = dict(os.environ)
    shim = make_shoal_importable()
    if shim is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
        log(f"shoal made importable from {shim}")
    if smoke and not _cuda_available():
        env.setdefault("TRITON_INTERPRET", "1")  # the kernels run on CPU through the interpreter
    for name in only:
        _, gpu_limit, smoke_limit = SECTIONS[name]
        limit = smoke_limit if smoke else gpu_limit
        (out / f"{name}.json").unlink(missing_ok=True)
        command = [sys.executable, str(HERE / "bench.py"), "--section", name] + (["--smoke"] if smoke else [])
        log(f"section {name} (limit {limit} s)")
        with open(out / f"{name}.log", "w") as log_file:
            try:
                code = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                      timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = -1
                partial = read_result(name) or {}  # the rows written before the limit stay
                write_result(name, {**partial, "error": f"timed out after {limit} s"
                                    + (" (rows so far kept)" if partial else "")})
        if read_result(name) is None:
            write_result(name, {"error": f"exited with code {code} before writing a result"})
        log(f"section {name} done (exit {code})")
    results = {name: read_result(name) for name in SECTIONS}
    table = render_table(results)
    for folder in (work, final):
        (folder / "table.txt").write_text(table + "\n")
        (folder / "results.json").write_text(json.dumps(results, indent=2, default=str))
    with tarfile.open(final / ARCHIVE, "w:gz") as archive:
        archive.add(work, arcname="bench")
    shutil.rmtree(work, ignore_errors=True)
    print(table, flush=True)
    return 0


def _cuda_available() -> bool:
    """Without importing torch here (each section imports it in its own process)."""
    return os.path.exists("/dev/nvidiactl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", "--dry-run", dest="smoke", action="store_true",
                        help="tiny shapes; runs on CPU (the kernels through the interpreter)")
    parser.add_argument("--section", choices=sorted(SECTIONS), help="run one section (child process)")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args(argv)
    if args.section:
        return run_section(args.section, args.smoke)
    return run_all(args.smoke, args.only)


if __name__ == "__main__":
    sys.exit(main())
