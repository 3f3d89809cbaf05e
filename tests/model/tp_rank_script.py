"""One tensor-parallel rank for test_tensor_parallel.py (run as a script, not collected).

usage: tp_rank_script.py MODEL_DIR[,MODEL_DIR...] RANK WORLD PORT OUT
For each model: a fixed mixed prefill step and a decode step through a Worker holding this
rank's shard; rank 0 saves {model_dir: logits of both steps} to OUT.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from shoal.runtime.config import EngineConfig
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.plan import NewRequestData, StepPlan
from shoal.runtime.worker.worker import Worker

BLOCK = 4


def plan_for(prompts: list[list[int]], step: int, decode_tokens: list[int] | None) -> StepPlan:
    """Contiguous blocks per request: request i owns blocks [i*8, i*8+8)."""
    ids, pos, qsl, lens, slots = [], [], [0], [], []
    for i, p in enumerate(prompts):
        run = range(len(p)) if decode_tokens is None else [len(p)]
        tokens = p if decode_tokens is None else [decode_tokens[i]]
        for t, position in zip(tokens, run, strict=True):
            ids.append(t)
            pos.append(position)
            slots.append(i * 8 * BLOCK + position)
        qsl.append(qsl[-1] + len(tokens))
        lens.append(run[-1] + 1)
    tables = np.array([[i * 8 + b for b in range(8)] for i in range(len(prompts))], np.int32)
    new = [NewRequestData(f"r{i}", p, [], SamplingParams(temperature=0.0))
           for i, p in enumerate(prompts)] if decode_tokens is None else []
    return StepPlan(step, [f"r{i}" for i in range(len(prompts))], np.array(ids, np.int64),
                    np.array(pos, np.int64), np.array(qsl, np.int32), np.array(lens, np.int32),
                    tables, np.array(slots, np.int64), np.ones(len(prompts), bool), new)


def main() -> None:
    model_dirs, rank, world, port, out = sys.argv[1].split(","), int(sys.argv[2]), \
        int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    results = {model_dir: run_model(model_dir, rank, world) for model_dir in model_dirs}
    if rank == 0:
        torch.save(results, out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_model(model_dir: str, rank: int, world: int) -> dict:
    worker = Worker(EngineConfig(model=model_dir, device="cpu", dtype="float32",
                                 block_size=BLOCK), rank=rank, world_size=world)
    worker.load_model()
    worker.init_kv_cache(32)
    gen = torch.Generator().manual_seed(0)
    vocab = worker.model_config().vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 1, 12)]
    prefill = worker.runner.forward(plan_for(prompts, 1, None))
    decode = worker.runner.forward(plan_for(prompts, 2, [5, 6, 7]))
    return {"prefill": prefill, "decode": decode, "kv_heads": worker.runner.num_kv_heads}


if __name__ == "__main__":
    main()
