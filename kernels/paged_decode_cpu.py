"""The CPU decode-attention kernel (``paged_decode_cpu.c``): built on first use, called via ctypes.

Plain C with OpenMP, no torch headers: the C compiler builds it in about a second, so it is
compiled on the machine that runs it (``-march=native``) and cached under
``$SHOAL_CACHE_DIR/kernels`` (default ``~/.cache/shoal/kernels``), keyed by the source, the
flags, the compiler and the CPU, then renamed into place atomically so concurrent processes
never load a half-written library. Where no compiler exists, ``load()`` raises
``KernelUnavailable`` saying why, and callers fall back to the pure-torch path.

torch is imported before the library is loaded, so the library's OpenMP runtime resolves to
the one torch already loaded: one thread pool, sized by ``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# libmvec (vector expf) where glibc ships it; plain libm otherwise
LIBS = ("-lmvec", "-lm") if platform.machine() == "x86_64" else ("-lm",)


class KernelUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here (the reason is the message)."""


def _cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE_DIR") or Path.home() / ".cache" / "shoal"
    return Path(root) / "kernels"


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


def build(compiler: str | None = None) -> Path:
    """Compile the kernel (or find it already compiled); returns the library path."""
    compiler = compiler or _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_signature()])
                         .encode()).hexdigest()[:20]
    target = _cache_dir() / f"paged_decode_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial, *LIBS],
                                capture_output=True, text=True, check=False, timeout=300)
        if result.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build {SOURCE.name}:\n"
                                    f"{result.stderr.strip()}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def load() -> ctypes.CDLL:
    """The loaded library (built on first call); KernelUnavailable if it cannot be."""
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, hung compiler...
        raise KernelUnavailable(f"cannot build or load the CPU decode kernel: {exc}") from exc
    fn = library.shoal_paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, i64]
    fn.restype = ctypes.c_int
    return library


def unavailable_reason() -> str | None:
    """None when the kernel loads here, else why not."""
    try:
        load()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, dims: int,
           rows_only: bool = False) -> None:
    """Device, type and rank; contiguous, or (``rows_only``) each row contiguous."""
    if tensor.device.type != "cpu" or tensor.dtype != dtype or tensor.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d {dtype} CPU tensor, got "
                         f"{tensor.dim()}-d {tensor.dtype} on {tensor.device}")
    if not (tensor.stride(-1) == 1 if rows_only else tensor.is_contiguous()):
        raise ValueError(f"{name} must be contiguous")


def paged_decode_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor,
                           q_rows: torch.Tensor, table_rows: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> None:
    """Writes ``out[q_rows[r]]``: request r's single query row attending over its first
    ``seq_lens[r]`` cached positions (the last ``sliding_window`` of them, if set), read
    through ``block_tables[table_rows[r]]``. Other rows of ``out`` are left untouched.

    q/out ``[T, Hq, D]``; caches ``[blocks, block_size, Hk, D]``; all float32, contiguous.
    The caller guarantees indices are in range (they come from the engine's own plan)."""
    for name, t in (("q", q), ("out", out)):
        _check(name, t, torch.float32, 3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, t, torch.float32, 4)
    _check("block_tables", block_tables, torch.int32, 2, rows_only=True)
    _check("q_rows", q_rows, torch.int64, 1)
    _check("table_rows", table_rows, torch.int64, 1)
    _check("seq_lens", seq_lens, torch.int32, 1)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    count = q_rows.numel()
    if table_rows.numel() != count or seq_lens.numel() != count:
        raise ValueError("q_rows, table_rows and seq_lens must have one entry per request")
    if count == 0:
        return
    failed = load().shoal_paged_decode_f32(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), q_rows.data_ptr(),
        table_rows.data_ptr(), seq_lens.data_ptr(), count, num_heads, num_kv_heads, head_dim,
        block_size, scale, sliding_window or 0)
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
