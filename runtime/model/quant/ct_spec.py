"""A compressed-tensors ``quantization_config`` read by compressed-tensors' own pydantic model,
then checked against what the kernels serve: one config group targeting Linear layers, in
one of three formats:

- ``pack-quantized``: int4/int8 weights, group or channel, symmetric or asymmetric (W4A16,
  W8A16; llm-compressor's GPTQ/RTN output);
- ``float-quantized``: FP8 weights per channel or per tensor (``FP8_DYNAMIC``, ``FP8``);
- ``int-quantized``: int8 weights per channel (``W8A8``).
Activations a scheme quantizes dynamically (per token or per tensor) stay in the model dtype on
CPU, as transformers' CPU loading runs them; static activation scales are refused. A
``kv_cache_scheme`` of static per-tensor FP8 scales is accepted (``_kv_cache_scheme``).
"""

from __future__ import annotations

from typing import Any

from shoal.runtime.model.quant.spec import (
    Fp8ChannelScheme,
    IntWeightScheme,
    QuantizationError,
    QuantSpec,
    int_bits,
)

FORMATS = ("pack-quantized", "float-quantized", "int-quantized")


def _activations(name: str, fmt: str, acts: Any) -> None:
    if acts is None:
        return
    if fmt == "pack-quantized":
        raise QuantizationError(f"compressed-tensors: {name} quantizes activations in "
                                "pack-quantized; only weight-only schemes are supported there")
    if not acts.dynamic or str(acts.strategy) not in ("token", "tensor"):
        raise QuantizationError(f"compressed-tensors: {name}'s {acts.strategy} activations "
                                f"with dynamic={acts.dynamic} are not supported (only dynamic "
                                "per-token or per-tensor scales)")


def _kv_cache_scheme(kv: Any) -> None:
    """A calibrated FP8 KV cache (static per-tensor float8 scales, one K and one V per layer)
    is read by the loader (``model/kv_scales.py``) and used with ``--kv-cache-dtype fp8``;
    any other KV cache scheme is refused."""
    if kv is None:
        return
    if (str(kv.type) != "float" or kv.num_bits != 8 or str(kv.strategy) != "tensor"
            or kv.dynamic or not kv.symmetric):
        raise QuantizationError(
            f"compressed-tensors: kv_cache_scheme {kv.type} {kv.num_bits}-bit {kv.strategy} "
            f"(dynamic={kv.dynamic}, symmetric={kv.symmetric}) is not supported (only static "
            "per-tensor FP8 scales, served with --kv-cache-dtype fp8)")


def parse_compressed_tensors(qc: dict) -> QuantSpec:
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
    if fmt not in FORMATS:
        raise QuantizationError(f"compressed-tensors: format {fmt!r} is not supported "
                                f"(supported: {', '.join(FORMATS)})")
    _activations(name, fmt, group.input_activations)
    if group.output_activations is not None:
        raise QuantizationError(f"compressed-tensors: {name} quantizes output activations")
    _kv_cache_scheme(config.kv_cache_scheme)
    if [t for t in group.targets if t != "Linear"]:
        raise QuantizationError(f"compressed-tensors: targets {group.targets} are not "
                                "supported (only Linear)")
    w = group.weights
    if w is None:
        raise QuantizationError(f"compressed-tensors: {name} has no weights scheme")
    if w.dynamic:
        raise QuantizationError("compressed-tensors: dynamic weight scales are not supported")
    strategy = str(w.strategy)
    ignore = tuple(config.ignore or ())
    if fmt == "float-quantized":
        if str(w.type) != "float" or w.num_bits != 8 or strategy not in ("channel", "tensor"):
            raise QuantizationError(f"compressed-tensors: float-quantized {w.type} "
                                    f"{w.num_bits}-bit {strategy} weights are not supported "
                                    "(only FP8 per channel or per tensor)")
        return QuantSpec("compressed-tensors", Fp8ChannelScheme(strategy == "tensor"), ignore)
    if str(w.type) != "int":
        raise QuantizationError(f"compressed-tensors: {w.type} weights in {fmt}")
    if fmt == "int-quantized":
        if w.num_bits != 8 or strategy != "channel" or not w.symmetric:
            raise QuantizationError(f"compressed-tensors: int-quantized {w.num_bits}-bit "
                                    f"{strategy} weights are not supported (only symmetric "
                                    "int8 per channel)")
        return QuantSpec("compressed-tensors", IntWeightScheme(8, None, True, "int-quantized"),
                         ignore)
    bits = int_bits("compressed-tensors", w.num_bits, (4, 8))
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"compressed-tensors: strategy {strategy!r} is not supported "
                                "(supported: group, channel)")
    if w.actorder not in (None, "static") and str(w.actorder) not in ("static",):
        raise QuantizationError(f"compressed-tensors: actorder {w.actorder!r} is not "
                                "supported")
    size = w.group_size if strategy == "group" else None
    return QuantSpec("compressed-tensors",
                     IntWeightScheme(bits, size, bool(w.symmetric), "pack-quantized"), ignore)
