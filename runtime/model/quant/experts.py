"""Quantized routed experts: an MoE block's experts kept in their checkpoint's format.

Quantized MoE checkpoints store each expert's projections as separate quantized linears
(``mlp.experts.N.gate_proj.weight_packed``, ``.qweight``, ``.weight`` + ``.weight_scale_inv``
...: llm-compressor, GPTQ, AWQ and the FP8 releases such as Qwen3-30B-A3B-FP8 alike). At
build time the stacked experts' parameters of ``moe.FusedExperts`` become ``ExpertTensors``
(one placeholder per tensor name of the format, loaded per (expert, gate|up|down) shard and
checked against the format's shapes and dtypes, as a quantized linear's are); after loading,
each expert's gate and up parts and then all experts are stacked into one packed matrix per
projection (``int_matmul_cpu.IntPacked``: ``[E * 2I, H]`` and ``[E * H, I]``), which the
native CPU kernel (``moe_experts_cpu.experts_quantized``) and the Triton fused MoE
(``fused_moe``) read as one grouped computation per block.

Formats: the int weight-only layouts (compressed-tensors pack-quantized and int-quantized,
GPTQ, AWQ), FP8 in blocks (``weight_block_size``) and compressed-tensors FP8 per channel or
tensor. GPTQ act-order (``g_idx``): each part's columns are sorted by group; the down
projection's order is applied to the expert's gate and up rows instead (they make its input,
so the intermediate activations come out in that order), and the gate/up order, one per expert,
gathers each (token, expert) pair's copy of the hidden state (``moe.FusedExperts``). Refused at
startup with the reason: act-order groups of unequal size or gate/up parts of one expert with
different ``g_idx``, blocks or groups the packed layout cannot take (not whole multiples of 32
columns), gpt-oss's biased experts.
"""

from __future__ import annotations

import torch
from shoal.runtime.model.quant.spec import (
    Fp8BlockScheme,
    Fp8ChannelScheme,
    IntWeightScheme,
    QuantizationError,
    QuantSpec,
    is_ignored,
)
from torch import nn

from shoal.kernels.int_matmul_cpu import FP8, NO_OFFSET, SUB, IntPacked, compact

KINDS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tensor_names(spec: QuantSpec) -> list[str]:
    scheme = spec.scheme
    if isinstance(scheme, IntWeightScheme):
        from shoal.runtime.model.quant.int_weight import layout_module

        return list(layout_module(scheme).tensor_names(scheme))
    if isinstance(scheme, Fp8BlockScheme):
        return ["weight", "weight_scale_inv"]
    if isinstance(scheme, Fp8ChannelScheme):
        return ["weight", "weight_scale"]
    raise QuantizationError(f"{spec.method}: quantized experts in {type(scheme).__name__} "
                            "are not supported")


