"""Waiting queues: FCFS (preempted requests go back to the front) or priority, where the
key is (priority, arrival) and lower runs first."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from shoal.runtime.scheduler.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._queue.append(req)

    def push_preempted(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority_key(), req))

    # a preempted request keeps its original key, so it sorts ahead of later arrivals
    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap, key=lambda e: e[0]))


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
