"""Helpers for model-side tests: a tiny paged-KV bookkeeper that builds StepPlans.

``PagedPlanner`` hands out blocks in a shuffled order (so block tables are not contiguous)
and writes plans the way the engine core does: flat tokens, positions, query start offsets,
context lengths, block tables and slot mappings.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.plan import NewRequestData, StepPlan


@dataclass
class _Seq:
    req_id: str
    tokens: list[int]  # every token whose KV exists or is being computed
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class PagedPlanner:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, _Seq] = {}
        self.step_id = 0

    def add(self, req_id: str, tokens: list[int], shared_from: str | None = None,
            shared_blocks: int = 0) -> None:
        """Register a request; optionally reuse the first full blocks of another (prefix hit)."""
        seq = _Seq(req_id, list(tokens))
        if shared_from is not None:
            seq.blocks = self.seqs[shared_from].blocks[:shared_blocks]
            seq.computed = shared_blocks * self.block_size
        self.seqs[req_id] = seq

    def plan(self, chunks: dict[str, int | list[int]], new: list[NewRequestData] | None = None,
             sample: dict[str, bool] | None = None) -> StepPlan:
        """``chunks``: req id -> number of its pending tokens to run, or a list of newly
        appended (decode) tokens to run."""
        ids, pos, qsl, seq_lens, tables, slots, samples = [], [], [0], [], [], [], []
        for req_id, chunk in chunks.items():
            seq = self.seqs[req_id]
            if isinstance(chunk, list):
                seq.tokens.extend(chunk)
                count = len(chunk)
            else:
                count = chunk
            start, end = seq.computed, seq.computed + count
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            for p in range(start, end):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // self.block_size] * self.block_size
                             + p % self.block_size)
            seq.computed = end
            qsl.append(qsl[-1] + count)
            seq_lens.append(end)
            tables.append(list(seq.blocks))
            samples.append(sample.get(req_id, end == len(seq.tokens)) if sample
                           else end == len(seq.tokens))
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        self.step_id += 1
        return StepPlan(
            step_id=self.step_id, req_ids=list(chunks), input_ids=np.array(ids, dtype=np.int64),
            positions=np.array(pos, dtype=np.int64), query_start_loc=np.array(qsl, dtype=np.int32),
            seq_lens=np.array(seq_lens, dtype=np.int32), block_tables=block_tables,
            slot_mapping=np.array(slots, dtype=np.int64),
            sample_rows=np.array(samples, dtype=bool), new_requests=new or [])


@pytest.fixture
def planner_factory():
    return PagedPlanner


@pytest.fixture
def new_request():
    def make(req_id: str, prompt: list[int], **params: object) -> NewRequestData:
        return NewRequestData(req_id, list(prompt), [], SamplingParams(**params))  # type: ignore[arg-type]
    return make


@pytest.fixture
def engine_config():
    def make(model_dir, **kw: object) -> EngineConfig:
        kw.setdefault("device", "cpu")
        kw.setdefault("dtype", "float32")
        kw.setdefault("attention_backend", "torch")
        return EngineConfig(model=str(model_dir), **kw)  # type: ignore[arg-type]
    return make


@pytest.fixture
def load_worker(engine_config):
    """A loaded Worker with a KV cache of ``num_blocks`` blocks."""
    from shoal.runtime.worker.worker import Worker

    def make(model_dir, num_blocks: int = 64, **kw: object):
        worker = Worker(engine_config(model_dir, **kw))
        worker.load_model()
        worker.init_kv_cache(num_blocks)
        return worker
    return make


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers' own model for a checkpoint dir (the reference), cached per dir."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def get(model_dir):
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32).eval()
        return cache[model_dir]
    return get
