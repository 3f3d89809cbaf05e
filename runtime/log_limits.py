"""A log that requests cannot amplify: per cause, a few records per window, then a count.

A client that sends the same failing request a million times must not write a million
tracebacks, and 20k bad connections must make a handful of lines, not 20k. Each cause (an
exception type and where it was raised, a rejected parameter; as a logging filter, the
logger and the message template) gets ``burst`` records per ``window_s``; what is suppressed
is counted and reported with the cause's next record. At most ``max_causes`` causes are
tracked (the oldest is forgotten), so the table itself is bounded whatever the causes are.

One class, used two ways: ``log(level, cause, ...)`` by code that logs a cause it names, and
as a ``logging.Filter`` on the root handlers (``http_listener.install_log_limits``), where
uvicorn's own lines pass too.
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


class RateLimitedLog(logging.Filter):
    def __init__(self, logger: logging.Logger | None = None, burst: int = 5,
                 window_s: float = 60.0, max_causes: int = 256) -> None:
        super().__init__()
        self.logger = logger if logger is not None else logging.getLogger(__name__)
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

    def filter(self, record: logging.LogRecord) -> bool:
        """As a handler's filter: the cause is the logger and the message template."""
        ok, suppressed = self.allow(f"{record.name}\x1f{record.msg}")
        if ok and suppressed:
            record.msg = f"{record.msg} [{suppressed} similar lines dropped]"
        return ok
