"""The CPU floor of a workload, measured on this machine in the benchmark's own run.

The floor is the time an engine would take that runs one op at a time, each at its bound:

- the matmul FLOPs (every fed token's linear layers, each output's LM head, the prompts'
  causal attention) at the torch matmul rate measured at the steps' shapes;
- the K/V bytes decode attention must read (each fed-back token attends over its context,
  every layer) at the rate of a plain streaming read from DRAM.

Everything else costs nothing here: weights re-read by small batches, norms, sampling, the
server's HTTP and the load generator. A system's share of the floor says how much is left
above it; a ratio between two systems cannot exceed the slower one's distance from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.linear import onednn_linear, onednn_pack


def linear_shapes(mc: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one layer's matmuls."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return [(mc.hidden_size, q + 2 * kv), (q, mc.hidden_size),
            (mc.hidden_size, 2 * mc.intermediate_size), (mc.intermediate_size, mc.hidden_size)]


@dataclass(frozen=True)
class Work:
    """What a workload or a step makes the model do, in the units the floor prices."""
    tokens: int = 0  # fed through the linear layers
    sampled: int = 0  # rows through the LM head
    prompt_pairs: int = 0  # (query, key) pairs of causal prompt attention
    decode_contexts: int = 0  # context tokens decode attention reads K/V for

    @classmethod
    def of_requests(cls, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> Work:
        """Requests run to completion: output tokens 1..out-1 are fed back, with contexts
        prompt+1 .. prompt+out-1 (the last generated token is never fed back)."""
        lens = list(zip(prompt_lens, output_lens, strict=True))
        return cls(tokens=sum(p + o - 1 for p, o in lens), sampled=sum(o for _, o in lens),
                   prompt_pairs=sum(p * (p + 1) // 2 for p, _ in lens),
                   decode_contexts=sum((o - 1) * (2 * p + o) // 2 for p, o in lens))

    def matmul_flops(self, mc: ModelConfig) -> float:
        """FLOPs that run at matmul speed (decode attention is priced by its bytes instead)."""
        per_token = 2 * mc.num_layers * sum(i * o for i, o in linear_shapes(mc))
        lm_head = 2 * mc.hidden_size * mc.vocab_size
        per_pair = 4 * mc.num_layers * mc.num_heads * mc.head_dim  # QK^T and PV
        return per_token * self.tokens + lm_head * self.sampled + per_pair * self.prompt_pairs

    def kv_bytes(self, mc: ModelConfig, dtype_bytes: int = 4) -> float:
        """K and V of every layer for each decode context token."""
        return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes \
            * self.decode_contexts


def matmul_rates(mc: ModelConfig, rows: tuple[int, ...] = (128, 512, 2048),
                 min_seconds: float = 1.0) -> dict[int, float]:
    """FLOP/s of the faster CPU matmul (MKL's ``x @ w``, oneDNN on packed weights) at one
    layer's shapes (+ LM head) for each row count."""
    shapes = linear_shapes(mc) + [(mc.hidden_size, mc.vocab_size)]
    rates = {}
    for m in rows:
        weights = [torch.randn(i, o) for i, o in shapes]
        inputs = [torch.randn(m, i) for i, _ in shapes]
        flops_per_round = sum(2 * m * i * o for i, o in shapes)
        variants = [[lambda x=x, w=w: x @ w for x, w in zip(inputs, weights, strict=True)]]
        if torch.backends.mkldnn.is_available():
            packed = [onednn_pack(w.t().contiguous()) for w in weights]
            variants.append([lambda x=x, p=p: onednn_linear(x, p)
                             for x, p in zip(inputs, packed, strict=True)])
        best = 0.0
        for calls in variants:
            for call in calls:  # warm up
                call()
            rounds, start = 0, time.perf_counter()
            while time.perf_counter() - start < min_seconds:
                for call in calls:
                    call()
                rounds += 1
            best = max(best, flops_per_round * rounds / (time.perf_counter() - start))
        rates[m] = best
    return rates


def read_rate(gib: float = 0.5, min_seconds: float = 1.0) -> float:
    """Bytes/s of a plain streaming read (a sum over a buffer far larger than the L3): the
    best decode attention over a cache that does not fit can do."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()  # warm up (page faults, threads)
    rounds, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        buffer.sum()
        rounds += 1
    return buffer.numel() * 4 * rounds / (time.perf_counter() - start)


@dataclass(frozen=True)
class Floor:
    """This machine's rates, measured once per benchmark run (before any server starts)."""
    model: ModelConfig
    matmul_flops_per_s: dict[int, float]  # rows -> FLOP/s
    read_bytes_per_s: float

    @classmethod
    def measure(cls, mc: ModelConfig, threads: int) -> Floor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cls(mc, matmul_rates(mc), read_rate())
        finally:
            torch.set_num_threads(before)

    @property
    def peak_flops_per_s(self) -> float:
        return max(self.matmul_flops_per_s.values())

    def split(self, work: Work) -> tuple[float, float]:
        """(matmul seconds, decode K/V read seconds)."""
        return (work.matmul_flops(self.model) / self.peak_flops_per_s,
                work.kv_bytes(self.model) / self.read_bytes_per_s)

    def seconds(self, work: Work) -> float:
        return sum(self.split(work))

    def describe(self) -> str:
        rates = ", ".join(f"{m}: {r / 1e9:.1f}" for m, r in self.matmul_flops_per_s.items())
        return (f"matmul GFLOP/s at rows {rates}; streaming read "
                f"{self.read_bytes_per_s / 1e9:.1f} GB/s")
