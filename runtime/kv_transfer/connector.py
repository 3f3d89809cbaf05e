"""The KV connector interface: how an engine core hands KV blocks to another engine.

Pull-based, as vLLM's NIXL connector: the prefill engine (producer) ``offer``s a finished
prompt's full blocks and keeps them held until the decode engine (consumer) has pulled them
or ``abort_request_timeout`` passes; the decode engine ``pull``s into blocks it allocated and
holds. Both sides learn what finished through ``poll``, called from the engine-core loop,
which alone changes the block pool: the connector's threads touch only KV tensor memory of
blocks held for them (no step reads or writes a held block: a step writes the slots of its
own rows and reads its rows' tables, and an offered block is full, so read-only).

Blocks are named by index in the prompt and by their chained hash: a pull asks for the
blocks from ``first`` on with the hashes it computed itself, and the producer refuses a
mismatch, so KV moves only between requests with the same tokens, model revision, adapter and
cache salt. The decode side leaves out the leading blocks its own prefix cache holds.

One implementation, ``TcpConnector`` (``tcp_connector.py``): plain sockets, one layer at a
time. An RDMA/NIXL connector would implement the same five calls on GPU clusters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class KVLayout:
    """What a block is on this engine; a pull between different layouts is refused."""

    num_layers: int
    k_shape: tuple[int, ...]  # one block of the first tensor: (block_size, heads, width)
    v_shape: tuple[int, ...]  # ... of the second (V; for latent attention the rotary key)
    dtype: str
    block_bytes: int  # one block of one layer, both tensors

    def as_list(self) -> list:
        return [self.num_layers, list(self.k_shape), list(self.v_shape), self.dtype,
                self.block_bytes]

    @classmethod
    def from_list(cls, raw: list) -> KVLayout:
        return cls(int(raw[0]), tuple(int(d) for d in raw[1]), tuple(int(d) for d in raw[2]),
                   str(raw[3]), int(raw[4]))


class KVBlockIO(Protocol):
    """The worker's KV tensors, one layer at a time (``runtime/worker/kv_block_io.py``)."""

    def layout(self) -> KVLayout: ...

    def read_layer(self, layer: int, block_ids: list[int]) -> bytes:
        """K of the blocks, then V, each in block order."""

    def write_layer(self, layer: int, block_ids: list[int], data: bytearray) -> None:
        """The inverse of ``read_layer`` (a writable buffer, read without a copy)."""


@dataclass(frozen=True)
class PullJob:
    request_id: str  # this engine's request
    remote_request_id: str
    host: str
    port: int
    first: int  # index of the first block wanted, in the prompt
    block_hashes: list[int]  # the wanted blocks' hashes, as this engine computes them
    block_ids: list[int]  # where they go here (held for the pull)
    deadline: float  # time.monotonic(): past it the pull fails


@dataclass(frozen=True)
class PullResult:
    request_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class TransferCounters:
    """Cumulative, for /metrics (vLLM's NIXL metrics, as counters)."""

    bytes_received: int = 0
    bytes_sent: int = 0
    pulls: int = 0  # finished pulls, ok or not
    pulls_failed: int = 0
    pull_seconds: float = 0.0  # summed over successful pulls
    offers_sent: int = 0
    offers_expired: int = 0  # never pulled within abort_request_timeout
    blocks_received: int = 0
    blocks_skipped: int = 0  # already in the decode side's prefix cache: not sent again


class KVConnector(ABC):
    engine_id: str
    host: str
    port: int  # where producers serve pulls (0 before ``start``)
    counters: TransferCounters

    @abstractmethod
    def start(self, block_io: KVBlockIO) -> None: ...

    @abstractmethod
    def offer(self, request_id: str, block_ids: list[int], block_hashes: list[int],
              timeout_s: float) -> None:
        """Producer: these blocks (held by the caller) wait for a pull until ``timeout_s``."""

    @abstractmethod
    def pull(self, job: PullJob) -> None:
        """Consumer: fetch in the background; the result comes from ``poll``."""

    @abstractmethod
    def poll(self) -> tuple[list[PullResult], list[str]]:
        """Finished pulls, and offers the caller may release now (pulled, or expired)."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for something ``poll`` would return (idle engines)."""

    @abstractmethod
    def shutdown(self) -> None: ...
