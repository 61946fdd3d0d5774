"""StateLog: rate-limited lines about the relationship with the daemon (one WARNING per kind
of change at most every STATE_LOG_INTERVAL_S, the suppressed changes counted in the next)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

#: One WARNING per kind of state change at most this often; the changes in between are
#: counted and the count is given in the kind's next line.
STATE_LOG_INTERVAL_S = 10.0


class StateLog:
    """Rate-limited lines about the daemon relationship: `change(kind, msg, *args)` logs at
    `level` unless a line of that kind went out less than `interval_s` ago; a suppressed
    change is logged at DEBUG and counted into the next line of its kind."""

    def __init__(self, logger: logging.Logger, *, interval_s: float = STATE_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def change(self, kind: str, msg: str, *args, level: int = logging.WARNING) -> bool:
        """Log one change of `kind`; False when it was suppressed (rate limit)."""
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                suppressed = None
            else:
                self._last[kind] = now
                suppressed = self._suppressed.pop(kind, 0)
        if suppressed is None:
            self.log.debug("(suppressed, %s) " + msg, kind, *args)
            return False
        if suppressed:
            msg += " (%d earlier %s change%s not logged: at most one line per %g s)"
            args = (*args, suppressed, kind, "" if suppressed == 1 else "s", self.interval_s)
        self.log.log(level, msg, *args)
        return True
