"""Conversations of recent responses, for ``previous_response_id``: in memory, per API
process, owned by the tenant that made them, immutable, bounded and expiring.

* Immutable: a conversation is stored as JSON bytes and decoded into fresh objects on every
  read, so nothing a follow-up does (appending its function calls, being rejected halfway)
  can change what is stored; a follow-up stores a new conversation under its own id.
* Scoped: each entry keeps the tenant identity that created it (``auth.Authenticator``:
  the API key's tenant, or the router's trusted tenant header); another tenant's lookup
  finds nothing, exactly as for an id that never existed (no existence oracle).
* Bounded: one conversation at most ``max_conversation_bytes`` (a longer one is refused
  before any work, naming ``previous_response_id``), all together at most ``max_bytes``
  (the oldest go first), each for ``ttl_s`` after it was stored.
* Placed: ids carry this process's random ``instance`` tag (``resp_<instance>_<hex>``), which
  ``/ready`` also reports, so a router can send a follow-up to the replica that stores its
  conversation, and say clearly that it is gone when no replica has that tag any more.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from shoal.contract.response_ids import new_instance, response_id

from .protocol import ChatMessageIn

DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_MAX_CONVERSATION_BYTES = 8 << 20
DEFAULT_TTL_S = 3600.0


class ConversationTooLarge(ValueError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the conversation would be {size} bytes; a stored conversation "
                         f"holds at most {limit}: start a new one without "
                         "previous_response_id")


def encode_conversation(messages: list[ChatMessageIn]) -> bytes:
    return msgspec.json.encode([m.model_dump(mode="json", exclude_none=True)
                                for m in messages])


def decode_conversation(raw: bytes) -> list[ChatMessageIn]:
    return [ChatMessageIn.model_validate(m) for m in msgspec.json.decode(raw)]


@dataclass(frozen=True)
class StoredConversation:
    tenant: str | None
    conversation: bytes  # JSON: never handed out, only decoded copies of it
    expires_at: float


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_conversation_bytes: int = DEFAULT_MAX_CONVERSATION_BYTES,
                 ttl_s: float = DEFAULT_TTL_S, instance: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1 or max_conversation_bytes < 1 or ttl_s <= 0:
            raise ValueError("response store bounds must be positive")
        self.max_bytes = max_bytes
        self.max_conversation_bytes = max_conversation_bytes
        self.ttl_s = ttl_s
        self.instance = instance or new_instance()
        self.clock = clock
        self.bytes = 0
        # in insertion order: with one TTL for all, the oldest expire first
        self._items: OrderedDict[str, StoredConversation] = OrderedDict()

    def new_id(self) -> str:
        return response_id(self.instance)

    def check_size(self, size: int) -> None:
        if size > self.max_conversation_bytes:
            raise ConversationTooLarge(size, self.max_conversation_bytes)

    def put(self, response_id: str, tenant: str | None, messages: list[ChatMessageIn]) -> bool:
        """Store a copy; False when it is over the per-conversation bound (not stored)."""
        raw = encode_conversation(messages)
        if len(raw) > self.max_conversation_bytes:
            return False
        self._drop(response_id)
        self._items[response_id] = StoredConversation(tenant, raw,
                                                      self.clock() + self.ttl_s)
        self.bytes += len(raw)
        self._evict()
        return True

    def get(self, response_id: str, tenant: str | None) -> list[ChatMessageIn] | None:
        """A fresh copy of the conversation, for its own tenant only; None otherwise."""
        self._evict()
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        return decode_conversation(entry.conversation)

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= len(entry.conversation)

    def _evict(self) -> None:
        now = self.clock()
        while self._items:
            oldest_id, oldest = next(iter(self._items.items()))
            if oldest.expires_at > now and self.bytes <= self.max_bytes:
                return
            self._drop(oldest_id)

    def __len__(self) -> int:
        self._evict()
        return len(self._items)
