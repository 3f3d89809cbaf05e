"""The mixture-of-experts block that sits in the MLP slot of a sparse decoder layer.

``router -> experts as one grouped computation -> (+ shared expert)``. The experts' weights
are stacked at load into ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj
[E, H, I]``, the fused layout transformers keeps in memory; checkpoints hold them either
per expert (``mlp.experts.N.gate_proj.weight``, what published checkpoints and transformers'
``save_pretrained`` write; Mixtral: ``block_sparse_moe.experts.N.w1/w3/w2``) or already
fused (``mlp.experts.gate_up_proj``); ``expert_checkpoint_target`` maps both.

Tensor parallelism splits every expert's intermediate dimension over the ranks, as the
dense MLP's is split: each rank holds all E experts' slices, routes every token itself (the
router is replicated and its input is identical on every rank), and the partial sums of
routed and shared experts meet in one all-reduce per block.
"""

from __future__ import annotations

import re

import torch
from shoal.runtime.model.layers import _param
from shoal.runtime.model.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    _read,
    _weight,
)
from shoal.runtime.model.moe_config import MoeConfig
from shoal.runtime.model.moe_router import Routing, route
from shoal.runtime.model.ops import Kernels, kernels_for
from shoal.runtime.model.parallel import ParallelContext
from torch import nn

from shoal.kernels.moe_grouped import clamped_swiglu, grouped_experts

ExpertShard = tuple[int, str] | str  # (expert, "gate" | "up" | "down"), or "fused"


def _kernels(device: torch.device | str, dtype: torch.dtype, kernels: Kernels | None) -> Kernels:
    """What ``ops.choose_kernels`` picked for the model (plain torch when built alone): its
    SiLU-and-mul, and its MoE path (the Triton kernel with the triton attention backend on
    CUDA, the native kernel in float32 with the native cpu backend, else torch's grouped
    GEMM)."""
    return kernels or kernels_for(device, dtype, "torch")


def _activation(device: torch.device | str, dtype: torch.dtype, kernels: Kernels | None):
    return _kernels(device, dtype, kernels).gated_activation("silu")


