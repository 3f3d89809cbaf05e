"""Size the KV cache on a GPU from a profiled maximum-size step.

The arithmetic (pure, tested on CPU):

    usable      = total * gpu_memory_utilization
    kv_bytes    = usable - weights - activation peak - non-torch memory - graph reserve
    num_blocks  = kv_bytes // bytes_per_block        tokens = num_blocks * block_size

``weights`` is what torch holds before the dummy step, ``activation peak`` the extra peak
it reached during a step of ``max_num_batched_tokens`` tokens, ``non-torch`` what the
device shows in use beyond torch's reservation (CUDA context, cuBLAS workspaces, NCCL).
CUDA graphs are captured after the KV cache exists and draw on what ``utilization`` left
over; their measured pool is logged afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from shoal.runtime.config import check_range

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class StepProfile:
    total_bytes: int  # device memory
    weights_bytes: int  # torch-allocated before the step
    activation_peak_bytes: int  # torch peak during the step, beyond the weights
    non_torch_bytes: int  # in use on the device but not reserved by torch


@dataclass(frozen=True)
class KVBudget:
    total_bytes: int
    utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    graph_reserve_bytes: int
    bytes_per_block: int
    block_size: int
    kv_bytes: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"KV cache budget: {_gib(self.total_bytes)} x {self.utilization:g} = "
            f"{_gib(int(self.total_bytes * self.utilization))} usable - weights "
            f"{_gib(self.weights_bytes)} - activations {_gib(self.activation_peak_bytes)} - "
            f"non-torch {_gib(self.non_torch_bytes)} - graphs {_gib(self.graph_reserve_bytes)} "
            f"= {_gib(self.kv_bytes)} for KV -> {self.num_blocks} blocks of "
            f"{self.bytes_per_block} B = {self.num_tokens} tokens"
        )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def kv_cache_budget(
    profile: StepProfile,
    utilization: float,
    bytes_per_block: int,
    block_size: int,
    graph_reserve_bytes: int = 0,
) -> KVBudget:
    """The budget arithmetic; raises with the numbers when not even one block fits."""
    check_range("gpu_memory_utilization", utilization)
    if bytes_per_block <= 0 or block_size <= 0:
        raise ValueError("bytes_per_block and block_size must be positive")
    usable = int(profile.total_bytes * utilization)
    kv_bytes = (usable - profile.weights_bytes - profile.activation_peak_bytes
                - profile.non_torch_bytes - graph_reserve_bytes)
    budget = KVBudget(
        total_bytes=profile.total_bytes,
        utilization=utilization,
        weights_bytes=profile.weights_bytes,
        activation_peak_bytes=profile.activation_peak_bytes,
        non_torch_bytes=profile.non_torch_bytes,
        graph_reserve_bytes=graph_reserve_bytes,
        bytes_per_block=bytes_per_block,
        block_size=block_size,
        kv_bytes=max(kv_bytes, 0),
        num_blocks=max(kv_bytes, 0) // bytes_per_block,
    )
    if budget.num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {budget.describe()}; raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens, or use a smaller model"
        )
    return budget


def profile_cuda_step(
    run_max_step: Callable[[], None], device: torch.device, probe_kv_bytes: int = 0
) -> StepProfile:
    """Run the maximum-size dummy step once and read what it cost on ``device``.

    ``probe_kv_bytes``: a small KV cache allocated only so the dummy step can run; it is
    not part of the weights and is freed before the real cache is sized.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device) - probe_kv_bytes
    run_max_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max((total - free) - torch.cuda.memory_reserved(device), 0)
    profile = StepProfile(
        total_bytes=total,
        weights_bytes=weights,
        activation_peak_bytes=max(peak - weights - probe_kv_bytes, 0),
        non_torch_bytes=non_torch,
    )
    logger.info(
        "profiled a max-size step: weights %s, activation peak %s, non-torch %s of %s",
        _gib(profile.weights_bytes), _gib(profile.activation_peak_bytes),
        _gib(profile.non_torch_bytes), _gib(profile.total_bytes),
    )
    return profile


def size_kv_cache(
    run_max_step: Callable[[], None],
    device: torch.device,
    probe_kv_bytes: int,
    utilization: float,
    bytes_per_block: int,
    block_size: int,
) -> KVBudget:
    """Profile, do the arithmetic, log it: the KV cache a GPU worker should allocate."""
    budget = kv_cache_budget(profile_cuda_step(run_max_step, device, probe_kv_bytes),
                             utilization, bytes_per_block, block_size)
    logger.info(budget.describe())
    return budget
