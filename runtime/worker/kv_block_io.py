"""A rank's KV tensors as bytes, block by block: what a KV connector sends and receives.

Each layer has two tensors ``[num_blocks, block_size, heads, width]``: K and V, or for
latent attention the latent and the rotary key (widths differ); ``read_layer`` gathers the
given blocks of the first, then of the second, into one buffer (a copy, so the blocks may be
freed once it returns) and ``write_layer`` scatters such a buffer back.
Called from connector threads on blocks that no step touches (see ``kv_transfer/connector``).
"""

from __future__ import annotations

import torch
from shoal.runtime.kv_transfer.connector import KVLayout


class KVBlockIO:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not kv_caches:
            raise RuntimeError("the KV cache is not allocated yet")
        self.kv_caches = kv_caches
        k, v = kv_caches[0]
        self._k_shape, self._v_shape = tuple(k.shape[1:]), tuple(v.shape[1:])
        self._k_bytes = k[0].numel() * k.element_size()
        self._layout = KVLayout(len(kv_caches), self._k_shape, self._v_shape,
                                str(k.dtype).removeprefix("torch."),
                                self._k_bytes + v[0].numel() * v.element_size())

    def layout(self) -> KVLayout:
        return self._layout

    def read_layer(self, layer: int, block_ids: list[int]) -> bytes:
        k, v = self.kv_caches[layer]
        index = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        return _to_bytes(k.index_select(0, index)) + _to_bytes(v.index_select(0, index))

    def write_layer(self, layer: int, block_ids: list[int], data: bytearray) -> None:
        k, v = self.kv_caches[layer]
        count = len(block_ids)
        flat = torch.frombuffer(data, dtype=torch.uint8)  # no copy: the buffer is ours
        split = count * self._k_bytes
        index = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        k.index_copy_(0, index, flat[:split].view(k.dtype).view(count, *self._k_shape)
                      .to(k.device))
        v.index_copy_(0, index, flat[split:].view(v.dtype).view(count, *self._v_shape)
                      .to(v.device))


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()
