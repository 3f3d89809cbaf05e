"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and
checking it against the model it would run on.

Everything wrong is a ``LoraAdapterError`` naming why (missing files, not LoRA, DoRA or
trained biases or ``modules_to_save``, a rank above ``--max-lora-rank``, a module this model
has no LoRA slot for, a layer it lacks, a shape that does not match the base): the API turns
it into a 400 and the server keeps serving. The result is CPU tensors, B already scaled
(``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``; per module from ``alpha_pattern``)
and transposed, ready for ``LoraLayer.set_target``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from shoal.runtime.model.lora import LoraModel

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's key: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\."
                  r"\w+\.(?P<name>\w+))\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$")


class LoraAdapterError(ValueError):
    """A bad adapter: the message says why (a 400 from the load endpoint)."""


@dataclass(frozen=True)
class LoraModuleWeights:
    layer: int
    name: str  # the PEFT module name: q_proj, ..., or a fused qkv_proj / gate_up_proj
    lora_a: torch.Tensor  # [r, in]
    scaled_b_t: torch.Tensor  # [r, out]: B transposed, times the scale


@dataclass(frozen=True)
class LoraWeights:
    name: str
    path: str
    rank: int  # the largest module rank
    modules: list[LoraModuleWeights]


def _read_config(folder: Path) -> dict:
    config_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraAdapterError(f"adapter path {folder} is not a directory")
    if not config_path.is_file():
        raise LoraAdapterError(f"adapter at {folder} has no {CONFIG_FILE}")
    if not (folder / WEIGHTS_FILE).is_file():
        other = " (only the safetensors format is read)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise LoraAdapterError(f"adapter at {folder} has no {WEIGHTS_FILE}{other}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{config_path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_path} is not a JSON object")
    return config


def _check_config(config: dict, supported: set[str]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise LoraAdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoraAdapterError(f"adapters with trained biases (bias={config.get('bias')!r}) "
                               "are not supported")
    if config.get("modules_to_save"):
        raise LoraAdapterError(f"modules_to_save ({config['modules_to_save']}) is not "
                               "supported: only LoRA matrices are applied")
    if config.get("fan_in_fan_out"):
        raise LoraAdapterError("fan_in_fan_out adapters (Conv1D bases) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in supported)
        if unknown:
            raise LoraAdapterError(f"unknown target module(s) {', '.join(unknown)}: this "
                                   f"model takes LoRA on {', '.join(sorted(supported))}")


def _alpha(config: dict, module_key: str) -> float:
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(?:.*\.)?{pattern}$", module_key):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def load_peft_adapter(name: str, path: str, lora: LoraModel, num_layers: int,
                      dtype: torch.dtype) -> LoraWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    config = _read_config(folder)
    supported = lora.target_names
    _check_config(config, supported)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise LoraAdapterError(f"{folder / WEIGHTS_FILE} is not readable: {exc}") from None
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"unsupported adapter tensor {key!r}: only LoRA A/B "
                                   "matrices of decoder-layer projections are applied")
        layer, module_name = int(match["layer"]), match["name"]
        if module_name not in supported:
            raise LoraAdapterError(f"unknown target module {module_name!r} ({key}): this "
                                   f"model takes LoRA on {', '.join(sorted(supported))}")
        if layer >= num_layers:
            raise LoraAdapterError(f"{key} targets layer {layer}; the model has {num_layers}")
        pairs.setdefault((layer, module_name, match["module"]), {})[match["ab"]] = tensor
    if not pairs:
        raise LoraAdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA matrices")
    modules: list[LoraModuleWeights] = []
    blocks_used: set[tuple[int, int]] = set()
    max_rank = 0
    for (layer, module_name, module_key), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"{module_key} has lora_{''.join(ab)} without its pair")
        target = lora.targets.get((layer, module_name))
        if target is None:  # a layer whose feed-forward block takes no adapter (MoE)
            raise LoraAdapterError(f"{module_key}: layer {layer} has no LoRA slot for "
                                   f"{module_name} (a mixture-of-experts block?)")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise LoraAdapterError(f"{module_key}: lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)} are not [r, in] and [out, r]")
        if rank > lora.max_rank:
            raise LoraAdapterError(f"{module_key} has rank {rank}, above --max-lora-rank "
                                   f"{lora.max_rank}")
        if a.shape[1] != target.in_size or b.shape[0] != target.out_size:
            raise LoraAdapterError(
                f"{module_key}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match "
                f"the base model's {module_name} ({target.in_size} in, {target.out_size} out)")
        mine = {(id(target.layer), block) for block in target.blocks}
        if mine & blocks_used:
            raise LoraAdapterError(f"{module_key} overlaps another module of the adapter "
                                   "on the same packed projection (fused and split at once)")
        blocks_used |= mine
        alpha = _alpha(config, module_key)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        scaled_b_t = (b.float() * scale).T.contiguous().to(dtype)
        modules.append(LoraModuleWeights(layer, module_name, a.to(dtype).contiguous(),
                                         scaled_b_t))
        max_rank = max(max_rank, rank)
    return LoraWeights(name, str(folder), max_rank, modules)
