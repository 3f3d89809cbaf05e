"""Build a model and fill it from safetensors (one shard-sized read per tensor) or a GGUF
file (one dequantized tensor at a time, runtime/model/gguf_checkpoint.py).

Parameters are allocated once, uninitialised, in the target dtype and device; each
checkpoint tensor is opened lazily (``safe_open`` + ``get_slice``) and only this rank's part
is read and copied in, so loading never holds a second full copy of the weights.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from shoal.runtime.attention.backend import AttentionBackend
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.decoder import DecoderForCausalLM, model_class
from shoal.runtime.model.gguf_checkpoint import GGUFTensor, open_gguf
from shoal.runtime.model.kv_scales import KvScaleReader, kv_scale_slots
from shoal.runtime.model.linear import (
    linear_weights_deferred,
    pack_cpu_linear_weights,
    use_native_bf16_linears,
    use_panel_linears,
)
from shoal.runtime.model.moe import expert_checkpoint_target, pack_cpu_experts
from shoal.runtime.model.parallel import ParallelContext
from shoal.runtime.model.quant.gguf_embedding import finalize_vocab, stage_vocab
from shoal.runtime.model.quant.linear_method import finalize_quantized, quantize_linears
from shoal.runtime.model.quant.mxfp4 import dequantized_tensors
from shoal.runtime.model.quant.spec import (
    GgufScheme,
    Mxfp4Scheme,
    QuantizationError,
    QuantSpec,
    check_flag,
)
from shoal.runtime.model_source import gguf_file

logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def checkpoint_tensors(model_dir: str | Path, gguf_blocks: bool = False
                       ) -> Iterator[tuple[str, Any]]:
    """(HF tensor name, lazily read tensor) for every tensor of the checkpoint: safetensors
    slices, or a GGUF file's tensors dequantized to float32 one at a time (``gguf_blocks``:
    as ``GGUFTensor``, still in their stored blocks, for the loader to dequantize only what
    a layer does not keep quantized)."""
    gguf = gguf_file(model_dir)
    if gguf is not None:
        for tensor in open_gguf(gguf).tensors():
            yield tensor.hf_name, tensor if gguf_blocks else tensor.dequantize()
        open_gguf.cache_clear()  # unmap the file: the parameters hold the values now
        return
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield ckpt_name, f.get_slice(ckpt_name)


def load_weights(model: DecoderForCausalLM, model_dir: str | Path,
                 gguf_quantized: bool = False) -> None:
    """``gguf_quantized``: a GGUF file's linear layers take its blocks as stored
    (``keeps_gguf_quantized``)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {(name, shard) for name, shard in _expected_shards(model)}
    loaded: set[tuple[str, object]] = set()
    mtp = model.config.mla.mtp_layers if model.config.mla is not None else 0
    skipped_mtp = 0
    kv_scales = KvScaleReader(model)
    spec = GGUF_SPEC if gguf_quantized else model.config.quantization
    tensors = checkpoint_tensors(model_dir, gguf_blocks=gguf_quantized)
    if dequantized_at_load(model.config.quantization):
        tensors = dequantized_tensors(tensors)
    for ckpt_name, st_slice in tensors:
        if mtp and _past_the_decoder(ckpt_name, model.config.num_layers):
            skipped_mtp += 1
            continue
        scale_slots = kv_scale_slots(_model_name(model, ckpt_name) or "")
        if scale_slots is not None:
            kv_scales.read(ckpt_name, *scale_slots, st_slice)
            continue
        target = _target(model, ckpt_name, params)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no parameter in "
                             f"{type(model).__name__} (looked for {name!r})")
        param = params[name]
        if isinstance(st_slice, GGUFTensor) and not getattr(param, "takes_gguf", False):
            st_slice = st_slice.dequantize()  # norms, embeddings: full precision
        _refuse_unscaled(ckpt_name, st_slice, param)
        loader = getattr(param, "weight_loader", _load_replicated)
        fused = _fused_parts(model, name, shard)
        if fused is not None and spec is not None and not dequantized_at_load(spec):
            raise QuantizationError(f"{ckpt_name}: a fused checkpoint tensor in a quantized "
                                    "checkpoint is not supported")
        if fused is None:
            filled = loader(param, st_slice, shard)
            # stacked experts' loaders say which shards a (possibly fused) tensor filled
            loaded.update((name, s) for s in filled or [shard])
            continue
        # a fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj): read whole,
        # each part handed to the packed layer's loader as if stored separately
        tensor, start = st_slice[:], 0
        for part, rows in fused:
            loader(param, tensor.narrow(0, start, rows), part)
            loaded.add((name, part))
            start += rows
    if kv_scales.finish():
        logger.info("KV cache scales read for %d attention layers (used by --kv-cache-dtype "
                    "fp8)", len(kv_scales.given))
    if mtp:
        logger.info("%s: %d multi-token-prediction layer(s) (num_nextn_predict_layers) are "
                    "not used (no MTP speculative decoding); %d of their tensors skipped",
                    model.config.architecture, mtp, skipped_mtp)
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def _past_the_decoder(ckpt_name: str, num_layers: int) -> bool:
    """A tensor of a layer after the last decoder layer: DeepSeek-V3 checkpoints store their
    multi-token-prediction modules as ``model.layers.<num_hidden_layers + i>.*``."""
    match = _LAYER_INDEX.match(ckpt_name)
    return match is not None and int(match.group(1)) >= num_layers


