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
METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
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
    layout: str  # "pack-quantized" | "gptq" | "awq"
    desc_act: bool = False  # GPTQ act-order: g_idx maps input columns to groups


Scheme = Fp8BlockScheme | IntWeightScheme


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
    parse = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "gptq": _gptq,
             "awq": _awq}[method]
    return parse(qc)


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


def _int_bits(method: str, bits: Any, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise QuantizationError(f"{method}: {bits}-bit weights are not supported "
                                f"(supported: {', '.join(map(str, allowed))})")
    return int(bits)


def _group(method: str, group: Any) -> int | None:
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
    bits = _int_bits("gptq", qc.get("bits"), (4, 8))
    return QuantSpec("gptq", IntWeightScheme(bits, _group("gptq", qc.get("group_size")),
                                             bool(qc.get("sym", True)), "gptq",
                                             bool(qc.get("desc_act", False))),
                     tuple(qc.get("modules_to_not_convert") or ()))


def _awq(qc: dict) -> QuantSpec:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"awq: version {version!r} is not supported (only gemm)")
    bits = _int_bits("awq", qc.get("bits", qc.get("w_bit")), (4,))
    group = _group("awq", qc.get("group_size", qc.get("q_group_size")))
    return QuantSpec("awq", IntWeightScheme(bits, group, not qc.get("zero_point", True), "awq"),
                     tuple(qc.get("modules_to_not_convert") or ()))


def _compressed_tensors(qc: dict) -> QuantSpec:
    """compressed-tensors' own model of its config parses it; one weight-only scheme served."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        config = QuantizationConfig.model_validate(qc)
    except Exception as exc:  # pydantic's ValidationError names the field
        raise QuantizationError(f"compressed-tensors: quantization_config is invalid: "
                                f"{exc}") from None
    if len(config.config_groups) != 1:
        raise QuantizationError("compressed-tensors: more than one config group "
                                f"({', '.join(config.config_groups)}) is not supported")
    (name, group), = config.config_groups.items()
    fmt = str(group.format or config.format)
    if fmt != "pack-quantized":
        raise QuantizationError(f"compressed-tensors: format {fmt!r} is not supported "
                                "(supported: pack-quantized)")
    if group.input_activations is not None or group.output_activations is not None:
        raise QuantizationError(f"compressed-tensors: {name} quantizes activations; only "
                                "weight-only schemes are supported")
    if config.kv_cache_scheme is not None:
        raise QuantizationError("compressed-tensors: kv_cache_scheme is not supported")
    if [t for t in group.targets if t != "Linear"]:
        raise QuantizationError(f"compressed-tensors: targets {group.targets} are not "
                                "supported (only Linear)")
    w = group.weights
    if w is None:
        raise QuantizationError(f"compressed-tensors: {name} has no weights scheme")
    if str(w.type) != "int":
        raise QuantizationError(f"compressed-tensors: {w.type} weights in pack-quantized")
    bits = _int_bits("compressed-tensors", w.num_bits, (4, 8))
    strategy = str(w.strategy)
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"compressed-tensors: strategy {strategy!r} is not supported "
                                "(supported: group, channel)")
    if w.actorder not in (None, "static") and str(w.actorder) not in ("static",):
        raise QuantizationError(f"compressed-tensors: actorder {w.actorder!r} is not "
                                "supported")
    if w.dynamic:
        raise QuantizationError("compressed-tensors: dynamic weight scales are not supported")
    group_size = w.group_size if strategy == "group" else None
    return QuantSpec("compressed-tensors",
                     IntWeightScheme(bits, group_size, bool(w.symmetric), "pack-quantized"),
                     tuple(config.ignore or ()))


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
