"""GPTQ and AWQ checkpoints packed as AutoGPTQ (``checkpoint_format: gptq``) and AutoAWQ
(GEMM) pack them, from round-to-nearest codes (the packing and the dequantization are what
is under test, not the calibration). ``gptq-w4-actorder`` assigns columns to groups through a
random permutation, as act-order's Hessian ordering does, so ``g_idx`` is not trivial."""

from __future__ import annotations

import json
from pathlib import Path

import torch

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output column each successive field holds


def _codes(weight: torch.Tensor, group_index: torch.Tensor, n_groups: int, symmetric: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes of ``weight [out, in]``: (codes [out, in], scales
    [out, groups] in float16 as the checkpoints store them, zeros [out, groups])."""
    out = weight.shape[0]
    lo = torch.zeros(out, n_groups)
    hi = torch.zeros(out, n_groups)
    for g in range(n_groups):
        cols = weight[:, group_index == g]
        lo[:, g], hi[:, g] = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
    if symmetric:
        scales = (torch.maximum(lo.abs(), hi) * 2 / 15).clamp(min=1e-8).half()
        zeros = torch.full((out, n_groups), 8.0)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-8).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    s, z = scales.float()[:, group_index], zeros[:, group_index]
    codes = torch.clamp(torch.round(weight / s) + z, 0, 15).to(torch.int64)
    return codes, scales, zeros.to(torch.int64)


def _pack(codes: torch.Tensor, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Eight 4-bit codes per int32 along ``dim``, field i holding element ``order[i]``."""
    moved = codes.movedim(dim, -1)
    fields = moved.reshape(*moved.shape[:-1], -1, 8)
    if order is not None:
        fields = fields[..., order]
    words = (fields << (torch.arange(8) * 4)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # int32 wrap-around
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def write_gptq_awq(state: dict, names: list[str], out: Path, fmt: str) -> None:
    """``state``: the full-precision checkpoint's tensors (float32), ``names`` its linears
    to quantize (per-expert ones included)."""
    from safetensors.torch import save_file

    state = dict(state)
    gen = torch.Generator().manual_seed(0)
    act_order = fmt == "gptq-w4-actorder"
    for name in names:
        weight = state.pop(f"{name}.weight").float()
        in_features = weight.shape[1]
        n_groups = in_features // GROUP
        index = torch.arange(in_features) // GROUP
        if act_order:  # q/k/v (gate/up) share their input, and so its ordering
            stem = name.rsplit(".", 1)[0]
            seed = sum(map(ord, stem)) + in_features
            perm = torch.randperm(in_features, generator=gen.manual_seed(seed))
            index = torch.empty_like(index)
            index[perm] = torch.arange(in_features) // GROUP
        if fmt.startswith("gptq"):
            codes, scales, zeros = _codes(weight, index, n_groups, symmetric=True)
            state[f"{name}.qweight"] = _pack(codes.t(), 0)
            state[f"{name}.qzeros"] = _pack((zeros - 1).t(), 1)  # v1 stores zero - 1
            state[f"{name}.scales"] = scales.t().contiguous()
            state[f"{name}.g_idx"] = index.to(torch.int32)
        else:
            codes, scales, zeros = _codes(weight, index, n_groups, symmetric=False)
            state[f"{name}.qweight"] = _pack(codes.t(), 1, AWQ_ORDER)
            state[f"{name}.qzeros"] = _pack(zeros.t(), 1, AWQ_ORDER)
            state[f"{name}.scales"] = scales.t().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if fmt.startswith("gptq"):
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                         "desc_act": act_order, "sym": True,
                                         "checkpoint_format": "gptq", "lm_head": False}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                         "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
