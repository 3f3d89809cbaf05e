"""Section ``env``: what the machine has, and its device copy bandwidth (the roofline)."""

from __future__ import annotations

import importlib.util

import torch
from common import copy_bandwidth_gbps, log, python_version


def run(smoke: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info: dict = {
        "python": python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "flashinfer_installed": importlib.util.find_spec("flashinfer") is not None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        info["memory_gib"] = round(total / 2**30, 1)
        info["free_gib"] = round(free / 2**30, 1)
    nbytes = (64 if smoke else 2048) * 2**20
    info["copy_bandwidth_gbps"] = copy_bandwidth_gbps(device, nbytes)
    log(f"environment: {info}")
    return info
