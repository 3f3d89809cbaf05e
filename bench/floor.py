"""The CPU floor of a workload, measured on this machine in the benchmark's own run.

The floor is the time an engine would take that runs one op at a time, each at its bound:

- the matmul FLOPs (every fed token's linear layers, each output's LM head, the prompts'
  causal attention) at the torch matmul rate measured at the steps' shapes;
- but never less than reading every weight once per forward pass (a request's output tokens
  come one pass after another, so a workload takes at least its longest output's passes);
- the K/V bytes decode attention must read (each fed-back token attends over its context,
  every layer) at the rate of a plain streaming read from DRAM.

Weights and K/V are priced at the serving dtype's size (``--dtype bfloat16``: 2 bytes) and the
matmul rate is the fastest way this CPU multiplies that dtype's operands (for bfloat16: torch's
bf16 matmul, oneDNN's packed bf16 where the CPU has bf16 instructions, or widening to float32,
whichever is faster). Everything else costs nothing here: norms, sampling, the server's HTTP
and the load generator. A system's share of the floor says how much is left
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
    passes: int = 0  # forward passes at the least (each reads every weight once)

    @classmethod
    def of_requests(cls, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> Work:
        """Requests run to completion: output tokens 1..out-1 are fed back, with contexts
        prompt+1 .. prompt+out-1 (the last generated token is never fed back)."""
        lens = list(zip(prompt_lens, output_lens, strict=True))
        return cls(tokens=sum(p + o - 1 for p, o in lens), sampled=sum(o for _, o in lens),
                   prompt_pairs=sum(p * (p + 1) // 2 for p, _ in lens),
                   decode_contexts=sum((o - 1) * (2 * p + o) // 2 for p, o in lens),
                   passes=max((o for _, o in lens), default=0))

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

    def weight_bytes(self, mc: ModelConfig, dtype_bytes: int = 4) -> float:
        """Every linear layer's weights and the LM head, once per forward pass."""
        per_pass = mc.num_layers * sum(i * o for i, o in linear_shapes(mc)) \
            + mc.hidden_size * mc.vocab_size
        return per_pass * dtype_bytes * self.passes


def _variants(weights: list[torch.Tensor], inputs: list[torch.Tensor],
              dtype: torch.dtype) -> dict[str, list]:
    """Ways to compute one round of ``x @ w``: MKL and oneDNN in float32 (for bfloat16 weights
    too: widening them to float32 is one way to multiply them), and for bfloat16 torch's bf16
    matmul and oneDNN's packed bf16 (where this CPU's oneDNN packs bf16 at all)."""
    def pair(ws: list[torch.Tensor], xs: list[torch.Tensor]) -> dict[str, list]:
        tag = str(ws[0].dtype).removeprefix("torch.")
        out = {f"{tag} x @ w": [lambda x=x, w=w: x @ w for x, w in zip(xs, ws, strict=True)]}
        if torch.backends.mkldnn.is_available():
            try:
                packed = [onednn_pack(w.t().contiguous()) for w in ws]
            except RuntimeError:  # e.g. bf16 on a CPU without bf16 instructions
                return out
            out[f"{tag} oneDNN"] = [lambda x=x, p=p: onednn_linear(x, p)
                                    for x, p in zip(xs, packed, strict=True)]
        return out

    variants = pair(weights, inputs)
    if dtype != torch.float32:
        variants.update(pair([w.to(dtype) for w in weights], [x.to(dtype) for x in inputs]))
    return variants


def matmul_rates(mc: ModelConfig, rows: tuple[int, ...] = (128, 512, 2048),
                 min_seconds: float = 1.0, dtype: torch.dtype = torch.float32
                 ) -> dict[int, float]:
    """FLOP/s of the fastest CPU matmul on ``dtype`` operands (``_variants``) at one layer's
    shapes (+ LM head) for each row count. A variant under half the best at one row count is
    not timed at the larger ones (torch's bf16 matmul without bf16 instructions: minutes)."""
    shapes = linear_shapes(mc) + [(mc.hidden_size, mc.vocab_size)]
    rates: dict[int, float] = {}
    dropped: set[str] = set()
    for m in rows:
        weights = [torch.randn(i, o) for i, o in shapes]
        inputs = [torch.randn(m, i) for i, _ in shapes]
        flops_per_round = sum(2 * m * i * o for i, o in shapes)
        timed: dict[str, float] = {}
        for name, calls in _variants(weights, inputs, dtype).items():
            if name in dropped:
                continue
            for call in calls:  # warm up
                call()
            rounds, start = 0, time.perf_counter()
            while time.perf_counter() - start < min_seconds:
                for call in calls:
                    call()
                rounds += 1
            timed[name] = flops_per_round * rounds / (time.perf_counter() - start)
        rates[m] = max(timed.values())
        dropped |= {name for name, rate in timed.items() if rate < rates[m] / 2}
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
    dtype_bytes: int = 4  # weights and K/V: float32 4, bfloat16 2

    @classmethod
    def measure(cls, mc: ModelConfig, threads: int, dtype: torch.dtype = torch.float32
                ) -> Floor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cls(mc, matmul_rates(mc, dtype=dtype), read_rate(),
                       torch.empty((), dtype=dtype).element_size())
        finally:
            torch.set_num_threads(before)

    @property
    def peak_flops_per_s(self) -> float:
        return max(self.matmul_flops_per_s.values())

    def split(self, work: Work) -> tuple[float, float]:
        """(matmul seconds, or the weights' read seconds where those are more; decode K/V
        read seconds)."""
        return (max(work.matmul_flops(self.model) / self.peak_flops_per_s,
                    work.weight_bytes(self.model, self.dtype_bytes) / self.read_bytes_per_s),
                work.kv_bytes(self.model, self.dtype_bytes) / self.read_bytes_per_s)

    def seconds(self, work: Work) -> float:
        return sum(self.split(work))

    def describe(self) -> str:
        rates = ", ".join(f"{m}: {r / 1e9:.1f}" for m, r in self.matmul_flops_per_s.items())
        return (f"{self.dtype_bytes}-byte weights and K/V; matmul GFLOP/s at rows {rates}; "
                f"streaming read {self.read_bytes_per_s / 1e9:.1f} GB/s")
