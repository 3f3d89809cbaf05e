"""Kernel tests run the Triton kernels on CPU through triton's interpreter.

triton decides interpreted vs compiled when ``@triton.jit`` runs, i.e. when shoal.kernels'
modules are first imported, so the variable is set here, before any test module imports
them. Shapes stay tiny: the interpreter executes every program in Python.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def rng() -> torch.Generator:
    """A generator with a fresh seed each run; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"kernel test seed: {seed}")
    generator = torch.Generator().manual_seed(seed)
    return generator


def portable_library(source: Path, into: Path, functions: tuple[str, ...],
                     also: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """``source`` (linked with ``also``) built for baseline x86-64 (no AVX2, no FMA, so none
    of the intrinsics), its ``functions`` typed: the loops other CPUs get. The shared library
    is built with -march=native, so on this pool's CPUs only this build runs them. Skips
    without a compiler."""
    from shoal.kernels.native_cpu import SIGNATURES

    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler")
    library = into / f"{source.stem}_portable.so"
    subprocess.run([compiler, "-O2", "-march=x86-64", "-fopenmp", "-fPIC", "-shared",
                    "-std=c11", str(source), *map(str, also), "-o", str(library), "-lm"],
                   check=True,
                   timeout=300)
    portable = ctypes.CDLL(str(library))
    for name in functions:
        function = getattr(portable, name)
        function.restype, function.argtypes = SIGNATURES[name]
    return portable


class PagedBatch:
    """A random flat mixed batch over a paged cache, laid out like the runtime's step plan."""

    def __init__(self, query_start_loc, seq_lens, block_tables, slot_mapping, k_cache, v_cache):
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.slot_mapping = slot_mapping
        self.k_cache = k_cache
        self.v_cache = v_cache

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    def metadata(self):
        """The step's ``AttentionMetadata``, as the model runner builds it."""
        from shoal.runtime.attention.backend import AttentionMetadata

        return AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping,
            max_query_len=self.max_query_len, max_seq_len=int(self.seq_lens.max()),
            block_size=self.k_cache.shape[1],
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist())


