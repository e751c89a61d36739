"""Repeated log lines rate-limited: one line per cause per interval, with a count.

Why: a client retrying with a wrong token thousands of times a second, or librdkafka
reporting every failed connect while the broker is down, must not bury the one line an
operator needs (and fill a disk). The first occurrence of a cause is logged at once;
more of the same cause within `interval_s` are only counted, and the next line logged
for that cause says how many were left out (`(and 2999 more like it in the last 10 s)`).
A cause that stops recurring leaves its last count unsaid; the first line already
named it.

    throttle_decision   the policy, pure: log now, or count?
    LogThrottle         the one component every throttled logger goes through
                        (service.py: refused calls; kafka/logs.py: librdkafka)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 10.0
"""At most one line per cause this often."""
MAX_CAUSES = 1024
"""Causes remembered at once; the oldest is forgotten beyond it (memory stays bounded
whatever a client sends)."""


@dataclass(frozen=True)
class Decision:
    """What to do with one occurrence of a cause."""

    log: bool
    """Log it now (else only count it)."""
    suppressed: int
    """Occurrences left out since the cause was last logged (said in this line)."""


def throttle_decision(
    last_logged_at: float | None, suppressed: int, now: float, interval_s: float
) -> Decision:
    """The policy: log a cause never seen, or last logged at least `interval_s` ago
    (saying how many were left out since); otherwise count it."""
    if last_logged_at is None or now - last_logged_at >= interval_s:
        return Decision(log=True, suppressed=suppressed)
    return Decision(log=False, suppressed=suppressed + 1)


class LogThrottle:
    """Logs through `logger` at most once per cause per `interval_s`; thread-safe
    (librdkafka calls back from its own threads)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[Hashable, tuple[float | None, int]] = {}
        """cause -> (when it was last logged, occurrences left out since)."""

    def log(self, level: int, cause: Hashable, msg: str, *args: object) -> bool:
        """Log `msg % args` at `level` unless `cause` was logged less than `interval_s`
        ago; True if it was logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            last, suppressed = self._seen.pop(cause, (None, 0))
            decision = throttle_decision(last, suppressed, now, self.interval_s)
            if decision.log:
                self._seen[cause] = (now, 0)
            else:
                self._seen[cause] = (last, decision.suppressed)
            while len(self._seen) > MAX_CAUSES:
                del self._seen[next(iter(self._seen))]  # the least recently seen
        if not decision.log:
            return False
        if decision.suppressed:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, decision.suppressed, now - last if last is not None else 0.0)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, cause: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, cause, msg, *args)