# safetensors dtypes a full-precision parameter may be filled from (cast on copy)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _refuse_unscaled(ckpt_name: str, st_slice, param: torch.nn.Parameter) -> None:
    """A quantized tensor (FP8, packed integers) never reaches a full-precision parameter:
    copied, it would be cast without its scales. Checked before anything of it is read."""
    full = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    if param.dtype not in full:
        return  # a quantized parameter: its own loader checks the dtype
    if isinstance(st_slice, torch.Tensor):
        ok, stored = st_slice.dtype in full, str(st_slice.dtype)
    else:
        stored = st_slice.get_dtype()
        ok = stored in _FLOAT_DTYPES
    if ok:
        return
    raise QuantizationError(
        f"checkpoint tensor {ckpt_name!r} is {stored}, a quantized dtype, but its parameter is "
        f"{param.dtype}: config.json's quantization_config does not describe this tensor "
        "(a quantized checkpoint without quantization_config, or a layer it says is not "
        "quantized)")


def _load_replicated(param: torch.nn.Parameter, st_slice, _shard: object) -> None:
    """Norm gains and other parameters every rank holds whole."""
    tensor = st_slice[:]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def _fused_parts(model: DecoderForCausalLM, name: str,
                 shard: object) -> list[tuple[object, int]] | None:
    """The (shard id, rows) a fused checkpoint tensor stacks, or None when it is not fused."""
    if shard is not None:
        return None
    c = model.config
    if ".qkv_proj." in name:
        kv = c.num_kv_heads * c.head_dim
        return [("q", c.num_heads * c.head_dim), ("k", kv), ("v", kv)]
    if ".gate_up_proj." in name:
        return [(0, c.intermediate_size), (1, c.intermediate_size)]
    return None


def _unwrapped(ckpt_name: str, prefix: str | None) -> str | None:
    """A text-only wrapper's tensor under the names of a plain ``*ForCausalLM`` (None: a part
    of the wrapper the text model does not use, e.g. the vision tower). transformers 5 saves
    ``model.language_model.X`` and ``lm_head``; older releases ``language_model.model.X``
    and ``language_model.lm_head``."""
    if prefix is None:
        return ckpt_name
    if ckpt_name.startswith("lm_head."):
        return ckpt_name
    for old, new in ((f"model.{prefix}.", "model."), (f"{prefix}.model.", "model."),
                     (f"{prefix}.lm_head.", "lm_head.")):
        if ckpt_name.startswith(old):
            return new + ckpt_name[len(old):]
    return None


_BASE_MODEL_PARTS = ("embed_tokens.", "layers.", "norm.")


def _model_name(model: DecoderForCausalLM, ckpt_name: str) -> str | None:
    """A checkpoint tensor's name under the plain ``*ForCausalLM``'s module names (None: a
    part of a wrapper the text model does not use)."""
    unwrapped = _unwrapped(ckpt_name, model.config.weight_prefix)
    if unwrapped is not None and unwrapped.startswith(_BASE_MODEL_PARTS):
        return "model." + unwrapped  # saved from the base decoder (``Qwen3Model``)
    return unwrapped


