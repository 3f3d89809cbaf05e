"""Pick the attention backend by name. Only the pure-torch reference exists here; faster
backends register in ``_BACKENDS`` and decide what ``auto`` means for their devices."""

from __future__ import annotations

from collections.abc import Callable

import torch
from shoal.runtime.attention.backend import AttentionBackend


def _torch_backend() -> AttentionBackend:
    from shoal.runtime.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch_backend}


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` is the torch backend everywhere until a faster one claims the device."""
    if name == "auto":
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, "
                         f"{', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()
