"""A rank's KV tensors as bytes, block by block: what a KV connector sends and receives.

Each layer has a K and a V tensor of shape ``[num_blocks, block_size, kv_heads, head_dim]``;
``read_layer`` gathers the given blocks of K, then of V, into one contiguous buffer (a copy,
so the blocks may be freed once it returns) and ``write_layer`` scatters such a buffer back.
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
        k = kv_caches[0][0]
        self._block_shape = tuple(k.shape[1:])
        self._layout = KVLayout(len(kv_caches), self._block_shape, str(k.dtype).removeprefix(
            "torch."), k[0].numel() * k.element_size())

    def layout(self) -> KVLayout:
        return self._layout

    def read_layer(self, layer: int, block_ids: list[int]) -> bytes:
        k, v = self.kv_caches[layer]
        index = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        both = torch.stack((k.index_select(0, index), v.index_select(0, index)))
        return _to_bytes(both.cpu())

    def write_layer(self, layer: int, block_ids: list[int], data: bytearray) -> None:
        k, v = self.kv_caches[layer]
        count = len(block_ids)
        flat = torch.frombuffer(data, dtype=torch.uint8)  # no copy: the buffer is ours
        both = flat.view(k.dtype).view(2, count, *self._block_shape).to(k.device)
        index = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        k.index_copy_(0, index, both[0])
        v.index_copy_(0, index, both[1])


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
