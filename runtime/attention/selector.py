"""Pick the attention backend by name (``--attention-backend``).

What ``auto`` means and which explicit choices can run where is the pure rule in
``backend_choice.py`` (triton on CUDA, flashinfer only when asked for; on CPU the
native decode kernel for float32 models when it builds, else torch).
Backends are imported only once chosen: flashinfer only on CUDA, triton only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from shoal.runtime.attention.backend import AttentionBackend
from shoal.runtime.attention.backend_choice import choose_for_device


def _torch_backend(dtype: torch.dtype) -> AttentionBackend:
    from shoal.runtime.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _cpu_backend(dtype: torch.dtype) -> AttentionBackend:
    from shoal.runtime.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(dtype)


def _triton_backend(dtype: torch.dtype) -> AttentionBackend:
    from shoal.runtime.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _flashinfer_backend(dtype: torch.dtype) -> AttentionBackend:
    from shoal.runtime.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend()


_BACKENDS: dict[str, Callable[[torch.dtype], AttentionBackend]] = {
    "torch": _torch_backend,
    "cpu": _cpu_backend,
    "triton": _triton_backend,
    "flashinfer": _flashinfer_backend,
}


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                          needs: frozenset[str] = frozenset()) -> AttentionBackend:
    """The backend for ``name`` on ``device`` for a ``dtype`` model whose attention needs
    ``needs`` (``backend_choice.BACKEND_FEATURES``); ValueError says why a choice cannot run."""
    chosen = choose_for_device(name, device.type,
                               dtype_native=dtype in (torch.float32, torch.bfloat16),
                               needs=needs)
    return _BACKENDS[chosen](dtype)