def build_paged_batch(
    rng: torch.Generator,
    requests: list[tuple[int, int]],  # (context_len before this step, query_len)
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    shared_prefix_blocks: int = 0,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Blocks are handed out in random order; every request whose cached context covers them
    starts with the same ``shared_prefix_blocks`` blocks (prefix-cache hits share blocks)."""
    blocks_needed = [-(-(ctx + q) // block_size) for ctx, q in requests]
    sharers = [ctx >= shared_prefix_blocks * block_size for ctx, _ in requests]
    own = [n - (shared_prefix_blocks if s else 0) for n, s in zip(blocks_needed, sharers, strict=True)]
    num_blocks = shared_prefix_blocks + sum(own) + spare_blocks
    order = torch.randperm(num_blocks, generator=rng).tolist()
    shared, pool = order[:shared_prefix_blocks], order[shared_prefix_blocks:]
    max_blocks = max(blocks_needed) + 1  # one padding column, as the scheduler pads
    tables, slots, starts = [], [], [0]
    for (ctx, q_len), share, n_own in zip(requests, sharers, own, strict=True):
        table = (shared if share else []) + pool[:n_own]
        pool = pool[n_own:]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
        tables.append(table + [0] * (max_blocks - len(table)))
        starts.append(starts[-1] + q_len)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([ctx + q for ctx, q in requests], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        k_cache=torch.randn(shape, generator=rng).to(dtype),
        v_cache=torch.randn(shape, generator=rng).to(dtype),
    )


@pytest.fixture
def paged_batch():
    return build_paged_batch


@pytest.fixture
def q_in_qkv_rows():
    """``q [T, H, D]`` as the first columns of wider fused qkv rows: equal values, a
    non-contiguous view, as the model hands q to attention."""
    def make(q: torch.Tensor, num_kv_heads: int, rng: torch.Generator) -> torch.Tensor:
        tokens, heads, head_dim = q.shape
        kv = torch.randn(tokens, 2 * num_kv_heads * head_dim, generator=rng)
        view = torch.cat([q.flatten(1), kv], dim=1)[:, :heads * head_dim].view(q.shape)
        assert not view.is_contiguous()
        return view
    return make


class ContinuousBatch:
    """A minimal continuous-batching driver for a Worker (no engine core needed).

    Every step decodes one token for each running request and spends the rest of the token
    budget on the next waiting prompt's chunk, so steps mix decodes with prefill chunks.
    A request may start on another's first blocks (a prefix-cache hit): its prefill then
    begins after the shared tokens, attending over the donor's pages.
    """

    def __init__(self, worker, block_size: int, token_budget: int, max_new: int, logprobs: int = 2):
        from shoal.runtime.sampling_params import SamplingParams

        self.worker = worker
        self.block_size = block_size
        self.token_budget = token_budget
        self.max_new = max_new
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                                     logprobs=logprobs)
        self.next_block = 1

    def run(self, prompts: dict[str, list[int]], shared: dict[str, tuple[str, int]] | None = None):
        """Greedy outputs per request: (token ids, top-2 logprob margin at each step)."""
        import numpy as np
        from shoal.runtime.wire.plan import NewRequestData, StepPlan

        shared = shared or {}
        tables: dict[str, list[int]] = {}
        cached = dict.fromkeys(prompts, 0)  # tokens in the cache
        outputs: dict[str, list[int]] = {r: [] for r in prompts}
        margins: dict[str, list[float]] = {r: [] for r in prompts}
        waiting, running, finished = list(prompts), [], []
        step_id = 0
        while waiting or running:
            rows = [(r, [outputs[r][-1]], True) for r in running]
            budget = self.token_budget - len(rows)
            new = []
            if waiting and budget > 0:
                req = waiting[0]
                if req not in tables:
                    donor, n_blocks = shared.get(req, (None, 0))
                    tables[req] = list(tables[donor][:n_blocks]) if donor else []
                    cached[req] = n_blocks * self.block_size
                    new.append(NewRequestData(req, prompts[req], [], self.params))
                chunk = prompts[req][cached[req]:cached[req] + budget]
                done = cached[req] + len(chunk) == len(prompts[req])
                rows.append((req, chunk, done))
                if done:
                    waiting.pop(0)
            ids, pos, slots, starts, seq_lens = [], [], [], [0], []
            for req, tokens, _ in rows:
                start = cached[req]
                while len(tables[req]) * self.block_size < start + len(tokens):
                    tables[req].append(self.next_block)
                    self.next_block += 1
                for p, tok in enumerate(tokens, start):
                    ids.append(tok)
                    pos.append(p)
                    slots.append(tables[req][p // self.block_size] * self.block_size + p % self.block_size)
                cached[req] += len(tokens)
                starts.append(len(ids))
                seq_lens.append(cached[req])
            width = max(len(tables[r]) for r, _, _ in rows)
            step_id += 1
            plan = StepPlan(
                step_id=step_id, req_ids=[r for r, _, _ in rows],
                input_ids=np.array(ids, dtype=np.int64), positions=np.array(pos, dtype=np.int64),
                query_start_loc=np.array(starts, dtype=np.int32),
                seq_lens=np.array(seq_lens, dtype=np.int32),
                block_tables=np.array([tables[r] + [0] * (width - len(tables[r])) for r, _, _ in rows],
                                      dtype=np.int32),
                slot_mapping=np.array(slots, dtype=np.int64),
                sample_rows=np.array([s for _, _, s in rows], dtype=bool),
                new_requests=new, finished_req_ids=finished,
            )
            result = self.worker.execute(plan)
            finished = []
            for i, req in enumerate(result.req_ids):
                outputs[req].append(int(result.sampled_token_ids[i]))
                top = result.top_logprobs[i]
                margins[req].append(float(top[0] - top[1]))
                if req not in running:
                    running.append(req)
                if len(outputs[req]) == self.max_new:
                    running.remove(req)
                    finished.append(req)
        return {r: (outputs[r], margins[r]) for r in prompts}


@pytest.fixture
def continuous_batch():
    return ContinuousBatch
