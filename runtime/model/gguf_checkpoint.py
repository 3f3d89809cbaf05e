"""A GGUF file as a checkpoint: its config (as an HF ``config.json`` dict) and its tensors
under HF names, read by ``GGUFFile`` (the ``gguf`` package gives the types and dequantization).

Tensors stay in the file (memory-mapped) as their quantized blocks (``GGUFTensor.blocks``,
``ggml_type``) until something asks for values: ``GGUFTensor.dequantize()`` turns one into a
float32 torch tensor in HF's layout, undoing llama.cpp's q/k row permutation for the
architectures whose converter applies it. The loader copies each into its parameter (casting to
the serving dtype) one at a time, so loading never holds a second full copy; on CPU the linear
layers' Q4_0/Q4_1/Q8_0 blocks are not dequantized but kept for the native int kernel
(``quant/gguf_int.py``).

Metadata keys and tensor names follow llama.cpp (``gguf.constants``); the mapping to HF names
and config keys matches transformers' own GGUF loading, the reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp's convert_hf_to_gguf interleaves q/k rows for rotary only on these
_PERMUTED_QK = {"llama"}

# stored as values, or as blocks the gguf package dequantizes (Q8_1/Q8_K are llama.cpp's
# activation formats, never weights; integer tensors are not weights either)
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
    "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# tensors HF's model does not have (llama 3's precomputed rope frequencies: HF computes them)
_IGNORED = frozenset({"rope_freqs.weight"})


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for one HF does not have. Raises for a
    tensor this loader does not know (it would otherwise be silently dropped)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the HF model")


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows were reordered from HF's
    [first half | second half] rotary layout to interleaved pairs."""
    rows = weight.shape[0]
    interleaved = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the file stores it, plus what it takes to make HF's tensor of it."""

    gguf_name: str
    hf_name: str
    ggml_type: str  # "Q4_1", "F32", ... (gguf.GGMLQuantizationType names)
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a weight
    blocks: np.ndarray  # the raw bytes (uint8 rows of blocks) or values, memory-mapped
    unpermute_heads: int | None = None  # llama q/k: heads to undo the row permutation over

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks, GGMLQuantizationType[self.ggml_type])
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the map is read-only
        tensor = tensor.reshape(self.shape)
        if self.unpermute_heads is not None:
            tensor = unpermute_rows(tensor, self.unpermute_heads)
        return tensor


