"""Quantized checkpoints made from a ``make-model`` checkpoint, as publishers ship them.

Each format is written the way its own tool writes it: FP8 with one ``weight_scale_inv``
per [block_out, block_in] tile (DeepSeek-V3 / Qwen3-FP8's layout, ``quant_method: fp8``);
compressed-tensors through the compressed-tensors library itself (``pack-quantized``); GPTQ
and AWQ packed as AutoGPTQ and AutoAWQ pack (``gptq_pack.py``). Embeddings and the LM head
stay in full precision, as in the published checkpoints. Used by the tests (the
reference is transformers loading the written checkpoint) and the benchmarks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FORMATS = ("fp8-block", "fp8-block128", "ct-w4-group", "ct-w4-group128", "ct-w4-group-asym", "ct-w4-channel", "ct-w8-channel",
           "ct-w8-group-asym", "ct-fp8-dynamic", "ct-w8a8-int", "gptq-w4", "gptq-w4-actorder", "awq-w4")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def checkpoint_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint, under its stored names (an MoE checkpoint's
    experts per expert: ``mlp.experts.N.gate_proj.weight``), in its stored dtype: a bfloat16
    release quantized by llm-compressor gets bfloat16 scales, a float32 one float32."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


# left in full precision, as publishers leave them: embeddings, the LM head, MoE routers
# (their gates; Qwen2-MoE's shared-expert gate)
KEPT = ("embed_tokens", "lm_head", ".mlp.gate", ".block_sparse_moe.gate", "shared_expert_gate")
# compressed-tensors' ignore list for the same modules (llm-compressor's MoE examples)
CT_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$",
             "re:.*shared_expert_gate$"]


def linear_names(state: dict[str, torch.Tensor], kept: bool = False) -> list[str]:
    """The linear layers a publisher's quantizer would quantize: every 2-d ``X.weight``
    but the embeddings, the LM head and the MoE routers (``kept``: all but the embeddings,
    for compressed-tensors, whose config lists the rest as ignored)."""
    skip = ("embed_tokens",) if kept else KEPT
    return [k[:-len(".weight")] for k, v in state.items()
            if k.endswith(".weight") and v.dim() == 2
            and not any(k[:-len(".weight")].endswith(s) or f"{s}." in k for s in skip)]


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> (float8_e4m3fn weight, float32 ``weight_scale_inv`` per tile)."""
    bo, bi = block
    out, inp = weight.shape
    nbo, nbi = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    tiles = padded.view(nbo, bo, nbi, bi)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nbo * bo, nbi * bi)[:out, :inp].contiguous(), scale.float()


def _write_fp8_block(state: dict[str, torch.Tensor], names: list[str], out: Path,
                     block: tuple[int, int]) -> None:
    from safetensors.torch import save_file

    state = dict(state)
    for name in names:
        q, scale = fp8_block_quantize(state[f"{name}.weight"], block)
        state[f"{name}.weight"] = q
        state[f"{name}.weight_scale_inv"] = scale
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_quant_model(source: str | Path, fmt: str, out_dir: str | Path) -> Path:
    """Quantize the full-precision checkpoint ``source`` into ``out_dir`` (created)."""
    from transformers import AutoConfig

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(source)
    AutoConfig.from_pretrained(src).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    state = checkpoint_state(src)
    names = linear_names(state)
    if fmt.startswith("fp8-block"):
        _write_fp8_block(state, names, out, (128, 128) if fmt == "fp8-block128" else (32, 32))
    elif fmt.startswith("ct-"):
        from shoal.runtime.model.quant_makers.compressed import write_compressed

        write_compressed(state, linear_names(state, kept=True),
                         CT_IGNORE if _is_moe(out) else ["lm_head"], out, fmt)
    else:
        from shoal.runtime.model.quant_makers.gptq_awq import write_gptq_awq

        write_gptq_awq(state, names, out, fmt)
    return out


def _is_moe(out: Path) -> bool:
    config = json.loads((out / "config.json").read_text())
    return any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def cached_quant_model(arch: str, size: str, fmt: str) -> Path:
    """Made once into the cache beside the make-model checkpoints."""
    from shoal.runtime.model.make_model import FORMAT_VERSION, cached_build, cached_model
    from shoal.runtime.model.make_moe_model import MOE_ARCHS, cached_moe_model

    source = cached_moe_model(arch, size) if arch in MOE_ARCHS else cached_model(arch, size)
    return cached_build(f"{arch}-{size}-{fmt}-v{FORMAT_VERSION}.{QUANT_VERSION}",
                        lambda out: make_quant_model(source, fmt, out))


QUANT_VERSION = 2  # bump when a maker's output changes
