"""Compile one ``KernelVariant`` for sm_90a with the installed triton, no GPU needed.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))``
runs the whole pipeline down to ptxas (the wheel carries it). Registers and spills come from
ptxas's ``-v`` report, which triton prints when ``TRITON_DUMP_PTXAS_LOG=1``; shared memory
from the compiled kernel's metadata; wgmma from the PTX.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import time
from dataclasses import asdict, dataclass

from shoal.kernels.gpu_check.variants import (
    REGISTERS_PER_BLOCK,
    SHARED_MEMORY_LIMIT,
    KernelVariant,
)

CAPABILITY = 90  # compiled as sm_90a: triton adds the "a" features for capability 90
WARP_SIZE = 32


@dataclass
class CompileResult:
    label: str
    shared_bytes: int = 0
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads, as ptxas reports them
    wgmma: bool = False
    seconds: float = 0.0
    error: str | None = None  # a compile error or a broken limit

    def to_json(self) -> dict:
        return asdict(self)


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> tuple[int, int]:
    """(registers, spill bytes) from ptxas -v output for a single entry function."""
    registers = max((int(m) for m in _REGISTERS.findall(log)), default=0)
    spills = sum(int(stores) + int(loads) for stores, loads in _SPILLS.findall(log))
    return registers, spills


def limit_errors(result: CompileResult, num_warps: int) -> list[str]:
    """The Hopper limits a compiled kernel breaks (empty when it fits)."""
    errors = []
    if result.shared_bytes > SHARED_MEMORY_LIMIT:
        errors.append(f"shared memory {result.shared_bytes} B > {SHARED_MEMORY_LIMIT} B")
    if result.registers * num_warps * WARP_SIZE > REGISTERS_PER_BLOCK:
        errors.append(f"{result.registers} registers x {num_warps * WARP_SIZE} threads > "
                      f"{REGISTERS_PER_BLOCK}")
    return errors


def _source(variant: KernelVariant):
    from triton.compiler import ASTSource

    names = variant.kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in variant.divisible_by_16()}
    return ASTSource(variant.kernel, variant.signature, variant.constexprs, attrs)


def cache_key(variant: KernelVariant) -> str:
    """Changes with triton's version, the kernel's source (triton's own hash of the function
    and what it calls), the signature, constexprs and launch options."""
    import triton

    parts = [triton.__version__, _source(variant).hash(), str(variant.num_warps),
             str(variant.num_stages), f"sm_{CAPABILITY}a"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def compile_variant(variant: KernelVariant) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget

    # read when compiling, not at import: print ptxas's report; compile even when triton's
    # own cache has the kernel (a cached kernel comes back without the report)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    result = CompileResult(variant.label)
    started = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                _source(variant), target=GPUTarget("cuda", CAPABILITY, WARP_SIZE),
                options=dict(num_warps=variant.num_warps, num_stages=variant.num_stages))
    except Exception as exc:  # noqa: BLE001 - every compile error is a finding to report
        result.error = f"{type(exc).__name__}: {str(exc).strip()[:2000]}"
        result.seconds = round(time.perf_counter() - started, 2)
        return result
    result.seconds = round(time.perf_counter() - started, 2)
    result.shared_bytes = int(kernel.metadata.shared)
    result.registers, result.spill_bytes = parse_ptxas_log(log.getvalue())
    result.wgmma = "wgmma.mma_async" in kernel.asm.get("ptx", "")
    errors = limit_errors(result, variant.num_warps)
    if not result.registers:
        errors.append("no register count in ptxas's report (was ptxas run?)")
    if errors:
        result.error = "; ".join(errors)
    return result
