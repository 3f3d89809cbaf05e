"""One torch.distributed process group per engine: gloo on CPU, NCCL on CUDA.

Ranks of one engine live on one machine, so rendezvous goes through a file the executor
names (no port to race for) and gloo talks over loopback unless the operator chose an
interface. The ParallelContext handed to the model wraps the default group.
"""

from __future__ import annotations

import datetime
import os

import torch
from shoal.runtime.model.parallel import ParallelContext


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, rendezvous_file: str,
                         device: torch.device, timeout_s: float) -> ParallelContext:
    """Join the engine's process group and return this rank's ParallelContext.

    ``timeout_s`` bounds the rendezvous and every collective; the executor's rank timeout
    is what normally ends a hung step, this is the backstop inside the rank.
    """
    import torch.distributed as dist

    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid tensor-parallel rank {rank} of {world_size}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend=backend_for(device),
        init_method=f"file://{rendezvous_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=max(1.0, timeout_s)),
    )
    return ParallelContext(rank=rank, world_size=world_size, group=None)


def destroy_tensor_parallel() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
