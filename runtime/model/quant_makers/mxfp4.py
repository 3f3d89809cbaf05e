"""An MXFP4 gpt-oss checkpoint as published gpt-oss checkpoints store their experts, made from
a full-precision one (transformers can only write MXFP4 through its GPU Triton kernels).

Each expert tensor ``[E, in, out]`` is stored as ``<name>_blocks`` / ``<name>_scales`` in the
layout ``quant/mxfp4.py`` describes: groups of 32 along ``in``, a power-of-two scale per
group chosen so that the group's largest magnitude fits E2M1's 6, each value rounded to the
nearest E2M1 value. The rounding is coarse; what is under test is that the server and
transformers read the same dequantized weights, not the quantization's accuracy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from shoal.runtime.model.quant.mxfp4 import E2M1_VALUES, EXPONENT_BIAS, GROUP

EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [E, in, out]`` -> (blocks ``[E, out, in / 32, 16]``, scales ``[E, out,
    in / 32]``), both uint8."""
    experts, size_in, size_out = weight.shape
    if size_in % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, got {size_in}")
    groups = weight.float().transpose(1, 2).reshape(experts, size_out, size_in // GROUP, GROUP)
    peak = groups.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-EXPONENT_BIAS, EXPONENT_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + EXPONENT_BIAS).to(torch.uint8)


def make_mxfp4_gpt_oss(source: str | Path, out_dir: str | Path) -> Path:
    """Copy the full-precision gpt-oss checkpoint in ``source`` to ``out_dir`` with its
    experts in MXFP4 and config.json's ``quantization_config`` saying so."""
    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if name.endswith(EXPERT_TENSORS):
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(tensor)
            else:
                tensors[name] = tensor
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" \
                and path.name != "model.safetensors.index.json":
            shutil.copy(path, out / path.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
