"""What gpu-check compiles: one ``KernelVariant`` per distinct compiled kernel.

Each kernel module that launches Triton kernels exposes ``gpu_variants()``, which walks the
shapes the engine can run on a GPU (``MODEL_SHAPES``, ``HEAD_DIMS``, ``GQA_GROUPS``,
``KV_DTYPES``) through the launcher's own choice function (the one its launcher calls to
pick tiles and constexprs), so the variants follow the launchers when their choices change.
Adding a kernel to the check is one line in ``REGISTERED`` (tests/kernels/test_gpu_check.py
fails while a ``@triton.jit`` function has no variant).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

# modules with a ``gpu_variants() -> list[KernelVariant]``: a kernel module itself, or a
# module here that enumerates one's variants; add a kernel by adding its line
REGISTERED = (
    "shoal.kernels.paged_attention",
    "shoal.kernels.reshape_and_cache",
    "shoal.kernels.rms_norm",
    "shoal.kernels.qk_norm_rotary",
    "shoal.kernels.silu_and_mul",
    "shoal.kernels.lora_batched",
    "shoal.kernels.gated_delta_rule",
    "shoal.kernels.gpu_check.fused_moe_variants",
    "shoal.kernels.dequant_gemm",
)

# Hopper (sm_90): 227 KiB of shared memory per block, 64K registers per SM / block
SHARED_MEMORY_LIMIT = 227 * 1024
REGISTERS_PER_BLOCK = 65536

# the GPU shape space the launchers are walked over
HEAD_DIMS = (64, 96, 128, 256)
GQA_GROUPS = tuple(range(1, 17))
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # model dtype = K/V cache dtype
BLOCK_SIZES = (16,)  # --block-size default; the cache page is a constexpr of the kernels
TP_SIZES = (1, 2, 4, 8)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # decode rows (--max-num-seqs <= 512)
TARGET_SM_COUNT = 132  # H100/H200 SXM


TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                torch.int32: "i32", torch.int64: "i64"}


def triton_type(dtype: torch.dtype) -> str:
    return TRITON_TYPES[dtype]


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int


# families whose shapes differ where a kernel's constexprs do (head dim, head counts, hidden)
MODEL_SHAPES = (
    ModelShape("SmolLM2-135M", 576, 9, 3, 64, 1536),
    ModelShape("Qwen3-0.6B", 1024, 16, 8, 128, 3072),
    ModelShape("Gemma-2-2B", 2304, 8, 4, 256, 9216),
    ModelShape("Phi-3-mini", 3072, 32, 32, 96, 8192),
    ModelShape("Qwen2.5-7B", 3584, 28, 4, 128, 18944),
    ModelShape("Qwen3-8B", 4096, 32, 8, 128, 12288),
    ModelShape("Llama-3-8B", 4096, 32, 8, 128, 14336),
    ModelShape("Qwen2.5-14B", 5120, 40, 8, 128, 13824),
    ModelShape("Llama-3-70B", 8192, 64, 8, 128, 28672),
)


@dataclass(frozen=True)
class LinearAttnShape:
    """A hybrid model's Gated DeltaNet layers (``linear_*`` in its config)."""

    name: str
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int


LINEAR_ATTN_SHAPES = (
    LinearAttnShape("Qwen3-Next-80B-A3B", 16, 32, 128, 128, 4),
    LinearAttnShape("Qwen3.5-2B", 16, 16, 128, 128, 4),
    LinearAttnShape("Qwen3.5-27B", 16, 48, 128, 128, 4),
    LinearAttnShape("Qwen3.5-397B-A17B", 16, 64, 128, 128, 4),
)


def sharded_linear_attn_shapes() -> list[tuple[LinearAttnShape, int]]:
    """Every (hybrid model, tensor parallel size) whose key heads split over the ranks."""
    return [(m, tp) for m in LINEAR_ATTN_SHAPES for tp in TP_SIZES if m.num_k_heads % tp == 0]


def sharded_shapes() -> list[tuple[ModelShape, int]]:
    """Every (model, tensor parallel size) whose heads split evenly over the ranks."""
    return [(m, tp) for m in MODEL_SHAPES for tp in TP_SIZES
            if m.num_heads % tp == 0 and (m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0)]


@dataclass(frozen=True)
class KernelVariant:
    """One compile: the jit function, its argument types and constexprs, launch options."""

    label: str  # e.g. "paged_attention decode bf16 d128 group_pad8"
    kernel: Any  # triton.JITFunction
    signature: dict[str, str]  # every parameter: "*bf16", "i32", "fp32" or "constexpr"
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    tags: dict[str, Any] = field(default_factory=dict)  # shown in the report (dtype, mode, ...)
    # the JIT marks pointers and integers that are multiples of 16 ("tt.divisibility"), which
    # lets loads vectorise; pointers and strides are, except those named here
    unaligned: tuple[str, ...] = ()

    def divisible_by_16(self) -> list[str]:
        return [name for name, ty in self.signature.items()
                if (ty.startswith("*") or name.startswith("stride_")) and name not in self.unaligned]

    def key(self) -> tuple:
        """Two variants with the same key compile to the same kernel."""
        return (self.kernel.fn.__name__, tuple(sorted(self.signature.items())),
                tuple(sorted((k, str(v)) for k, v in self.constexprs.items())),
                self.num_warps, self.num_stages, self.unaligned)


def signature(kernel: Any, constexprs: dict[str, Any], pointers: dict[str, str],
              floats: tuple[str, ...] = ()) -> dict[str, str]:
    """The Triton signature of ``kernel``'s parameters: ``pointers`` maps each ``*_ptr``
    parameter to its element type, ``floats`` are fp32 scalars, other scalars are i32."""
    result = {}
    for name in kernel.arg_names:
        if name in constexprs or _is_constexpr(kernel, name):
            result[name] = "constexpr"
        elif name in pointers:
            result[name] = "*" + pointers[name]
        elif name.endswith("_ptr"):
            raise ValueError(f"{kernel.fn.__name__}: no element type given for {name}")
        else:
            result[name] = "fp32" if name in floats else "i32"
    missing = set(constexprs) - set(result)
    if missing:
        raise ValueError(f"{kernel.fn.__name__} has no parameters {sorted(missing)}")
    return result


def _is_constexpr(kernel: Any, name: str) -> bool:
    """From the Python signature, so that it works on interpreted kernels too (tests)."""
    annotation = inspect.signature(kernel.fn).parameters[name].annotation
    return "constexpr" in str(annotation)


def unique(variants: list[KernelVariant]) -> list[KernelVariant]:
    """Drop variants that compile to the same kernel (many shapes share one tile)."""
    seen: dict[tuple, KernelVariant] = {}
    for variant in variants:
        seen.setdefault(variant.key(), variant)
    return list(seen.values())
