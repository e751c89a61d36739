"""Retry policy as pure functions: how long to back off, and when to give up.

Why: the dispatcher decides what happens to a failed delivery (nacked with retry,
lease expired, instance vanished). Keeping the arithmetic here, free of I/O and
clocks, lets it be tested exhaustively and with hypothesis, and keeps the
dispatcher to bookkeeping.
"""

from __future__ import annotations

import enum
import math

from triage_proxy.settings import RetrySettings

__all__ = ["Outcome", "after_failure", "retry_delay"]


class Outcome(enum.Enum):
    """What to do with a message whose latest delivery failed."""

    REDELIVER = "redeliver"
    """Hand it out again (after the retry delay when it was nacked with retry)."""
    DEAD_LETTER = "dead_letter"
    """Write it to the dead-letter table; it will not be delivered again."""


def retry_delay(attempt: int, settings: RetrySettings) -> float:
    """Seconds to wait before redelivering a message whose ``attempt``-th delivery was nacked.

    ``initial_backoff_s * multiplier ** (attempt - 1)``, capped at ``max_backoff_s`` (up to
    float rounding). The exponent is bounded before exponentiating, so any ``attempt`` is
    safe. Settings are validated by `Settings`; nonsense (NaN, inf, zero) raises ValueError.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    initial = settings.initial_backoff_s
    cap = settings.max_backoff_s
    multiplier = settings.multiplier
    if not (0 < initial < math.inf and 0 < cap < math.inf):
        raise ValueError(f"backoffs must be finite and > 0, got {initial} and {cap}")
    if not 1 <= multiplier < math.inf:
        raise ValueError(f"multiplier must be finite and >= 1, got {multiplier}")
    if initial >= cap:
        return cap
    if multiplier == 1:
        return initial
    # Growth steps after which the cap surely applies. Both logs are finite, so this is a
    # finite float; the +1 absorbs log rounding (the min() below handles the rest).
    capped_from = math.ceil((math.log(cap) - math.log(initial)) / math.log(multiplier)) + 1
    steps = attempt - 1
    if steps >= capped_from:
        return cap
    try:
        grown = initial * multiplier**steps
    except OverflowError:
        # Only when cap / initial is itself beyond float range; the logs still work.
        grown = math.exp(math.log(initial) + steps * math.log(multiplier))
    return min(cap, grown)


def after_failure(attempt: int, max_attempts: int) -> Outcome:
    """Fate of a message delivered ``attempt`` times whose last delivery failed."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    return Outcome.DEAD_LETTER if attempt >= max_attempts else Outcome.REDELIVER
