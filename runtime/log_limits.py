"""A log that requests cannot amplify: per cause, a few records per window, then a count.

A client that sends the same failing request a million times must not write a million
tracebacks. Each cause (an exception type and where it was raised, a rejected parameter)
gets ``burst`` records per ``window_s``; what is suppressed is counted and reported with the
cause's next record. At most ``max_causes`` causes are tracked (the oldest is forgotten), so
the table itself is bounded whatever the causes are.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _CauseWindow:
    started: float
    logged: int = 0
    suppressed: int = 0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, burst: int = 5, window_s: float = 60.0,
                 max_causes: int = 256) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self.max_causes = max_causes
        self._causes: OrderedDict[str, _CauseWindow] = OrderedDict()

    def allow(self, cause: str, now: float | None = None) -> tuple[bool, int]:
        """(log this one?, how many of this cause were suppressed before it)."""
        now = time.monotonic() if now is None else now
        window = self._causes.get(cause)
        if window is None or now - window.started >= self.window_s:
            suppressed = window.suppressed if window is not None else 0
            window = _CauseWindow(now)
            self._causes[cause] = window
            self._causes.move_to_end(cause)
            while len(self._causes) > self.max_causes:
                self._causes.popitem(last=False)
        else:
            suppressed = 0
        if window.logged >= self.burst:
            window.suppressed += 1
            return False, 0
        window.logged += 1
        return True, suppressed

    def log(self, level: int, cause: str, message: str, *args: object,
            exc_info: BaseException | None = None) -> bool:
        ok, suppressed = self.allow(cause)
        if not ok:
            return False
        if suppressed:
            message += f" ({suppressed} more like this suppressed)"
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True
