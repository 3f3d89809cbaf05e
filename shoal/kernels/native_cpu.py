"""The native CPU library (``paged_decode_cpu.c``, ``paged_prefill_cpu.c``, ``cpu_ops.c``,
``kv_fp8_cpu.c``, ``cpu_ops_bf16.c``, ``int_matmul_cpu.c``,
``moe_experts_cpu.c``, ``linear_panels_cpu.c``; headers ``panel_cpu.h``, the panel multiply
of the last two, and ``bf16_cpu.h``):
prebuilt at install, else built on first use, via ctypes.

Plain C with OpenMP, no torch headers: the C compiler builds it in about a second, so it is
compiled on the machine that runs it (``-march=native``) and cached under
``$SHOAL_CACHE_DIR/kernels`` (default ``~/.cache/shoal/kernels``), keyed by the sources, the
flags, the compiler and the CPU, then renamed into place atomically so concurrent processes
never load a half-written library. Where no compiler exists, ``load()`` raises
``KernelUnavailable`` saying why, and callers fall back to the pure-torch path.

``make setup`` prebuilds it into the same cache with ``python -m shoal.kernels.native_cpu
--build``, so a first ``shoal serve`` does not pay the compile (100-120 s for the prefill kernel
on a loaded 2-core machine). An image build prebuilds it with ``--build --into DIR`` into a
read-only prebuilt directory outside the cache (``$SHOAL_PREBUILT_KERNELS``, default
``/opt/shoal/kernels``): whatever volume is mounted over the cache, a library there with this
process's key is loaded as it is, nothing compiled or written. A process on another CPU (or
with another compiler) computes another key, so it finds no prebuilt match and builds its own
in the cache or falls back; it never loads a library tuned for a different CPU.

torch is imported before the library is loaded, so the library's OpenMP runtime resolves to
the one torch already loaded: one thread pool, sized by ``torch.set_num_threads``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (loaded first: its OpenMP runtime is the one the library binds to)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_decode_cpu.c", "paged_prefill_cpu.c", "cpu_ops.c",
                             "kv_fp8_cpu.c", "cpu_ops_bf16.c", "int_matmul_cpu.c",
                             "moe_experts_cpu.c", "linear_panels_cpu.c"))
# included by the sources above: part of the library's key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("panel_cpu.h", "bf16_cpu.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# libmvec (vector expf) where glibc ships it; plain libm otherwise
LIBS = ("-lmvec", "-lm") if platform.machine() == "x86_64" else ("-lm",)

# wall-clock limit on building the library (a hung compiler): on the loaded 2-core machine the
# decode kernel alone took 921 s of wall time for 108 s of CPU
COMPILE_TIMEOUT_S = 1800
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# exported function -> (return type, argument types)
SIGNATURES: dict[str, tuple[type | None, list]] = {
    "shoal_paged_decode": (ctypes.c_int, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                                          _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                          _i64, _f32, _i64, _ptr, _ptr]),
    "shoal_paged_prefill": (ctypes.c_int, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                                           _i64, _i64, _i64, _i64, _i64, _f32, _i64,
                                           _f32, _i64, _ptr, _ptr]),
    "shoal_fp8_table": (None, [_i64, _f32, _ptr]),
    "shoal_rms_norm_f32": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32]),
    "shoal_silu_and_mul_f32": (None, [_ptr, _i64, _ptr, _i64, _i64, _i64]),
    "shoal_rotary_neox_f32": (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64]),
    "shoal_write_kv": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64]),
    "shoal_rms_norm_bf16": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32]),
    "shoal_silu_and_mul_bf16": (None, [_ptr, _i64, _ptr, _i64, _i64, _i64]),
    "shoal_rotary_neox_bf16": (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64]),
    "shoal_qk_norm_rotary_bf16": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _f32, _ptr,
                                         _ptr, _i64, _i64]),
    "shoal_int_matmul_f32": (None, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                    _i64, _i64, _ptr, _i64]),
    "shoal_int_dequant_f32": (None, [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                     _ptr]),
    "shoal_moe_experts_scratch_bytes": (_i64, [_i64, _i64, _i64, _i64, _i64]),
    "shoal_moe_experts": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr,
                                         _ptr, _i64, _ptr, _i64, _ptr]),
    "shoal_moe_experts_packed": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr,
                                                _ptr, _ptr, _i64, _ptr, _i64, _ptr]),
    "shoal_moe_experts_q": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr,
                                           _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
                                           _i64, _i64, _i64, _ptr, _i64, _ptr]),
    "shoal_linear_panels": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]),
}


class KernelUnavailable(RuntimeError):
    """The native library cannot be built or loaded here (the reason is the message)."""


DEFAULT_PREBUILT_DIR = "/opt/shoal/kernels"


def _cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE_DIR") or Path.home() / ".cache" / "shoal"
    return Path(root) / "kernels"


def _prebuilt_dir() -> Path:
    return Path(os.environ.get("SHOAL_PREBUILT_KERNELS") or DEFAULT_PREBUILT_DIR)


def _cpu_signature() -> str:
    """The CPU the library is tuned for (-march=native): model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def _compiler() -> str:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C compiler ({compiler!r} not on PATH; set CC)")
    return compiler


