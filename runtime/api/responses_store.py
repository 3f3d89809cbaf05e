"""Conversations of recent responses, for ``previous_response_id``: in memory, bounded
(least recently used out first), per API process."""

from __future__ import annotations

from collections import OrderedDict

from .protocol import ChatMessageIn

DEFAULT_CAPACITY = 1024


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[ChatMessageIn]] = OrderedDict()

    def put(self, response_id: str, messages: list[ChatMessageIn]) -> None:
        self._items[response_id] = list(messages)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[ChatMessageIn] | None:
        messages = self._items.get(response_id)
        if messages is not None:
            self._items.move_to_end(response_id)
        return messages

    def __len__(self) -> int:
        return len(self._items)