def _target(model: DecoderForCausalLM, ckpt_name: str,
            params: dict | None = None) -> tuple[str, object] | None:
    if "rotary_emb" in ckpt_name:
        return None
    unwrapped = _model_name(model, ckpt_name)
    if unwrapped is None:
        return None
    ckpt_name = unwrapped
    if ckpt_name.startswith("lm_head.") and model.config.tie_word_embeddings:
        return None  # same tensor as the embedding
    moe = expert_checkpoint_target(ckpt_name)
    if moe is not None:
        if moe[1] is not None:
            if params is not None and moe[0] not in params and f"{moe[0]}.weight" in params:
                return f"{moe[0]}.weight", moe[1]  # quantized experts' FP8 weight
            return moe
        ckpt_name = moe[0]  # renamed into our module names; mapped as usual below
    for fragment, (packed, shard) in model.packed_modules.items():
        if f".{fragment}." in ckpt_name:
            name = ckpt_name.replace(f".{fragment}.", f".{packed}.")
            if params is not None and name not in params and ckpt_name in params:
                break  # the layer keeps it unpacked (a plain MLP's up_proj)
            return name, shard
    return ckpt_name, None


def _expected_shards(model: DecoderForCausalLM) -> list[tuple[str, object]]:
    by_packed: dict[str, list[object]] = {}
    for packed, shard in model.packed_modules.values():
        by_packed.setdefault(packed, []).append(shard)
    out: list[tuple[str, object]] = []
    for name, param in model.named_parameters():  # tied weights appear once, under the embedding
        if hasattr(param, "expected_shards"):  # stacked experts: one shard per expert matrix
            out.extend((name, s) for s in param.expected_shards)
            continue
        packed = next((p for p in by_packed if f".{p}." in name), None)
        out.extend((name, s) for s in by_packed[packed]) if packed else out.append((name, None))
    return out


LOAD_FORMATS = ("auto", "dummy")
DUMMY_RANGE = 1e-3  # vLLM's dummy weights: uniform in [-1e-3, 1e-3]


def initialize_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Every floating-point parameter uniform in ``[-DUMMY_RANGE, DUMMY_RANGE]``, made where
    it lives (no checkpoint, no host copy): the shapes and the speed of a model, not its
    outputs. Seeded per parameter, so the same seed gives the same weights."""
    for index, (_, param) in enumerate(sorted(model.named_parameters())):
        if param.is_floating_point():
            generator = torch.Generator(device=param.device).manual_seed(seed * 100003 + index)
            param.data.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)


def dequantized_at_load(spec: QuantSpec | None) -> bool:
    """MXFP4 experts become full-precision tensors as they are read: the model is built,
    loaded and run as an unquantized one."""
    return spec is not None and isinstance(spec.scheme, Mxfp4Scheme)


def check_dequantized_model(spec: QuantSpec, config: ModelConfig) -> None:
    """MXFP4 is gpt-oss's format for its experts; on anything else it is refused."""
    if config.moe is None or config.moe.gpt_oss_swiglu is None:
        raise QuantizationError(f"{spec.method}: served for gpt-oss experts only, not for "
                                f"{config.architecture}")


def check_quantized_model(spec: QuantSpec, config: ModelConfig, parallel: ParallelContext,
                          load_format: str) -> None:
    """What the quantized layers do not serve yet, refused before anything is built."""
    if parallel.world_size > 1:
        raise QuantizationError(f"{spec.method}: quantized checkpoints are served at "
                                "--tensor-parallel-size 1 only")
    if config.moe is not None:
        check_quantized_experts(spec, config)
    if load_format == "dummy":
        raise QuantizationError(f"{spec.method}: --load-format dummy makes full-precision "
                                "weights; it does not apply to a quantized checkpoint")


