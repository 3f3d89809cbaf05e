"""Where a Triton kernel can run: CUDA tensors, or any tensors under the interpreter.

``TRITON_INTERPRET=1`` must be in the environment before this package is imported (triton
decides at ``@triton.jit`` time); tests set it in their conftest. A kernel launched on CPU
tensors without it would fail deep inside triton with an unhelpful message, so launchers
check first and say what to do.
"""

from __future__ import annotations

import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# triton chose compiled or interpreted kernels when this package was imported
INTERPRETED = interpreter_enabled()


def check_launchable(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"kernel inputs are on different devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "cuda":
        return
    if device.type == "cpu" and INTERPRETED:
        return
    raise RuntimeError(
        f"Triton kernels run on CUDA tensors, got {device}; on CPU set TRITON_INTERPRET=1 "
        "before importing triton (slow, for tests) or use the torch attention backend"
    )
