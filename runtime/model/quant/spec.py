"""What a checkpoint's ``quantization_config`` says, checked against ``--quantization``.

``parse_quantization`` is the pure rule: it reads config.json's ``quantization_config``
(transformers' and vLLM's field names), returns a typed ``QuantSpec`` the loader builds the
layers from, and refuses at startup, naming the method, the field and the reason, whatever
the kernels cannot serve: an unknown method, a scheme outside the supported ones, a flag
that names another method. Nothing is loaded before this has decided, so no quantized
tensor is ever copied into a full-precision parameter unscaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# --quantization values (vLLM's names); the *_marlin spellings are vLLM's GPU kernels for the
# same checkpoints and name the same method here
METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}


class QuantizationError(ValueError):
    """A quantized checkpoint (or flag) this server refuses, with the reason."""


@dataclass(frozen=True)
class Fp8BlockScheme:
    """float8_e4m3fn weights, one float32 ``weight_scale_inv`` per [block_out, block_in]
    tile (DeepSeek-V3, Qwen3-FP8); activations stay in the model dtype."""
    block_out: int
    block_in: int


@dataclass(frozen=True)
class IntWeightScheme:
    """Integer weights with float scales, activations in the model dtype (W4A16 / W8A16).
    ``group_size`` None: one scale per output channel. ``layout``: how the checkpoint packs
    them (compressed-tensors ``pack-quantized``, GPTQ, AWQ GEMM)."""
    bits: int
    group_size: int | None
    symmetric: bool
    layout: str  # "pack-quantized" | "int-quantized" | "gptq" | "awq"
    desc_act: bool = False  # GPTQ act-order: g_idx maps input columns to groups


@dataclass(frozen=True)
class Fp8ChannelScheme:
    """compressed-tensors ``float-quantized``: float8_e4m3fn weights with one ``weight_scale``
    per output channel (or per tensor). Dynamic per-token activation quantization, which the
    checkpoint also names, is not emulated on CPU: activations stay in the model dtype, as in
    transformers' own CPU loading."""
    per_tensor: bool


@dataclass(frozen=True)
class Mxfp4Scheme:
    """gpt-oss's MXFP4 experts (``quant/mxfp4.py``): dequantized to the model dtype as they
    are loaded, so the model runs full precision; every other tensor is stored so."""


@dataclass(frozen=True)
class GgufScheme:
    """A GGUF file's linear weights: Q4_0/Q4_1/Q8_0 kept as they are stored, any other type
    dequantized at load (``quant/gguf_int.py``). Not read from a config.json: chosen by the
    loader for a GGUF file it serves on CPU (``loader.keeps_gguf_quantized``)."""


Scheme = Fp8BlockScheme | Fp8ChannelScheme | IntWeightScheme | Mxfp4Scheme | GgufScheme


@dataclass(frozen=True)
class QuantSpec:
    method: str  # one of METHODS
    scheme: Scheme
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) left unquantized

    @property
    def name(self) -> str:
        """What /v1/models and the metrics report."""
        return self.method


def check_flag(spec: QuantSpec | None, flag: str | None) -> None:
    """``--quantization`` names the checkpoint's method (or is unset: the checkpoint says)."""
    if not flag:
        return
    method = ALIASES.get(flag, flag)
    if method not in METHODS:
        raise QuantizationError(f"--quantization {flag!r} is not supported (supported: "
                                f"{', '.join(METHODS)})")
    if spec is None:
        raise QuantizationError(
            f"--quantization {flag}: the checkpoint has no quantization_config, and "
            "quantizing full-precision weights at load time is not supported")
    if spec.method != method:
        raise QuantizationError(f"--quantization {flag} but the checkpoint is quantized "
                                f"with {spec.method}")


def check_checkpoint_flag(model_dir: str, flag: str | None) -> None:
    """``--quantization`` against a checkpoint directory's config.json (cheap: no tensor is
    read); a GGUF file or a directory without config.json is left to the engine's check."""
    import json
    from pathlib import Path

    config = Path(model_dir) / "config.json"
    if flag and config.is_file():
        check_flag(parse_quantization(json.loads(config.read_text())), flag)


def parse_quantization(raw_config: dict) -> QuantSpec | None:
    """config.json's content -> the spec, None for a plain checkpoint."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        text = raw_config.get("text_config")
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError("quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method not in METHODS:
        raise QuantizationError(f"quantization method {qc.get('quant_method')!r} is not "
                                f"supported (supported: {', '.join(METHODS)})")
    if method == "compressed-tensors":
        from shoal.runtime.model.quant.ct_spec import parse_compressed_tensors

        return parse_compressed_tensors(qc)
    if method == "mxfp4":
        return QuantSpec("mxfp4", Mxfp4Scheme(), tuple(qc.get("modules_to_not_convert") or ()))
    return {"fp8": _fp8, "gptq": _gptq, "awq": _awq}[method](qc)


def _fp8(qc: dict) -> QuantSpec:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8: fmt {fmt!r} is not supported (only e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationError(f"fp8: activation_scheme {qc.get('activation_scheme')!r} "
                                "is not supported (only dynamic)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"fp8: weight_block_size {block!r} is not supported (a "
                                "[rows, columns] block; per-tensor FP8 is not served)")
    if qc.get("scale_fmt") not in (None, "float32"):
        raise QuantizationError(f"fp8: scale_fmt {qc.get('scale_fmt')!r} is not supported")
    return QuantSpec("fp8", Fp8BlockScheme(block[0], block[1]),
                     tuple(qc.get("modules_to_not_convert") or ()))


def int_bits(method: str, bits: Any, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise QuantizationError(f"{method}: {bits}-bit weights are not supported "
                                f"(supported: {', '.join(map(str, allowed))})")
    return int(bits)


def group_size(method: str, group: Any) -> int | None:
    if group in (None, -1):
        return None
    if not isinstance(group, int) or group <= 0:
        raise QuantizationError(f"{method}: group_size {group!r} is not supported")
    return group


def _gptq(qc: dict) -> QuantSpec:
    if qc.get("checkpoint_format", "gptq") != "gptq":
        raise QuantizationError(f"gptq: checkpoint_format {qc.get('checkpoint_format')!r} "
                                "is not supported (only gptq)")
    if qc.get("lm_head"):
        raise QuantizationError("gptq: a quantized lm_head is not supported")
    bits = int_bits("gptq", qc.get("bits"), (4, 8))
    return QuantSpec("gptq", IntWeightScheme(bits, group_size("gptq", qc.get("group_size")),
                                             bool(qc.get("sym", True)), "gptq",
                                             bool(qc.get("desc_act", False))),
                     tuple(qc.get("modules_to_not_convert") or ()))


def _awq(qc: dict) -> QuantSpec:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"awq: version {version!r} is not supported (only gemm)")
    bits = int_bits("awq", qc.get("bits", qc.get("w_bit")), (4,))
    group = group_size("awq", qc.get("group_size", qc.get("q_group_size")))
    return QuantSpec("awq", IntWeightScheme(bits, group, not qc.get("zero_point", True), "awq"),
                     tuple(qc.get("modules_to_not_convert") or ()))


def is_ignored(module_name: str, ignore: tuple[str, ...]) -> bool:
    """``ignore`` entries: a module name, its suffix, or compressed-tensors' ``re:`` regex."""
    import re

    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module_name):
                return True
        elif module_name == entry or module_name.endswith("." + entry):
            return True
    return False
