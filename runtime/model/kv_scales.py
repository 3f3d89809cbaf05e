"""KV cache scales a checkpoint carries: per-layer ``k_scale`` / ``v_scale`` for a float8 KV
cache (``attention/kv_cache_dtype.py``), read into each attention layer's ``kv_scales``.

Checkpoints calibrated for an FP8 KV cache (llm-compressor's ``kv_cache_scheme``, NVIDIA
ModelOpt, AutoFP8) store one scale per layer for K and one for V under the attention module:
``<layer>.self_attn.k_scale`` and ``.v_scale``; older ones ``.self_attn.k_proj.output_scale``
and ``.v_proj.output_scale``, or a single ``.self_attn.kv_scale`` for both. As vLLM: a layer
given only one of K and V uses it for both; ``--kv-cache-dtype auto`` leaves the cache in the
model's dtype and the scales unused (the backends scale only a float8 cache). Only
per-tensor scales are served: a per-head scale is refused naming its shape.
"""

from __future__ import annotations

import math
import re

import torch
from shoal.runtime.model.quant.spec import QuantizationError

_KV_SCALE = re.compile(r"^(?P<attention>.+\.self_attn)\."
                       r"(?:(?P<which>k|v|kv)_scale|(?P<proj>k|v)_proj\.output_scale)$")
_SLOTS = {"k": (0,), "v": (1,), "kv": (0, 1)}


def kv_scale_slots(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(attention module name, slots of its ``kv_scales`` the tensor sets: 0 = K, 1 = V) for a
    KV cache scale's checkpoint name (already under the model's module names), else None."""
    match = _KV_SCALE.match(name)
    if match is None:
        return None
    return match.group("attention"), _SLOTS[match.group("which") or match.group("proj")]


class KvScaleReader:
    """Reads the scales into the model's attention layers as load_weights meets them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = dict(model.named_modules())
        self.given: dict[str, set[int]] = {}  # attention module -> slots the checkpoint set

    def read(self, ckpt_name: str, module_name: str, slots: tuple[int, ...], st_slice) -> None:
        module = self.modules.get(module_name)
        scales = getattr(module, "kv_scales", None)
        if not isinstance(scales, torch.Tensor):
            raise QuantizationError(
                f"checkpoint tensor {ckpt_name!r} is a KV cache scale, but "
                f"{type(module).__name__ if module is not None else module_name} has no float8 "
                "KV cache to scale")
        tensor = st_slice if isinstance(st_slice, torch.Tensor) else st_slice[...]  # 0-dim too
        if tensor.numel() != 1:
            raise QuantizationError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}: only "
                "per-tensor KV cache scales (one for K, one for V per layer) are supported")
        value = float(tensor.float().item())
        if not math.isfinite(value) or value <= 0.0:
            raise QuantizationError(f"checkpoint tensor {ckpt_name!r} is {value}, not a "
                                    "positive KV cache scale")
        for slot in slots:
            scales[slot] = value
        self.given.setdefault(module_name, set()).update(slots)

    def finish(self) -> int:
        """A layer given one scale uses it for both (vLLM's rule for a single ``kv_scale``);
        returns the number of layers given scales."""
        for module_name, slots in self.given.items():
            if len(slots) == 1:
                scales = self.modules[module_name].kv_scales
                (slot,) = slots
                scales[1 - slot] = scales[slot]
        return len(self.given)