def _library_name(compiler: str) -> str:
    """The file name: a key over the sources, flags, compiler version and CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False, timeout=60).stdout
    sources = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*sources, *FLAGS, version, _cpu_signature()])
                         .encode()).hexdigest()[:20]
    return f"shoal_cpu-{key}.so"


def library_path(compiler: str | None = None, into: Path | None = None) -> Path:
    """Where the library for these sources, flags, compiler and CPU lives in the cache (or in
    ``into``)."""
    compiler = compiler or _compiler()
    return (into or _cache_dir()) / _library_name(compiler)


def prebuilt_path(compiler: str | None = None) -> Path | None:
    """The library with this process's key in the prebuilt directory, if one is there and
    readable; a missing or unreadable directory is no prebuilt library, not an error."""
    candidate = _prebuilt_dir() / _library_name(compiler or _compiler())
    try:
        return candidate if candidate.is_file() and os.access(candidate, os.R_OK) else None
    except OSError:  # a directory we may not search
        return None


def build(compiler: str | None = None, into: Path | None = None) -> Path:
    """The library's path: the prebuilt one when it matches, else compiled into the cache (or
    found there already compiled). ``into`` compiles into that directory instead (the image
    build's prebuilt directory) and ignores the prebuilt one."""
    compiler = compiler or _compiler()
    if into is None and (prebuilt := prebuilt_path(compiler)) is not None:
        return prebuilt
    target = library_path(compiler, into)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            linked = [compiler, *FLAGS, *_compile_objects(compiler, Path(objects)), "-o",
                      partial, *LIBS]
            result = subprocess.run(linked, capture_output=True, text=True, check=False,
                                    timeout=COMPILE_TIMEOUT_S)
            if result.returncode != 0:
                raise KernelUnavailable(f"{compiler} failed to link the native kernels:\n"
                                        f"{result.stderr.strip()}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _compile_objects(compiler: str, into: Path) -> list[str]:
    """Each source compiled to an object file, all at once (one process each: the decode and
    prefill kernels take most of the time, and each gets a core where there are two)."""
    flags = [flag for flag in FLAGS if flag != "-shared"]
    started = []
    for source in SOURCES:
        obj = str(into / f"{source.stem}.o")
        started.append((source, obj, subprocess.Popen(
            [compiler, *flags, "-c", str(source), "-o", obj], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)))
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    failures = []
    try:
        for source, _, proc in started:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                failures.append(f"{source.name}:\n{err.strip()}")
    finally:
        for _, _, proc in started:
            if proc.poll() is None:  # timed out: no compiler left running behind us
                proc.kill()
                proc.wait()
    if failures:
        raise KernelUnavailable(f"{compiler} failed to build " + "\n".join(failures))
    return [obj for _, obj, _ in started]


@functools.cache
def load() -> ctypes.CDLL:
    """The loaded library (built on first call); KernelUnavailable if it cannot be."""
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, hung compiler...
        raise KernelUnavailable(f"cannot build or load the native CPU kernels: {exc}") from exc
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = restype, argtypes
    return library


def unavailable_reason() -> str | None:
    """None when the library loads here, else why not."""
    try:
        load()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def prebuild(into: Path | None = None) -> int:
    """``python -m shoal.kernels.native_cpu --build [--into DIR]``: compile now (install or
    image build time) into the cache, or into DIR (an image's prebuilt directory). Exit 0 either
    way: without a compiler the runtime uses the torch path."""
    try:
        path = build(into=into)
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as exc:
        print(f"native CPU kernels not prebuilt (the torch path will be used): {exc}")
        return 0
    print(f"native CPU kernels: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.kernels.native_cpu",
                                     description="Prebuild the native CPU kernels.")
    parser.add_argument("--build", action="store_true", required=True,
                        help="compile the library now (into $SHOAL_CACHE_DIR/kernels)")
    parser.add_argument("--into", type=Path, metavar="DIR",
                        help="compile into DIR instead: a read-only prebuilt directory for "
                             "$SHOAL_PREBUILT_KERNELS (an image build)")
    args = parser.parse_args(argv)
    return prebuild(args.into)


if __name__ == "__main__":
    sys.exit(main())
