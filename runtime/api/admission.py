"""The bounded waiting queue: how many engine requests would wait, and when to come back.

The engine runs at most ``max_num_seqs`` requests at once, and no more than its KV cache
holds. A request's KV grows from its prompt to prompt + generated tokens, so with long
requests the KV cache, not ``max_num_seqs``, bounds the batch: the engine admits them while
their prompts fit and then preempts (recomputes) the newest as they grow, which is waiting
too, only costlier. The estimate sizes the batch by the mean footprint of everything in
flight and counts the rest as queued. A request's footprint is what it holds on average
over its life if it uses its whole budget: the prompt plus half of max_tokens (or of the
room left to max_model_len when max_tokens is unset). Prefix-cache hits are ignored.

Retry-After: the requests beyond the limit leave the queue as running ones finish, so the
wait is that excess over the recent completion rate, clamped to [1, 60] s; 1 s while no
completion has been seen yet.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
RATE_WINDOW_S = 30.0
MIN_RATE_SPAN_S = 1.0  # a burst of completions within a moment is not an infinite rate


def kv_blocks_estimate(prompt_len: int, max_tokens: int | None, max_model_len: int,
                       block_size: int) -> int:
    """Blocks one engine request holds on average over its life (see the module doc)."""
    room = max(0, max_model_len - prompt_len)
    budget = room if max_tokens is None else min(max_tokens, room)
    tokens = prompt_len + budget // 2
    return max(1, -(-tokens // block_size))


def batch_capacity(num_requests: int, total_blocks: int, max_num_seqs: int,
                   num_kv_blocks: int) -> int:
    """How many of these requests run at once: max_num_seqs, or fewer when their mean
    footprint means the KV cache holds fewer (0 KV blocks: unknown, not limiting)."""
    if num_requests == 0 or total_blocks == 0 or num_kv_blocks <= 0:
        return max_num_seqs
    by_kv = int(num_kv_blocks * num_requests // total_blocks)
    return max(1, min(max_num_seqs, by_kv))


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    queued_after: int  # engine requests that would wait beyond the batch, this one included
    batch: int  # the batch size the estimate used
    retry_after_s: int  # meaningful when not admitted


def decide(in_flight: int, in_flight_blocks: int, new: int, new_blocks: int,
           max_num_seqs: int, num_kv_blocks: int, max_queued: int,
           completions_per_s: float | None) -> AdmissionDecision:
    """Pure: admit ``new`` engine requests needing ``new_blocks`` KV blocks, or not."""
    total, blocks = in_flight + new, in_flight_blocks + new_blocks
    batch = batch_capacity(total, blocks, max_num_seqs, num_kv_blocks)
    queued_after = max(0, total - batch)
    excess = queued_after - max_queued
    if excess <= 0:
        return AdmissionDecision(True, queued_after, batch, 0)
    return AdmissionDecision(False, queued_after, batch, retry_after(excess, completions_per_s))


def retry_after(excess: int, completions_per_s: float | None) -> int:
    if not completions_per_s:
        return DEFAULT_RETRY_AFTER_S
    seconds = math.ceil(excess / completions_per_s)
    return max(DEFAULT_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, seconds))


class CompletionRate:
    """Engine requests leaving the server per second, over the last ``window_s``."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._count = 0

    def record(self, count: int, now: float) -> None:
        self._events.append((now, count))
        self._count += count

    def per_second(self, now: float) -> float | None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._count -= self._events.popleft()[1]
        if not self._events:
            return None
        return self._count / max(now - self._events[0][0], MIN_RATE_SPAN_S)