class ExpertTensors(nn.Module):
    """One stacked projection's checkpoint tensors while loading: ``staged[(expert, kind)]
    [tensor name]``; every placeholder parameter expects one shard per expert part."""

    def __init__(self, spec: QuantSpec, prefix: str, param: str, num_experts: int,
                 rows: int, in_features: int, device: torch.device) -> None:
        super().__init__()
        self.spec, self.prefix, self.rows, self.in_features = spec, prefix, rows, in_features
        self.kinds = KINDS[param]
        self.staged: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        shards = [(e, kind) for e in range(num_experts) for kind in self.kinds]
        for name in tensor_names(spec):
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device),
                                       requires_grad=False)
            placeholder.weight_loader = self._loader(name)  # type: ignore[attr-defined]
            placeholder.expected_shards = shards  # type: ignore[attr-defined]
            self.register_parameter(name, placeholder)

    def _loader(self, name: str):
        def load(_param: nn.Parameter, st_slice, shard: object) -> list:
            if not (isinstance(shard, tuple) and shard[1] in self.kinds):
                raise QuantizationError(f"{self.prefix}: {name} of shard {shard!r} does not "
                                        "belong to these experts (a fused experts tensor in a "
                                        "quantized checkpoint is not supported)")
            tensor = st_slice if isinstance(st_slice, torch.Tensor) else st_slice[:]
            what = f"{self.prefix}.{shard[0]}.{PROJ_NAMES[shard[1]]}.{name}"
            self.staged.setdefault(shard, {})[name] = _checked(
                self.spec, name, tensor, self.rows, self.in_features, what)
            return [shard]
        return load

    def packed(self, num_experts: int, gpu: bool,
               row_orders: list[torch.Tensor] | None = None
               ) -> tuple[IntPacked, list[torch.Tensor] | None]:
        """All experts' parts, each unpacked and checked, stacked on the output rows, in the
        kernels' layout (``gpu``: float offsets, which the Triton kernel reads), and each
        expert's input-column order when the parts are GPTQ act-order (else None).
        ``row_orders``: each expert's rows of every part reordered so (the down projection's
        act-order, applied to the gate and up rows that make its input)."""
        parts = [_unpack(self.spec, self.staged[(e, kind)], self.rows, self.in_features,
                         f"{self.prefix}.{e}.{PROJ_NAMES[kind]}")
                 for e in range(num_experts) for kind in self.kinds]
        self.staged.clear()
        if isinstance(self.spec.scheme, IntWeightScheme):
            from shoal.runtime.model.quant.int_kernels import packed_int
            from shoal.runtime.model.quant.int_weight import IntWeights

            ints = [p for p in parts if isinstance(p, IntWeights)]
            if row_orders is not None:
                ints = [_rows(w, row_orders[i // len(self.kinds)]) for i, w in enumerate(ints)]
            ints, orders = _act_order(ints, len(self.kinds), self.in_features,
                                      f"{self.spec.method}: {self.prefix}")
            return packed_int(IntWeights(
                torch.cat([p.codes for p in ints]), torch.cat([p.scales for p in ints]),
                torch.cat([p.zeros for p in ints]), ints[0].bits, ints[0].group_size),
                zero_points=not gpu), orders
        codes = torch.cat([p[0] for p in parts])  # type: ignore[index]
        scales = torch.cat([p[1] for p in parts])  # type: ignore[index]
        block = parts[0][2]  # type: ignore[index]
        packed = compact(IntPacked(codes.view(torch.uint8).contiguous(), scales.contiguous(),
                                   torch.empty(0, dtype=torch.uint8), FP8, block,
                                   self.in_features, NO_OFFSET))
        packed.check()
        return packed, None


def _rows(weights, order: torch.Tensor):
    from shoal.runtime.model.quant.int_weight import IntWeights

    return IntWeights(weights.codes[order], weights.scales[order], weights.zeros[order],
                      weights.bits, weights.group_size, weights.group_index)


def _act_order(ints: list, per_expert: int, in_features: int, what: str):
    """GPTQ act-order parts (``g_idx``: each input column's group) with their columns sorted
    by group, so each group is contiguous as the packed layout needs, and each expert's
    column order (one per expert: its gate and up parts share their input, and so its
    order); None when no part has a ``g_idx``."""
    from shoal.runtime.model.quant.int_weight import IntWeights

    if all(w.group_index is None for w in ints):
        return ints, None
    trivial = torch.arange(in_features) // ints[0].group_size
    sorted_parts, orders = [], []
    for e in range(len(ints) // per_expert):
        mine = ints[e * per_expert:(e + 1) * per_expert]
        indexes = [trivial if w.group_index is None else w.group_index for w in mine]
        if any(not torch.equal(i, indexes[0]) for i in indexes[1:]):
            raise QuantizationError(f"{what}.{e}: gate_proj and up_proj have different g_idx "
                                    "(act-order experts need one column order per expert)")
        counts = torch.bincount(indexes[0], minlength=mine[0].scales.shape[1])
        if not bool((counts == mine[0].group_size).all()):
            raise QuantizationError(f"{what}.{e}: act-order groups of unequal size (g_idx) "
                                    "are not supported")
        order = torch.argsort(indexes[0], stable=True)
        orders.append(order)
        sorted_parts += [IntWeights(w.codes[:, order].contiguous(), w.scales, w.zeros, w.bits,
                                    w.group_size) for w in mine]
    return sorted_parts, orders


def _checked(spec: QuantSpec, name: str, tensor: torch.Tensor, rows: int, in_features: int,
             what: str) -> torch.Tensor:
    from shoal.runtime.model.quant.linear_method import check_tensor

    scheme = spec.scheme
    if isinstance(scheme, IntWeightScheme):
        from shoal.runtime.model.quant.int_weight import layout_module

        shape, dtypes = layout_module(scheme).tensor_spec(scheme, name, rows, in_features)
        check_tensor(tensor, shape, dtypes, what)
    elif name == "weight":
        check_tensor(tensor, (rows, in_features), (torch.float8_e4m3fn,), what)
    elif isinstance(scheme, Fp8BlockScheme):
        check_tensor(tensor, (-(-rows // scheme.block_out), -(-in_features // scheme.block_in)),
                     FP8_SCALE_DTYPES, what)
    else:
        assert isinstance(scheme, Fp8ChannelScheme)
        tensor = tensor.reshape(1) if scheme.per_tensor and tensor.dim() == 0 else tensor
        check_tensor(tensor, (1,) if scheme.per_tensor else (rows, 1), FP8_SCALE_DTYPES, what)
    return tensor.clone()


def _unpack(spec: QuantSpec, tensors: dict[str, torch.Tensor], rows: int, in_features: int,
            what: str) -> object:
    """An int part's ``IntWeights``, or an FP8 part's (weight, per-row block scales, block
    width)."""
    scheme = spec.scheme
    if isinstance(scheme, IntWeightScheme):
        from shoal.runtime.model.quant.int_weight import layout_module

        weights = layout_module(scheme).unpack(scheme, tensors, rows, in_features)
        if in_features % SUB or weights.group_size % SUB:
            raise QuantizationError(f"{spec.method}: {what}: {in_features} columns in groups "
                                    f"of {weights.group_size} (experts need multiples of "
                                    f"{SUB})")
        return weights
    if isinstance(scheme, Fp8BlockScheme):
        block = scheme.block_in
        scale = tensors["weight_scale_inv"].float().repeat_interleave(scheme.block_out, 0)[:rows]
    else:
        block = in_features
        scale = tensors["weight_scale"].float().reshape(-1, 1).expand(rows, 1)
    if in_features % SUB or block % SUB or in_features % block:
        raise QuantizationError(f"{spec.method}: {what}: {in_features} columns in blocks of "
                                f"{block} (experts need whole blocks of a multiple of {SUB})")
    return tensors["weight"], scale, block


def quantize_experts(model: nn.Module, spec: QuantSpec, device: torch.device) -> int:
    """Give every MoE block's deferred experts their checkpoint tensors (or, when the
    checkpoint leaves them unquantized, plain stacked weights; a GGUF file's experts are
    dequantized at load). Returns the blocks quantized."""
    from shoal.runtime.model.moe import FusedExperts
    from shoal.runtime.model.quant.spec import GgufScheme

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, FusedExperts) or not module.gate_up_proj.is_meta:
            continue
        probe = [f"{name}.0.{proj}" for proj in PROJ_NAMES.values()]
        if isinstance(spec.scheme, GgufScheme) or all(is_ignored(n, spec.ignore)
                                                      for n in probe):
            module.materialize()
            continue
        if module.interleaved:
            raise QuantizationError(f"{spec.method}: quantized gpt-oss experts (biases, "
                                    "interleaved gate/up) are not supported")
        module.quantize(spec, name, device)
        count += 1
    return count


def finalize_experts(model: nn.Module) -> None:
    from shoal.runtime.model.moe import FusedExperts

    for module in model.modules():
        if isinstance(module, FusedExperts) and isinstance(module.gate_up_proj, ExpertTensors):
            module.finalize_quant()
