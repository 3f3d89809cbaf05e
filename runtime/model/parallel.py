"""ParallelContext: which tensor-parallel rank this process is, and its collectives.

At world_size 1 every collective is a no-op, so the single-process path pays nothing. With
more ranks the group is a torch.distributed process group (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # torch.distributed.ProcessGroup; None = default group

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.world_size}")

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of an evenly divided dimension owned by this rank."""
        if total % self.world_size:
            raise ValueError(f"dimension {total} does not divide across {self.world_size} ranks")
        per = total // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()
