"""How much prompt each replica has been sent lately: an exponentially decayed count of
the prompt blocks routed to it.

Cache affinity places a new prefix on the replica with the least demand, so the prefixes
(and their followers' traffic) spread by what they cost each cache, not by who happened to
be idle at the instant the first request came: in-flight counts at moderate concurrency
are 0-3 per replica, mostly chance, and placing 24 system prompts on 6 replicas by them
left one engine with 25% of the prompt tokens and another with 7% (bench/routing.py); the
crowded engines evicted their prompts while the others had room.

The half-life is the memory of the count: long against the gaps between one prefix's
requests (seconds), short against how long a traffic mix lasts, so a prefix nobody sends
any more stops counting within a minute or two.
"""

from __future__ import annotations

import math

DEFAULT_HALF_LIFE_S = 30.0


class DecayedDemand:
    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half-life must be > 0, got {half_life_s}")
        self._rate = math.log(2) / half_life_s
        self._level: dict[str, tuple[float, float]] = {}  # url -> (value, as of when)

    def value(self, url: str, now: float) -> float:
        level, since = self._level.get(url, (0.0, now))
        return level * math.exp(-self._rate * max(now - since, 0.0))

    def add(self, url: str, amount: float, now: float) -> None:
        self._level[url] = (self.value(url, now) + amount, now)

    def forget(self, url: str) -> None:
        self._level.pop(url, None)