@dataclass(frozen=True)
class StoredTensor:
    """One entry of the file's tensor table, its data a view into the memory map."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # as the file lists them: innermost first
    data: np.ndarray  # uint8 rows of blocks for block types, else the values


# metadata value types (GGUF spec): fixed-size scalars, string (8), array (9)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_VALUE_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFFile:
    """A little-endian GGUF file (v2, v3): its metadata decoded, its tensor table with views
    into the memory map. The gguf package's ``GGUFReader`` builds the same, but walks every
    element of every metadata array through numpy memmap slices: 4.6 CPU-s for the default
    model's file (49k tokens, 48k merges, 49k token types), against a tenth of a second
    here; tensor views as it makes them (``quant_shape_to_byte_shape`` for block types)."""

    def __init__(self, path: str | Path) -> None:
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
        from gguf.quants import quant_shape_to_byte_shape

        self.data = np.memmap(path, mode="r")
        buf = self.data.data  # a memoryview of the map
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            length = take("<Q")
            pos += length
            return str(buf[pos - length:pos], encoding="utf-8")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind in _SCALAR_FORMATS:
                return take(_SCALAR_FORMATS[kind])
            if kind == _STRING:
                return string()
            if kind != _ARRAY:
                raise ValueError(f"{path}: unknown GGUF metadata type {kind}")
            item, count = take("<I"), take("<Q")
            if item in _ARRAY_DTYPES:
                values = np.frombuffer(buf, _ARRAY_DTYPES[item], count, pos)
                pos += values.nbytes
                return values.tolist()
            return [value(item) for _ in range(count)]

        if take("<I") != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic)")
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (a big-endian file, or one this "
                             "reader does not know); supported: little-endian v2 and v3")
        tensor_count, kv_count = take("<Q"), take("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = string()
            if key in self.fields:
                raise ValueError(f"{path}: metadata key {key!r} appears twice")
            self.fields[key] = value(take("<I"))
        table = []
        for _ in range(tensor_count):
            name = string()
            dims = struct.unpack_from(f"<{take('<I')}Q", buf, pos)
            pos += 8 * len(dims)
            table.append((name, dims, take("<I"), take("<Q")))
        alignment = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        start = -(-pos // alignment) * alignment
        self.tensors: list[StoredTensor] = []
        names = set()
        for name, dims, raw_type, offset in table:
            if name in names:
                raise ValueError(f"{path}: tensor {name!r} appears twice")
            names.add(name)
            qtype = GGMLQuantizationType(raw_type)
            elements = int(np.prod(dims))
            shape = tuple(reversed(dims))
            dtype = _VALUE_DTYPES.get(qtype.name)
            if dtype is None:  # blocks: uint8 rows
                block_size, type_size = GGML_QUANT_SIZES[qtype]
                dtype, count = np.uint8, elements * type_size // block_size
                shape = quant_shape_to_byte_shape(shape, qtype)
            else:
                count = elements
            begin = start + offset
            view = self.data[begin:begin + np.dtype(dtype).itemsize * count].view(dtype)
            self.tensors.append(StoredTensor(name, qtype, dims, view[:count].reshape(shape)))


class GGUFCheckpoint:
    """A GGUF file opened once; fields and tensors read lazily from the memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFFile(self.path)
        self.gguf_architecture = str(self.field("general.architecture"))
        if self.gguf_architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: unsupported GGUF architecture "
                             f"{self.gguf_architecture!r}; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")
        for tensor in self.reader.tensors:
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path.name}: tensor {tensor.name} has unsupported GGUF "
                                 f"tensor type {tensor.tensor_type.name}; supported: "
                                 f"{', '.join(sorted(SUPPORTED_TYPES))}")

    def field(self, key: str, default: Any = None) -> Any:
        return self.reader.fields.get(key, default)

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.gguf_architecture}.{key}", default)

    def hf_config(self) -> dict:
        """The checkpoint's shape as HF's ``config.json`` would say it (what transformers'
        GGUF loading builds), for ``ModelConfig``'s parser."""
        architecture, model_type = ARCHITECTURES[self.gguf_architecture]
        num_heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        names = {t.name for t in self.reader.tensors}
        vocab = self._arch("vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        head_dim = self._arch("attention.key_length") or (
            self._arch("rope.dimension_count") if model_type == "llama" else None)
        config: dict = {
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", num_heads)),
            "head_dim": int(head_dim) if head_dim else hidden // num_heads,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self._arch("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            # dequantized values are float32: what transformers' GGUF loading gives
            "torch_dtype": "float32",
        }
        for key in ("bos_token_id", "eos_token_id"):
            value = self.field(f"tokenizer.ggml.{key}")
            if value is not None:
                config[key] = int(value)
        return config

    def tensors(self) -> list[GGUFTensor]:
        """Every tensor HF's model has, under its HF name, still in its stored form."""
        config = self.hf_config()
        permute = self.gguf_architecture in _PERMUTED_QK
        out = []
        for tensor in self.reader.tensors:
            hf_name = hf_tensor_name(tensor.name)
            if hf_name is None:
                continue
            heads = None
            if permute and ".self_attn.q_proj." in hf_name:
                heads = config["num_attention_heads"]
            elif permute and ".self_attn.k_proj." in hf_name:
                heads = config["num_key_value_heads"]
            # GGUF lists dimensions innermost first; torch order is the reverse
            shape = tuple(int(d) for d in reversed(tensor.dims))
            out.append(GGUFTensor(tensor.name, hf_name, tensor.tensor_type.name, shape,
                                  tensor.data, heads))
        return out


@cache
def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """One reader per file and process: the config and the weights both need it."""
    return GGUFCheckpoint(path)
