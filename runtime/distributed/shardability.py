"""Can this model be split over N tensor-parallel ranks? Checked before any rank starts.

The parallel layers split attention heads, the MLP's intermediate dimension and the
vocabulary (padded) over ranks; KV heads are split when there are at least as many as ranks
and replicated otherwise. A shape that does not divide is a configuration error, reported
in one message naming every dimension at fault instead of as a rank's traceback.
"""

from __future__ import annotations

from shoal.runtime.model.config import ModelConfig


def shard_problems(config: ModelConfig, world_size: int) -> list[str]:
    if world_size < 1:
        return [f"tensor_parallel_size must be at least 1, got {world_size}"]
    problems = []
    lin = config.linear_attn
    if lin is not None and lin.num_k_heads % world_size:
        # Gated DeltaNet layers split whole key heads (and their value heads) over ranks
        problems.append(f"{lin.num_k_heads} linear-attention key heads "
                        f"(linear_num_key_heads) do not divide across {world_size} ranks")
    if config.num_heads % world_size:
        problems.append(f"{config.num_heads} attention heads do not divide across "
                        f"{world_size} ranks")
    kv = config.num_kv_heads
    if kv >= world_size and kv % world_size:
        problems.append(f"{kv} KV heads do not divide across {world_size} ranks")
    if kv < world_size and world_size % kv:
        problems.append(f"{world_size} ranks cannot replicate {kv} KV heads evenly "
                        f"(the rank count must be a multiple of the KV head count)")
    if config.intermediate_size % world_size:
        problems.append(f"MLP intermediate size {config.intermediate_size} does not divide "
                        f"across {world_size} ranks")
    moe = config.moe
    for what, size in (("expert", moe.intermediate_size if moe else 0),
                       ("shared expert", moe.shared_intermediate_size if moe else 0)):
        if size % world_size:
            problems.append(f"{what} intermediate size {size} does not divide across "
                            f"{world_size} ranks")
    return problems


def check_shardable(config: ModelConfig, world_size: int) -> None:
    problems = shard_problems(config, world_size)
    if problems:
        raise ValueError(f"cannot split {config.architecture} over tensor_parallel_size="
                         f"{world_size}: " + "; ".join(problems))