def check_quantized_experts(spec: QuantSpec, config: ModelConfig) -> None:
    """Quantized experts run on the native CPU kernel or the Triton fused MoE
    (``quant/experts.py``); what neither takes is refused before anything is built."""
    from shoal.runtime.model.quant.spec import Fp8BlockScheme, Fp8ChannelScheme, IntWeightScheme

    assert config.moe is not None
    if isinstance(spec.scheme, GgufScheme) or not isinstance(
            spec.scheme, IntWeightScheme | Fp8BlockScheme | Fp8ChannelScheme):
        raise QuantizationError(f"{spec.method}: quantized experts of {config.architecture} "
                                "are not supported in this format")
    if config.moe.gpt_oss_swiglu is not None:
        raise QuantizationError(f"{spec.method}: quantized gpt-oss experts (biases, "
                                "interleaved gate/up) are not supported")


def check_quantized_experts_device(device: torch.device) -> None:
    if device.type == "cuda":
        return
    from shoal.kernels.native_cpu import unavailable_reason

    reason = unavailable_reason() if device.type == "cpu" else f"device {device}"
    if reason is not None:
        raise QuantizationError(f"quantized experts run on the native CPU kernels or CUDA, "
                                f"not here: {reason}")


GGUF_SPEC = QuantSpec("gguf", GgufScheme())


def keeps_gguf_quantized(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                         parallel: ParallelContext, load_format: str) -> bool:
    """A GGUF file's Q4_0/Q4_1/Q8_0 linear weights and vocabulary table stay in their blocks
    (``quant/gguf_int``, ``quant/gguf_embedding``) where the native int kernel runs them: on
    CPU, float32 or bfloat16, one rank, the native library built. Elsewhere they are
    dequantized at load, as every other GGUF type is."""
    if gguf_file(model_dir) is None or load_format != "auto" or device.type != "cpu" or \
            dtype not in (torch.float32, torch.bfloat16) or parallel.world_size != 1:
        return False
    from shoal.kernels.native_cpu import unavailable_reason

    return unavailable_reason() is None


def build_model(config: ModelConfig, model_dir: str | Path, backend: AttentionBackend,
                parallel: ParallelContext, max_positions: int, dtype: torch.dtype,
                device: torch.device, load_format: str = "auto",
                seed: int = 0, quantization: str | None = None) -> DecoderForCausalLM:
    """``load_format``: ``auto`` reads the checkpoint in ``model_dir``; ``dummy`` needs only
    its config.json and fills the weights with small random values. ``quantization``
    (``--quantization``): the method the checkpoint must be quantized with (None: any)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of "
                         f"{', '.join(LOAD_FORMATS)}")
    spec = config.quantization
    check_flag(spec, quantization)
    if spec is not None and dequantized_at_load(spec):
        check_dequantized_model(spec, config)
        spec = None  # built, loaded and run full precision
    if spec is not None:
        check_quantized_model(spec, config, parallel, load_format)
    gguf_quantized = spec is None and keeps_gguf_quantized(model_dir, device, dtype, parallel,
                                                           load_format)
    if gguf_quantized:
        spec = GGUF_SPEC
    cls = model_class(config.architecture)
    with linear_weights_deferred() if spec is not None else nullcontext():
        model = cls(config, parallel, backend, max_positions, dtype, device)
    if spec is not None:
        quantize_linears(model, spec, dtype, device)
        if config.moe is not None:
            from shoal.runtime.model.quant.experts import quantize_experts

            if not gguf_quantized:
                check_quantized_experts_device(device)
            quantize_experts(model, spec, device)
    if gguf_quantized:
        stage_vocab(model, dtype)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir, gguf_quantized)
    if spec is not None:
        finalize_quantized(model)
        if config.moe is not None:
            from shoal.runtime.model.quant.experts import finalize_experts

            finalize_experts(model)
    if gguf_quantized:
        finalize_vocab(model)
    if model.kernels.choice.moe == "native_cpu":
        pack_cpu_experts(model)
    if model.kernels.choice.linear_panels:
        use_panel_linears(model)  # the two below then find no dense layer left
    if model.kernels.choice.linear == "onednn":
        pack_cpu_linear_weights(model)
    elif model.kernels.choice.linear == "native_bf16":
        use_native_bf16_linears(model)
    return model.eval()
