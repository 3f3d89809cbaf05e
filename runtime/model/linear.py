"""Tensor-parallel linear and embedding layers that load only their own shard.

Weights use the checkpoint's [out, in] layout. Each parameter carries a ``weight_loader``
that receives a safetensors slice (``safe_open(...).get_slice(name)``) and reads just the
rows or columns this rank owns, so no rank ever holds the full tensor. Column-parallel
layers split outputs (no communication); row-parallel layers split inputs and all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from shoal.runtime.model.layers import _param
from shoal.runtime.model.parallel import ParallelContext
from torch import nn

from shoal.kernels import linear_panels_cpu
from shoal.kernels.linear_bf16_cpu import linear_bf16

Loader = Callable[[nn.Parameter, object, object], None]


def _read(st_slice, dim: int, start: int, end: int) -> torch.Tensor:
    """Read [start, end) of ``dim`` from a safetensors slice (or a plain tensor)."""
    if isinstance(st_slice, torch.Tensor):
        return st_slice.narrow(dim, start, end - start)
    return st_slice[start:end] if dim == 0 else st_slice[:, start:end]


def _shape(st_slice) -> list[int]:
    return list(st_slice.shape) if isinstance(st_slice, torch.Tensor) else st_slice.get_shape()


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint shard for {name} has shape {tuple(src.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(src)


def _set_loader(param: nn.Parameter, loader: Loader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


# Rows per call oneDNN lays the packed weights out for. Measured here (AVX-512, 2 threads) on
# the bench model's shapes: 128 is within a few percent of the best hint at every row count
# from 1 to 2048, while a hint of 1 loses up to 2x from 8 rows up.
PACK_ROWS_HINT = 128


def onednn_pack(weight: torch.Tensor, rows_hint: int = PACK_ROWS_HINT) -> torch.Tensor:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout, for ``onednn_linear``."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return reorder(weight.detach(), rows_hint)


# oneDNN builds (JIT) and caches one primitive per input shape, ~0.4 MiB each here and up to
# 1,024 of them: fed every row count a step can have, the engine core's heap grew by that
# much past warm-up (issue 36: +62.8% in a 5-minute soak). Row counts are therefore rounded
# up to a few sizes: exact up to EXACT_ROWS (decode batches), then 2**BUCKET_BITS sizes per
# doubling, so at most 12.5% of a step's rows are padding and a layer sees ~8 sizes per
# doubling of the step's tokens instead of every count.
EXACT_ROWS = 16
BUCKET_BITS = 3


def padded_rows(rows: int) -> int:
    """The row count oneDNN is called with for ``rows`` rows (>= rows, <= 1.125 x rows)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, rows.bit_length() - 1 - BUCKET_BITS)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` on a weight packed by ``onednn_pack``; the rows are padded to
    ``padded_rows`` so the primitives oneDNN caches stay few."""
    rows = x.shape[0] if x.dim() == 2 else -1
    padded = padded_rows(rows) if rows >= 0 else rows
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, padded - rows)), packed,
                                             bias, "none", [], "")
    return out[:rows]


def _matmul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
            bias: torch.Tensor | None = None, native_bf16: bool = False,
            panels: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, through the layer's panels or oneDNN-packed copy when it has
    one, or the native bfloat16 kernel when the layer was given it."""
    if panels is not None:
        return linear_panels_cpu.linear(x, panels, weight.shape[0], bias)
    if packed is not None:
        return onednn_linear(x, packed, bias)
    if native_bf16:
        return linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


# True while a quantized checkpoint's model is built: linear weights are made on the meta
# device (no memory), and quant/linear_method.py gives each layer its quantized parameters
_DEFER_WEIGHTS: ContextVar[bool] = ContextVar("defer_linear_weights", default=False)


@contextmanager
def linear_weights_deferred() -> Iterator[None]:
    token = _DEFER_WEIGHTS.set(True)
    try:
        yield
    finally:
        _DEFER_WEIGHTS.reset(token)


def _weight(shape: tuple[int, int], dtype: torch.dtype,
            device: torch.device | str) -> nn.Parameter:
    return _param(shape, dtype, "meta" if _DEFER_WEIGHTS.get() else device)


class _Linear(nn.Module):
    # set by use_panel_linears: the weight in linear_panels_cpu's panels (CPU only)
    panels: torch.Tensor | None = None
    # set by pack_cpu_linear_weights: the weight in oneDNN's blocked layout (CPU only)
    packed: torch.Tensor | None = None
    # set by use_native_bf16_linears: bfloat16 on CPU through shoal/kernels/linear_bf16_cpu
    native_bf16: bool = False
    # set by quant/linear_method.py: the layer's quantized weights and their matmul
    quant: Any = None

    def out_slots(self) -> dict[object, tuple[int, int]]:
        """Checkpoint shard id -> (first output row, rows) in this rank's fused weight."""
        weight = self.weight
        assert isinstance(weight, torch.Tensor)
        return {None: (0, int(weight.shape[0]))}

    def _forward_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        weight = self.weight
        assert isinstance(weight, torch.Tensor)
        return _matmul(x, weight, self.packed, bias, self.native_bf16, self.panels)


class ReplicatedLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _weight((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        for p in self.parameters():
            _set_loader(p, lambda p, s, _id: _copy(p.data, _read(s, 0, 0, _shape(s)[0]), "linear"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_matmul(x, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; forward returns this rank's slice of the outputs.

    ``output_sizes`` lists the logical matrices packed along the output dimension (one for
    a plain layer, [gate, up] for the fused MLP input); each is split separately so a rank
    holds the matching slice of every one of them.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 parallel: ParallelContext, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.parallel = parallel
        self.output_sizes = output_sizes
        self.local_sizes = [parallel.shard_range(size)[1] - parallel.shard_range(size)[0]
                            for size in output_sizes]
        total = sum(self.local_sizes)
        self.weight = _weight((total, in_features), dtype, device)
        self.bias = _param((total,), dtype, device) if bias else None
        for p in self.parameters():
            _set_loader(p, self._load)

    def out_slots(self) -> dict[object, tuple[int, int]]:
        slots: dict[object, tuple[int, int]] = {
            i: (sum(self.local_sizes[:i]), size) for i, size in enumerate(self.local_sizes)}
        if len(self.local_sizes) == 1:
            slots[None] = slots[0]
        return slots

    def _load(self, param: nn.Parameter, st_slice, shard_id: object) -> None:
        index = 0 if shard_id is None else int(shard_id)  # type: ignore[call-overload]
        start, end = self.parallel.shard_range(self.output_sizes[index])
        offset = sum(self.local_sizes[:index])
        dst = param.data.narrow(0, offset, self.local_sizes[index])
        _copy(dst, _read(st_slice, 0, start, end), f"column shard {index}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_matmul(x, self.bias)


class QKVParallelLinear(_Linear):
    """q, k and v projections packed in one matmul. Query heads split over ranks; KV heads
    split too, or replicated (rank r reads KV head r * kv_heads // world) when there are
    fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, parallel: ParallelContext, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        world = parallel.world_size
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not divide across {world} ranks")
        if num_kv_heads >= world and num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} KV heads do not divide across {world} ranks")
        if num_kv_heads < world and world % num_kv_heads:
            raise ValueError(f"{world} ranks cannot replicate {num_kv_heads} KV heads evenly")
        self.parallel = parallel
        self.head_dim = head_dim
        self.num_heads = num_heads // world
        self.num_kv_heads = max(1, num_kv_heads // world)
        if num_kv_heads >= world:
            self.kv_head_start = parallel.rank * self.num_kv_heads
        else:
            self.kv_head_start = parallel.rank * num_kv_heads // world
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = self.q_size + 2 * self.kv_size
        self.weight = _weight((total, hidden_size), dtype, device)
        self.bias = _param((total,), dtype, device) if bias else None
        for p in self.parameters():
            _set_loader(p, self._load)

    def out_slots(self) -> dict[object, tuple[int, int]]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}

    def _load(self, param: nn.Parameter, st_slice, shard_id: object) -> None:
        if shard_id == "q":
            start, size, offset = self.parallel.rank * self.q_size, self.q_size, 0
        elif shard_id in ("k", "v"):
            start, size = self.kv_head_start * self.head_dim, self.kv_size
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), _read(st_slice, 0, start, start + size),
              f"{shard_id}_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_matmul(x, self.bias)


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial products summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 parallel: ParallelContext, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.parallel = parallel
        start, end = parallel.shard_range(in_features)
        self.in_start, self.in_size = start, end - start
        self.weight = _weight((out_features, self.in_size), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        _set_loader(self.weight, self._load_weight)
        if self.bias is not None:
            _set_loader(self.bias, lambda p, s, _id: _copy(p.data, _read(s, 0, 0, _shape(s)[0]),
                                                           "row bias"))

    def _load_weight(self, param: nn.Parameter, st_slice, _shard_id: object) -> None:
        _copy(param.data, _read(st_slice, 1, self.in_start, self.in_start + self.in_size),
              "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward_matmul(x)
        out = self.parallel.all_reduce(out)
        # bias added once, after the sum, not once per rank
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split over ranks (padded to a multiple of the world size); each rank
    embeds the ids it owns, zeros the rest, and an all-reduce assembles the rows."""

    # set by quant/gguf_embedding.py: the table kept quantized, its rows and logits
    quant: Any = None
    # set by use_panel_linears on a table tied to an LM head given panels: rows read there
    panels: torch.Tensor | None = None

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        world = parallel.world_size
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // world) * world
        self.vocab_start, self.vocab_end = parallel.shard_range(self.padded_vocab)
        self.weight = _param((self.vocab_end - self.vocab_start, hidden_size), dtype, device)
        _set_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, st_slice, _shard_id: object) -> None:
        end = min(self.vocab_end, _shape(st_slice)[0])
        rows = max(0, end - self.vocab_start)
        if rows:
            _copy(param.data[:rows], _read(st_slice, 0, self.vocab_start, end), "embedding")
        param.data[rows:].zero_()  # padding rows never win an argmax nor add to a sum

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(self, input_ids)
        if self.parallel.world_size == 1:
            return self._rows(input_ids)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        out = self._rows(local) * owned.unsqueeze(-1).to(self.weight.dtype)
        return self.parallel.all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return linear_panels_cpu.rows(self.panels, ids)
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocabulary shard; logits gathered to the full vocabulary."""

    packed: torch.Tensor | None = None  # as in _Linear (panels: the embedding's)
    native_bf16: bool = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            logits = self.quant.logits(self, hidden)
        else:
            logits = _matmul(hidden, self.weight, self.packed, native_bf16=self.native_bf16,
                             panels=self.panels)
        if self.parallel.world_size > 1:
            logits = self.parallel.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size] if self.padded_vocab != self.vocab_size else logits


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: every parameter and persistent buffer off the
    meta device, each storage once (a tied LM head is the embedding), plus the repacked
    copies that replace dense weights: oneDNN's (an opaque tensor, counted by its elements)
    and the panels (shared by a tied table: counted once)."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict().values():
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    repacked = {id(t): t.numel() * t.element_size() for m in model.modules()
                for t in (getattr(m, "packed", None), getattr(m, "panels", None))
                if isinstance(t, torch.Tensor)}
    return sum(seen.values()) + sum(repacked.values())


def _tied_weights(model: nn.Module) -> set[int]:
    """ids of the embedding tables (a tied LM head's weight is one: lookups read its rows)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)
            and not isinstance(m, ParallelLMHead)}


def _dense_cpu_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...]
                       ) -> list[tuple[_Linear | ParallelLMHead, torch.Tensor]]:
    """The linear layers and LM head, with their weight, whose weight is a dense CPU tensor
    of one of ``dtypes`` (not quantized, not already repacked: a repacked layer's weight is
    on the meta device)."""
    found = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, (_Linear, ParallelLMHead)) and isinstance(weight, torch.Tensor)
                and not getattr(module, "quant", None)  # quantized: its own matmul
                and weight.device.type == "cpu" and weight.dtype in dtypes):
            found.append((module, weight))
    return found


def _drop_dense_weight(module: _Linear | ParallelLMHead, weight: torch.Tensor) -> None:
    """The dense weight replaced by a meta tensor of its shape (the packed copy is the
    layer's only one)."""
    module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


def use_panel_linears(model: nn.Module) -> int:
    """On CPU, float32 or bfloat16, where the native library runs and the panel kernel was
    measured faster (``ops.panel_linears_here``): every linear layer and the LM head multiply
    through ``shoal.kernels.linear_panels_cpu``, the weight held only as its panels (the
    dense copy dropped, a meta tensor keeps its shape). A tied LM head's embedding table
    reads its rows from the same panels, so the table too is held once. Returns the layers
    switched."""
    tables = {id(m.weight): m for m in model.modules() if isinstance(m, VocabParallelEmbedding)
              and not isinstance(m, ParallelLMHead)}
    switched = 0
    for module, weight in _dense_cpu_linears(model, linear_panels_cpu.DTYPES):
        module.panels = linear_panels_cpu.pack(weight)
        _drop_dense_weight(module, weight)
        table = tables.get(id(weight))
        if table is not None:  # tied: the embedding shares the panels and the meta weight
            table.panels, table.weight = module.panels, module.weight
        switched += 1
    return switched


def use_native_bf16_linears(model: nn.Module) -> int:
    """On CPU, bfloat16, where oneDNN cannot pack bfloat16: every linear layer (and the LM
    head) not given panels multiplies through ``shoal.kernels.linear_bf16_cpu``, its weight
    kept as it is. Returns the layers switched."""
    switched = 0
    for module, _ in _dense_cpu_linears(model, (torch.bfloat16,)):
        module.native_bf16 = True
        switched += 1
    return switched


def pack_cpu_linear_weights(model: nn.Module) -> int:
    """On CPU, float32 (or bfloat16 where oneDNN has bfloat16 kernels for the CPU: AMX,
    AVX512-BF16): give every linear layer not given panels its weight in oneDNN's blocked
    layout, the one oneDNN's matmul reads directly (what inductor's CPU freezing and vLLM's
    CPU build use).
    Against MKL's ``F.linear`` on the same weights: 1.2-1.7x at 16-2048 rows, 2-9x for the
    LM head at 1-16 rows (bench/linear_cpu.py); the sums round differently, within
    float32 tolerance. The dense weight is dropped (a meta tensor keeps its shape), except a
    tied LM head's, which is the embedding table. Returns the layers packed; none when this
    torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    tied = _tied_weights(model)
    packed = 0
    for module, weight in _dense_cpu_linears(model, (torch.float32, torch.bfloat16)):
        module.packed = onednn_pack(weight)
        if id(weight) not in tied:
            _drop_dense_weight(module, weight)
        packed += 1
    return packed
