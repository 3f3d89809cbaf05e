"""Peer check: Shoal's KV-event batches decode with vLLM's own classes.

    .venv/bin/python bench/kv_events_vllm_check.py VLLM_VENV

Encodes a batch from a real block pool (stored run with parent and token ids, evictions,
clear) here, then decodes it in the vLLM venv with ``msgspec.msgpack.decode(..., type=
vllm.distributed.kv_events.KVEventBatch)`` and checks every field. Exit 0 when it agrees.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
from shoal.runtime.kv.block_pool import BlockPool
from shoal.runtime.kv.events import AllBlocksCleared, EventBatch

DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
batch = msgspec.msgpack.decode(open(sys.argv[1], "rb").read(), type=KVEventBatch)
stored = batch.events[0]
assert stored.block_hashes == [11, 2**63 + 5] and stored.parent_block_hash == 7
assert stored.token_ids == list(range(8)) and stored.block_size == 4
assert sorted(h for e in batch.events[1:3] for h in e.block_hashes) == [11, 2**63 + 5]
assert type(batch.events[-1]).__name__ == "AllBlocksCleared"
assert batch.data_parallel_rank == 0
print("decoded by vLLM's KVEventBatch:", batch)
"""


def main(vllm_venv: str) -> int:
    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [11, 2**63 + 5], 7, 4, list(range(8)))
    pool.free(reversed(blocks))
    pool.allocate(4)  # evicts both
    events = pool.drain_events() + [AllBlocksCleared()]
    with tempfile.TemporaryDirectory() as tmp:
        payload = Path(tmp) / "batch.msgpack"
        payload.write_bytes(msgspec.msgpack.encode(EventBatch(1.5, events, 0)))
        # from the temp dir: the repository root would shadow the stdlib (its operator/)
        return subprocess.call([f"{vllm_venv}/bin/python", "-c", DECODE, str(payload)],
                               cwd=tmp)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: kv_events_vllm_check.py VLLM_VENV (a venv with vLLM's CPU build)")
    sys.exit(main(sys.argv[1]))
