"""compressed-tensors ``pack-quantized`` checkpoints, written by the compressed-tensors library
itself: its config applied to the model, min/max weight observers turned into scales and zero
points by its ``calculate_qparams`` (llm-compressor's RTN path, no calibration data), then its
``ModelCompressor`` packing and its ``update_config`` writing ``quantization_config``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# format name -> (bits, group size or None for per-channel, symmetric)
SCHEMES = {
    "ct-w4-group": (4, 32, True),
    "ct-w4-group128": (4, 128, True),
    "ct-w4-group-asym": (4, 32, False),
    "ct-w4-channel": (4, None, True),
    "ct-w8-channel": (8, None, True),
    "ct-w8-group-asym": (8, 32, False),
}
# format name -> (compressed-tensors' preset scheme, its compression format): weights and
# dynamic per-token activations
PRESETS = {
    "ct-fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"),
    "ct-w8a8-int": ("W8A8", "int-quantized"),
}


def linear_tree(state: dict, names: list[str]) -> Any:
    """A module tree with one ``nn.Linear`` per name, holding ``state[name + ".weight"]``:
    the quantizable linears as llm-compressor sees them, MoE experts included (transformers
    5 keeps them as stacked parameters, the checkpoint as per-expert linears)."""
    import torch

    root = torch.nn.Module()
    for name in names:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        weight = state[f"{name}.weight"]
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                 dtype=weight.dtype)
        linear.weight.data.copy_(weight)
        parent.add_module(leaf, linear)
    return root


def write_compressed(state: dict, names: list[str], ignore: list[str], out: Path,
                     fmt: str) -> None:
    """``state``: the full-precision checkpoint's tensors; ``names``: its linears, those
    ``ignore`` matches left unquantized (the LM head, MoE routers), as the config's
    ``ignore`` then names them. Writes the checkpoint and its ``quantization_config`` into
    ``out`` (config.json already there)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    if fmt in PRESETS:
        preset, compression = PRESETS[fmt]
        scheme = preset_name_to_scheme(preset, ["Linear"])
        args, group = scheme.weights, None
    else:
        bits, group, symmetric = SCHEMES[fmt]
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                                strategy="group" if group else "channel", group_size=group)
        scheme, compression = QuantizationScheme(targets=["Linear"], weights=args), \
            "pack-quantized"
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                                quantization_status=QuantizationStatus.FROZEN)
    model = linear_tree(state, names)
    apply_quantization_config(model, config)
    module: Any
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight = module.weight.data
        rows = weight.reshape(weight.shape[0], -1, group or weight.shape[1])
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, compression)
    compressor.compress_model(model)
    linears = {f"{n}.weight" for n in names}
    tensors = {k: v.contiguous() for k, v in state.items() if k not in linears}
    tensors.update({k: v.contiguous() for k, v in model.state_dict().items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
