"""Checks before any rank process starts: fail at once with the reason, not later in NCCL."""

from __future__ import annotations

import os


def check_gpus_for_ranks(tensor_parallel_size: int, device: str, visible_gpus: int) -> None:
    """One GPU per tensor-parallel rank. With fewer visible, ranks would share a GPU (rank r
    takes ``cuda:r % count``) and NCCL refuses two ranks on one device with an error that does
    not say why; ``device`` is the resolved device (``cuda``, ``cuda:N`` or ``cpu``)."""
    if not device.startswith("cuda") or tensor_parallel_size <= 1:
        return
    if ":" in device:
        raise ValueError(f"--device {device} pins every rank to one GPU; tensor parallel size "
                         f"{tensor_parallel_size} needs one GPU per rank: use --device cuda")
    if tensor_parallel_size > visible_gpus:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} needs "
                         f"{tensor_parallel_size} GPUs, {visible_gpus} visible{where}")
