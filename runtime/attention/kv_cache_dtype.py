"""``--kv-cache-dtype``: the KV cache's element type, and how K/V rows go into a float8 cache
and come back out.

vLLM's semantics: ``auto`` stores K/V in the model's dtype; ``fp8`` (= ``fp8_e4m3``) and
``fp8_e5m2`` store one byte per element, so a block takes half a bfloat16 block's bytes
and the same memory holds twice the blocks. A stored element is ``x / scale`` saturated to
the format's finite range (e4m3: +-448; e5m2: +-57344; torch's cast would turn an e5m2
overflow into inf); it reads back as ``stored * scale``. One scale per layer for K and one
for V (``kv_scales``, float32 ``[2]`` on the cache's device, read by the kernels at run
time so captured CUDA graphs follow it): the checkpoint's ``k_scale`` / ``v_scale`` where it
has them (``model/kv_scales.py``), else 1.0.

A backend reads float8 rows widened to its compute type with the scales applied, and
attends over what the cache holds for every token, this step's included: a prompt's
attention does not depend on how it was chunked or whether its prefix came from the cache.
"""

from __future__ import annotations

import torch
from shoal.runtime.config import KV_CACHE_DTYPES

# what a backend must implement to run a float8 cache (backend_choice.BACKEND_FEATURES)
FP8_KV_FEATURE = "fp8_kv_cache"

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``--kv-cache-dtype name`` and a ``model_dtype`` model."""
    if name == "auto":
        return model_dtype
    if name not in _FP8:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return _FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def attention_needs(name: str, model_needs: frozenset[str] = frozenset()) -> frozenset[str]:
    """The backend features a ``--kv-cache-dtype name`` cache needs for a model whose
    attention needs ``model_needs``; ValueError for a model whose cache has no float8 path."""
    if name not in _FP8:
        return frozenset()
    if "latent_attention" in model_needs:
        raise ValueError(f"--kv-cache-dtype {name}: the latent attention (MLA) cache has no "
                         "float8 path here; use --kv-cache-dtype auto")
    return frozenset({FP8_KV_FEATURE})


def unit_scales(device: torch.device | str) -> torch.Tensor:
    """A layer's (k_scale, v_scale) before a checkpoint says otherwise."""
    return torch.ones(2, dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float8 ``dtype``, saturated to its finite range."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float8 ``x`` back in ``dtype``: ``x * scale``."""
    return (x.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What a ``cache_dtype`` cache gives back for ``x``."""
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)


def write_fp8_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: torch.Tensor) -> None:
    """This step's K/V ``[T, Hk, D]`` quantized into their slots of a float8 cache (copied as
    bytes: torch has no float8 ``index_copy_`` on CPU)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for x, cache, scale in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])):
        rows = quantize(x, scale, cache.dtype).view(torch.uint8)
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, rows)