class Router(nn.Module):
    """``weight [E, H]`` (checkpoint ``mlp.gate.weight``; gpt-oss: ``mlp.router.weight`` and
    a ``bias``) and, for DeepSeek-V3 / GLM-4.5, the float32 ``e_score_correction_bias [E]``."""

    def __init__(self, moe: MoeConfig, hidden: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.moe = moe
        # DeepSeek / GLM keep the router's weight in float32 whatever the model's dtype
        # (transformers' _keep_in_fp32_modules_strict): a bfloat16 copy would move the
        # sigmoid scores by its rounding and flip near choices
        router_dtype = torch.float32 if moe.scoring == "sigmoid" else dtype
        self.weight = _param((moe.num_experts, hidden), router_dtype, device)
        self.bias = _param((moe.num_experts,), dtype, device) if moe.router_bias else None
        self.e_score_correction_bias = _param((moe.num_experts,), torch.float32, device) \
            if moe.correction_bias else None

    def forward(self, x: torch.Tensor) -> Routing:
        if self.moe.scoring == "sigmoid":  # DeepSeek / GLM score in float32 throughout
            logits = torch.nn.functional.linear(x.float(), self.weight)
        else:
            logits = torch.nn.functional.linear(x, self.weight, self.bias)
        return route(self.moe, logits, self.e_score_correction_bias)


class FusedExperts(nn.Module):
    """All routed experts of one layer, this rank's slice of each one's intermediate dim."""

    def __init__(self, moe: MoeConfig, hidden: int, parallel: ParallelContext,
                 dtype: torch.dtype, device: torch.device | str, kernels: Kernels | None = None):
        super().__init__()
        self.num_experts, self.size = moe.num_experts, moe.intermediate_size
        self.start, end = parallel.shard_range(moe.intermediate_size)
        self.local = end - self.start
        self.hidden, self.device = hidden, device
        # on the meta device while a quantized checkpoint's model is built (``quantize``)
        self.gate_up_proj = _weight((moe.num_experts, 2 * self.local, hidden), dtype, device)
        self.down_proj = _weight((moe.num_experts, hidden, self.local), dtype, device)
        # gpt-oss: [E, in, out] tensors with gate/up columns interleaved, always one tensor
        self.interleaved = moe.gpt_oss_swiglu is not None
        self._set_loaders()
        self.quant_bits: int | None = None  # quantized experts: see ``quantize``
        self.input_orders: torch.Tensor | None = None
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        self.rank = parallel.rank
        self.prepacked = False  # the native kernel's panel order (pack_cpu_experts)
        if moe.gpt_oss_swiglu is not None:
            self.gate_up_proj_bias = _param((moe.num_experts, 2 * self.local), dtype, device)
            self.gate_up_proj_bias.weight_loader = self._load_gate_up_bias  # type: ignore
            self.down_proj_bias = _param((moe.num_experts, hidden), dtype, device)
            self.act = clamped_swiglu(*moe.gpt_oss_swiglu)
            self.impl = "grouped"  # the Triton kernel has no biases nor this activation
        else:
            self.act = _activation(device, dtype, kernels)
            self.impl = _kernels(device, dtype, kernels).choice.moe

    def _set_loaders(self) -> None:
        experts = range(self.num_experts)
        for param, loader, shards in (
                (self.gate_up_proj, self._load_gate_up,
                 [(e, kind) for e in experts for kind in ("gate", "up")]),
                (self.down_proj, self._load_down, [(e, "down") for e in experts])):
            param.weight_loader = loader  # type: ignore[attr-defined]
            param.expected_shards = ["fused"] if self.interleaved \
                else shards  # type: ignore[attr-defined]

    def materialize(self) -> None:
        """Real stacked weights for experts a quantized checkpoint leaves unquantized."""
        for name in ("gate_up_proj", "down_proj"):
            meta = getattr(self, name)
            setattr(self, name, _param(tuple(meta.shape), meta.dtype, self.device))
        self._set_loaders()

    def quantize(self, spec, prefix: str, device: torch.device) -> None:
        """Hold the checkpoint's quantized tensors instead of the stacked weights
        (``quant/experts.py``); ``finalize_quant`` packs them after loading."""
        from shoal.runtime.model.quant.experts import ExpertTensors

        del self.gate_up_proj, self.down_proj
        self.gate_up_proj = ExpertTensors(spec, prefix, "gate_up_proj", self.num_experts,
                                          self.local, self.hidden, device)
        self.down_proj = ExpertTensors(spec, prefix, "down_proj", self.num_experts,
                                       self.hidden, self.local, device)

    def finalize_quant(self) -> None:
        gate_up, down = self.gate_up_proj, self.down_proj
        gpu = torch.device(self.device).type == "cuda"
        # down first: its act-order column order (if any) reorders the gate and up rows
        w2, down_orders = down.packed(self.num_experts, gpu)  # type: ignore[operator]
        w13, input_orders = gate_up.packed(  # type: ignore[operator]
            self.num_experts, gpu, down_orders)
        del self.gate_up_proj, self.down_proj
        for name, w in (("w13", w13), ("w2", w2)):  # packed on the host, kept on the device
            self.register_buffer(f"{name}_codes", w.codes.to(self.device))
            self.register_buffer(f"{name}_scales", w.scales.to(self.device))
            self.register_buffer(f"{name}_offsets", w.offsets.to(self.device))
            setattr(self, f"{name}_layout", (w.group, w.in_features, w.zero_mode))
        self.quant_bits = w13.bits
        self.input_orders = None if input_orders is None else torch.stack(input_orders).to(
            self.device)  # [E, H]: GPTQ act-order experts' hidden columns, as packed

    def quantized_weights(self):
        """(w13, w2) as the kernels' ``IntPacked``, views of this module's buffers."""
        from shoal.kernels.int_matmul_cpu import IntPacked

        assert self.quant_bits is not None
        return tuple(IntPacked(getattr(self, f"{n}_codes"), getattr(self, f"{n}_scales"),
                               getattr(self, f"{n}_offsets"), self.quant_bits,
                               *getattr(self, f"{n}_layout")) for n in ("w13", "w2"))

    def _load_gate_up(self, param: nn.Parameter, st_slice, shard: ExpertShard) -> list:
        lo, hi, size = self.start, self.start + self.local, self.size
        if self.interleaved:  # [E, H, 2I], column 2j: gate j, 2j + 1: up j
            columns = _last_dim(st_slice, 2 * lo, 2 * hi)
            _copy(param.data[:, :self.local], columns[..., 0::2].transpose(1, 2),
                  "experts.gate_up_proj (gate)")
            _copy(param.data[:, self.local:], columns[..., 1::2].transpose(1, 2),
                  "experts.gate_up_proj (up)")
            return ["fused"]
        if shard == "fused":  # [E, 2I, H]: all gate rows, then all up rows, per expert
            _copy(param.data[:, :self.local], _slice3(st_slice, lo, hi), "experts.gate_up_proj")
            _copy(param.data[:, self.local:], _slice3(st_slice, size + lo, size + hi),
                  "experts.gate_up_proj")
            return param.expected_shards  # type: ignore[attr-defined]
        assert isinstance(shard, tuple)
        expert, kind = shard
        offset = 0 if kind == "gate" else self.local
        _copy(param.data[expert, offset:offset + self.local], _read(st_slice, 0, lo, hi),
              f"expert {expert} {kind}_proj")
        return [shard]

    def _load_gate_up_bias(self, param: nn.Parameter, st_slice, _shard: object) -> None:
        columns = _last_dim(st_slice, 2 * self.start, 2 * (self.start + self.local))
        _copy(param.data, torch.cat([columns[:, 0::2], columns[:, 1::2]], dim=1),
              "experts.gate_up_proj_bias")

    def _load_down(self, param: nn.Parameter, st_slice, shard: ExpertShard) -> list:
        lo, hi = self.start, self.start + self.local
        if self.interleaved:  # [E, I, H]
            _copy(param.data, _slice3(st_slice, lo, hi).transpose(1, 2), "experts.down_proj")
            return ["fused"]
        if shard == "fused":  # [E, H, I]
            _copy(param.data, _last_dim(st_slice, lo, hi), "experts.down_proj")
            return param.expected_shards  # type: ignore[attr-defined]
        assert isinstance(shard, tuple)
        expert = shard[0]
        _copy(param.data[expert], _read(st_slice, 1, lo, hi), f"expert {expert} down_proj")
        return [shard]

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's partial sum of each token's routed experts, ``[T, H]``."""
        weights, ids = routing
        if self.quant_bits is not None:
            w13, w2 = self.quantized_weights()
            tokens, top_k = ids.shape
            if self.input_orders is not None:
                # act-order: each expert reads the hidden state in its own column order, so
                # every (token, expert) pair becomes a one-expert item with its own copy
                order = self.input_orders[ids.reshape(-1)]  # [T * K, H]
                x = x.repeat_interleave(top_k, dim=0).gather(1, order)
                weights, ids = weights.reshape(-1, 1), ids.reshape(-1, 1)
            if x.is_cuda:
                from shoal.kernels.fused_moe import fused_moe_quantized

                out = fused_moe_quantized(x, w13, w2, weights, ids, self.num_experts)
            else:
                from shoal.kernels.moe_experts_cpu import experts_quantized

                out = experts_quantized(x, w13, w2, weights, ids, self.num_experts)
            if self.input_orders is not None:
                out = out.view(tokens, top_k, -1).sum(dim=1)
            return out
        if self.impl == "triton":
            from shoal.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)
        if self.impl == "native_cpu":  # SiLU experts without biases (gpt-oss is "grouped")
            from shoal.kernels import moe_experts_cpu

            if self.prepacked:
                return moe_experts_cpu.experts_packed(x, self.gate_up_proj, self.down_proj,
                                                      weights, ids)
            return moe_experts_cpu.experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        # the down bias once over the ranks' partial sums: on rank 0 only
        b2 = self.down_proj_bias if self.rank == 0 else None
        return grouped_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.act,
                               self.gate_up_proj_bias, b2)


def pack_cpu_experts(model: nn.Module) -> int:
    """After loading, on CPU: every block that runs the native experts kernel keeps its
    experts' weights in the kernel's panel order (``moe_experts_cpu.pack_experts``), as
    vLLM's CPU MoE prepacks its experts at load: no packing pass per step, and every expert
    multiplies its panels whatever its row count. The parameters keep their names and bytes
    (``[E, I/8, H, 16]`` and ``[E, H/16, I, 16]`` in place of ``[E, 2I, H]`` and ``[E, H, I]``);
    the unpacked tensors are dropped, one block at a time, so resident memory is what it was
    plus one block's experts while packing. Returns the blocks packed."""
    from shoal.kernels import moe_experts_cpu

    packed = 0
    for module in model.modules():
        if not isinstance(module, FusedExperts) or module.impl != "native_cpu" \
                or module.prepacked or module.quant_bits is not None:
            continue
        w13, w2 = module.gate_up_proj.data, module.down_proj.data
        probe = torch.empty(1, w13.shape[-1], dtype=w13.dtype, device=w13.device)
        if not moe_experts_cpu.supports(probe, w13, w2):
            continue  # the kernel sends this shape to the grouped path: keep it unpacked
        w13p, w2p = moe_experts_cpu.pack_experts(w13, w2)
        module.gate_up_proj = nn.Parameter(w13p, requires_grad=False)
        module.down_proj = nn.Parameter(w2p, requires_grad=False)
        module.prepacked = True
        packed += 1
    return packed


def _slice3(st_slice, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of the middle dimension of a 3-d checkpoint tensor."""
    if isinstance(st_slice, torch.Tensor):
        return st_slice.narrow(1, lo, hi - lo)
    return st_slice[:, lo:hi]


def _last_dim(st_slice, lo: int, hi: int) -> torch.Tensor:
    """[lo, hi) of the last dimension of a 2-d or 3-d checkpoint tensor."""
    if isinstance(st_slice, torch.Tensor):
        return st_slice.narrow(-1, lo, hi - lo)
    return st_slice[:, lo:hi] if len(st_slice.get_shape()) == 2 else st_slice[:, :, lo:hi]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(src.shape)} on this "
                         f"rank, expected {tuple(dst.shape)}")
    dst.copy_(src)


class _PartialRowLinear(RowParallelLinear):
    """A row-parallel projection whose partial sum is left for the block's one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_matmul(x)


class SharedExpert(nn.Module):
    """The always-on SwiGLU expert (Qwen2-MoE's ``shared_expert``, DeepSeek's
    ``shared_experts``), split over ranks like the dense MLP; returns a partial sum."""

    def __init__(self, hidden: int, size: int, parallel: ParallelContext, dtype: torch.dtype,
                 device: torch.device | str, kernels: Kernels | None = None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [size, size], False, parallel, dtype,
                                                 device)
        self.down_proj = _PartialRowLinear(size, hidden, False, parallel, dtype, device)
        self.act = _activation(device, dtype, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int, parallel: ParallelContext,
                 dtype: torch.dtype, device: torch.device | str, kernels: Kernels | None = None):
        super().__init__()
        self.parallel = parallel
        self.gate = Router(moe, hidden, dtype, device)
        self.experts = FusedExperts(moe, hidden, parallel, dtype, device, kernels)
        self.shared_expert = SharedExpert(hidden, moe.shared_intermediate_size, parallel,
                                          dtype, device, kernels) \
            if moe.shared_intermediate_size else None
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, False, dtype, device) \
            if moe.shared_expert_gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.parallel.all_reduce(out)


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                         r"\.(\w+)$")
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}


def expert_checkpoint_target(ckpt_name: str) -> tuple[str, object] | None:
    """(parameter name, shard) for a checkpoint tensor of an MoE block's routed experts, or
    None for any other tensor. Also renames Mixtral's ``block_sparse_moe`` to ``mlp``,
    DeepSeek's ``shared_experts`` to ``shared_expert`` and gpt-oss's ``router`` to ``gate`` (returned with shard None when the
    tensor is not a routed expert's, for the caller's usual mapping)."""
    name = ckpt_name.replace(".block_sparse_moe.", ".mlp.").replace(
        ".mlp.shared_experts.", ".mlp.shared_expert.").replace(".mlp.router.", ".mlp.gate.")
    match = _PER_EXPERT.match(name)
    if match:
        prefix, expert, proj, tensor = match.groups()
        kind = _KIND[proj]
        param = "gate_up_proj" if kind != "down" else "down_proj"
        # a quantized checkpoint's tensors (``weight_packed``, ``qweight``, ``weight_scale``
        # ...) go to the quantized experts' placeholders of the same name
        suffix = "" if tensor == "weight" else f".{tensor}"
        return f"{prefix}.{param}{suffix}", (int(expert), kind)
    if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return name, "fused"
    return (name, None) if name != ckpt_name else None
