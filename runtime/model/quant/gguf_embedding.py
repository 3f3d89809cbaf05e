"""A GGUF file's token embedding and LM head kept in their blocks (``gguf_int``'s types), on CPU
where the linear layers are (``gguf_int``).

In a small model the vocabulary is a large share of the weights (SmolLM2-135M: 49152 x 576,
28M of its 135M, a Q8_0 table tied to the LM head). Dequantized it took float32 twice: the
embedding table and oneDNN's packed copy of it for the LM head. Kept, the table is the int
kernel's layout once: the embedding dequantizes the rows of the batch's token ids with the
kernel's own dequantization (so the same values the LM head multiplies), and the LM head
multiplies through the kernel. A table of any other type is dequantized as before.
"""

from __future__ import annotations

from typing import Any

import torch
from shoal.runtime.model.gguf_checkpoint import GGUFTensor
from shoal.runtime.model.linear import ParallelLMHead, VocabParallelEmbedding
from shoal.runtime.model.quant.gguf_int import gguf_packed
from shoal.runtime.model.quant.spec import QuantizationError
from torch import nn

from shoal.kernels.int_matmul_cpu import IntPacked, compact, dequantize, int_matmul


class GgufVocab:
    """The ``quant`` of an embedding (and of the LM head tied to it, or an untied head)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.staged: IntPacked | torch.Tensor | None = None
        self.bits = self.group = self.in_features = 0

    def stage(self, module: VocabParallelEmbedding) -> nn.Parameter:
        """A placeholder parameter whose loader keeps the file's tensor as stored."""
        rows, cols = module.weight.shape

        def load(_param: nn.Parameter, tensor: GGUFTensor, _shard: object) -> None:
            if tensor.shape != (rows, cols):
                raise QuantizationError(f"{tensor.gguf_name}: shape {tensor.shape}, the "
                                        f"vocabulary takes ({rows}, {cols})")
            self.staged = gguf_packed(tensor) or tensor.dequantize()

        param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=module.weight.device),
                             requires_grad=False)
        param.weight_loader = load  # type: ignore[attr-defined]
        param.takes_gguf = True  # type: ignore[attr-defined]
        return param

    def finalize(self, modules: list[VocabParallelEmbedding]) -> None:
        """``modules``: the embedding and the head sharing this table (one of them if
        untied)."""
        staged = self.staged
        assert staged is not None, "the vocabulary table was not loaded"
        self.staged = None
        if isinstance(staged, torch.Tensor):  # another type: dense, as before
            weight = nn.Parameter(staged.to(self.dtype), requires_grad=False)
            for module in modules:
                module.weight = weight
                module.quant = None
            return
        staged = compact(staged)
        self.bits, self.group, self.in_features = staged.bits, staged.group, staged.in_features
        # the layout's tensors are buffers of each module (one storage, counted once)
        meta = nn.Parameter(torch.empty(staged.out_features, staged.in_features,
                                        dtype=self.dtype, device="meta"), requires_grad=False)
        for module in modules:
            module.register_buffer("int_packed_codes", staged.codes)
            module.register_buffer("int_packed_scales", staged.scales)
            module.register_buffer("int_packed_offsets", staged.offsets)
            module.weight = meta  # the shape, for whoever reads it; no values

    def _packed(self, module: Any) -> IntPacked:
        return IntPacked(module.int_packed_codes, module.int_packed_scales,
                         module.int_packed_offsets, self.bits, self.group, self.in_features)

    def embed(self, module: VocabParallelEmbedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids``, dequantized to the model dtype."""
        w = self._packed(module)
        ids = input_ids.reshape(-1)
        rows = IntPacked(w.codes.index_select(0, ids), w.scales.index_select(0, ids),
                         w.offsets.index_select(0, ids), w.bits, w.group, w.in_features)
        return dequantize(rows).reshape(*input_ids.shape, w.in_features).to(self.dtype)

    def logits(self, module: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        return int_matmul(hidden, self._packed(module))


def stage_vocab(model: Any, dtype: torch.dtype) -> list[GgufVocab]:
    """Before loading: the embedding (and an untied LM head) of a ``DecoderForCausalLM`` take
    the file's blocks. One rank only (the caller's condition): the table is not split."""
    embed: VocabParallelEmbedding = model.model.embed_tokens
    head: ParallelLMHead = model.lm_head
    tied = head.weight is embed.weight
    made = []
    for module in [embed] if tied else [embed, head]:
        vocab = GgufVocab(dtype)
        module.weight = vocab.stage(module)
        module.quant = vocab
        made.append(vocab)
    if tied:
        head.weight, head.quant = embed.weight, embed.quant
    return made


def finalize_vocab(model: Any) -> None:
    embed: VocabParallelEmbedding = model.model.embed_tokens
    head: ParallelLMHead = model.lm_head
    if embed.quant is not None and embed.quant is head.quant:
        embed.quant.finalize([embed, head])
        return
    for module in (embed, head):
        if module.quant is not None:
            module.quant.finalize([module])
