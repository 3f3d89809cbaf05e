"""Linear layers with quantized weights: which layers, their parameters, their loading.

A quantized checkpoint's model is built with its linear weights on the meta device
(``linear.linear_weights_deferred``); ``quantize_linears`` then gives every linear layer the
checkpoint's own tensors for its format (``fp8_block``, ``int_weight``), each with a loader
that checks dtype and shape before it copies anything, and layers the checkpoint leaves
unquantized (``ignore``) a plain weight. After loading, ``finalize_quantized`` turns the
checkpoint layout into the kernels' (int4 packing) and drops what the kernels do not read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from shoal.runtime.model.linear import _Linear
from shoal.runtime.model.quant.spec import (
    Fp8BlockScheme,
    Fp8ChannelScheme,
    GgufScheme,
    IntWeightScheme,
    QuantizationError,
    QuantSpec,
    is_ignored,
)
from torch import nn


class QuantMethod(Protocol):
    def create_weights(self, layer: _Linear, prefix: str, slots: dict[object, tuple[int, int]],
                       in_features: int, dtype: torch.dtype, device: torch.device) -> None:
        """Register the checkpoint's tensors for layer ``prefix``, each with a
        ``weight_loader``."""

    def finalize(self, layer: _Linear) -> None:
        """After loading: the kernels' layout."""

    def apply(self, layer: _Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias``."""


def method_for(spec: QuantSpec) -> QuantMethod:
    if isinstance(spec.scheme, Fp8BlockScheme):
        from shoal.runtime.model.quant.fp8_block import Fp8BlockMethod

        return Fp8BlockMethod(spec.scheme)
    if isinstance(spec.scheme, Fp8ChannelScheme):
        from shoal.runtime.model.quant.fp8_channel import Fp8ChannelMethod

        return Fp8ChannelMethod(spec.scheme)
    if isinstance(spec.scheme, IntWeightScheme):
        from shoal.runtime.model.quant.int_weight import IntWeightMethod

        return IntWeightMethod(spec.scheme)
    if isinstance(spec.scheme, GgufScheme):
        from shoal.runtime.model.quant.gguf_int import GgufMethod

        return GgufMethod()
    raise QuantizationError(f"{spec.method}: no kernels for {spec.scheme}")


PartLoader = Callable[[torch.Tensor, int, int, str], None]


def quant_param(layer: nn.Module, prefix: str, name: str, shape: tuple[int, ...],
                dtype: torch.dtype, device: torch.device, slots: dict[object, tuple[int, int]],
                load_part: PartLoader) -> nn.Parameter:
    """A checkpoint tensor of ``layer`` (``prefix``: its module name); ``load_part(tensor,
    first_row, rows, what)`` places one (possibly fused) part, whose rows ``slots`` gives by
    shard id; ``what`` names it in errors."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

    def load(_param: nn.Parameter, st_slice, shard_id: object) -> None:
        if shard_id not in slots:
            raise QuantizationError(f"{name}: no shard {shard_id!r} in this layer")
        tensor = st_slice if isinstance(st_slice, torch.Tensor) else st_slice[:]
        first, rows = slots[shard_id]
        what = f"{prefix}.{name}" + (f"[{shard_id}]" if len(slots) > 1 else "")
        load_part(tensor, first, rows, what)

    param.weight_loader = load  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def total_rows(slots: dict[object, tuple[int, int]]) -> int:
    return max(first + rows for first, rows in slots.values())


def check_tensor(tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                 what: str) -> None:
    """Refuse a checkpoint tensor of the wrong dtype or shape before anything is copied."""
    if tensor.dtype not in dtypes:
        raise QuantizationError(f"{what}: checkpoint dtype {tensor.dtype}, expected "
                                f"{' or '.join(str(d) for d in dtypes)}")
    if tuple(tensor.shape) != tuple(shape):
        raise QuantizationError(f"{what}: checkpoint shape {tuple(tensor.shape)}, expected "
                                f"{tuple(shape)}")


def _checkpoint_names(module_name: str, packed_modules: dict) -> list[str]:
    """The checkpoint's module names a (possibly fused) layer of ours stands for."""
    parts = [f for f, (packed, _) in packed_modules.items() if module_name.endswith("." + packed)]
    if not parts:
        return [module_name]
    stem = module_name.rsplit(".", 1)[0]
    return [f"{stem}.{fragment}" for fragment in parts]


def quantize_linears(model: nn.Module, spec: QuantSpec, dtype: torch.dtype,
                     device: torch.device) -> int:
    """Give every deferred linear layer its quantized tensors (or, when ``ignore`` names it,
    a plain weight). Returns the layers quantized."""
    method = method_for(spec)
    packed_modules = getattr(model, "packed_modules", {})
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, _Linear) or not module.weight.is_meta:
            continue
        names = _checkpoint_names(name, packed_modules)
        ignored = [is_ignored(n, spec.ignore) for n in names]
        out_rows, in_features = module.weight.shape
        if all(ignored):
            loader = module.weight.weight_loader  # type: ignore[attr-defined]
            module.weight = nn.Parameter(torch.empty((out_rows, in_features), dtype=dtype,
                                                     device=device), requires_grad=False)
            module.weight.weight_loader = loader  # type: ignore[attr-defined]
            continue
        if any(ignored):
            raise QuantizationError(f"{spec.method}: {', '.join(names)} are fused into one "
                                    "layer but the checkpoint quantizes only some of them")
        slots = module.out_slots()
        module.register_parameter("weight", None)
        method.create_weights(module, name, slots, int(in_features), dtype, device)
        module.quant = method
        count += 1
    return count


def finalize_quantized(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, _Linear) and module.quant is not None:
            module.quant.finalize(module)
