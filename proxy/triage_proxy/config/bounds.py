"""The bounds of the numeric settings: each numeric field of a section carries its
`Bounds` (declared with `bounded` or `duration`), and `check_number` is the one check of a
value against them: its type (a TOML `true` is not a number), finiteness and a range
whose upper bound is what the field feeds can hold (a uint32 on the wire, a C int in
gRPC, ...). The constants name those bounds."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from triage_protocol.constants import UINT32_MAX
from triage_proxy.errors import ConfigError

_T = TypeVar("_T")

# Bounds of the numeric settings (see `Bounds`): the upper ones are what the field a
# setting feeds can hold, or where a larger value can only be a typo.
MAX_FETCH_WAIT_MS = 300_000
MAX_DLQ_BATCH = 25
"""DynamoDB's BatchWriteItem takes at most 25 items."""
INT32_MAX = 2**31 - 1
"""Largest C int: gRPC's message size options are ints."""
MAX_PORT = 65535
MIN_DURATION_S = 0.001
"""Shortest wait, period or deadline in seconds: below a millisecond a loop only spins,
and the ack deadline travels in whole milliseconds."""
MAX_DURATION_S = UINT32_MAX / 1000
"""Longest duration in seconds: what a uint32 of milliseconds holds (about 49.7 days),
the unit of the ack deadline on the wire; any duration beyond it is a typo."""
MAX_DURATION_MS = UINT32_MAX
MAX_FETCH_BATCH = 1_000_000
"""confluent-kafka's Consumer.consume() takes at most 1,000,000 messages per call."""
MIN_FRAME_BYTES = 128 * 1024
"""The dispatcher keeps 64 KiB of a frame for framing (dispatcher.FRAME_OVERHEAD_BYTES): a
frame not above that would dead-letter every message as too large, a false reason. This
floor leaves a record at least 64 KiB; a larger one is dead-lettered, truly too large."""
MAX_FRAME_BYTES = INT32_MAX
MAX_WINDOW_MESSAGES = 10_000_000
"""Every unsettled message is held in memory; more than this is not a window but a typo."""
MAX_WINDOW_BYTES = 2**40
MAX_RETRY_MULTIPLIER = 1000.0
MAX_RATE_PER_S = 1e12
NO_CAP = "beyond any machine; for no cap leave the key out"
MAX_TTL_DAYS = 36_500
MAX_PARTITIONS = MAX_PORT
"""Each partition's proxy listens on its own port (server.port + p)."""
FARGATE_CPU = (256, 16_384)
FARGATE_MEMORY_MB = (512, 122_880)
MAX_LOG_RETENTION_DAYS = 3653
"""CloudWatch Logs' longest retention (10 years)."""
MAX_AWS_PROXIES = 5000
"""ECS's quota of tasks per service."""


@dataclass(frozen=True)
class Bounds:
    """The range a numeric setting must lie in; NaN and infinities never do."""

    lo: float
    hi: float
    above: bool = False
    """True: `lo` itself is refused (the value must be > lo)."""
    why: str = ""
    """Where `hi` comes from, shown in the error."""

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and (
            (value > self.lo if self.above else value >= self.lo) and value <= self.hi
        )

    def describe(self, kind: type) -> str:
        """The range in words, e.g. "1..4294967295 (Welcome.max_attempts is a uint32)"."""
        if kind is int and not self.above:
            text = f"{_fmt(self.lo)}..{_fmt(self.hi)}"
        else:
            text = f"{'>' if self.above else '>='} {_fmt(self.lo)} and <= {_fmt(self.hi)}"
        return f"{text} ({self.why})" if self.why else text


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def bounded(default: _T, lo: float, hi: float, *, above: bool = False, why: str = "") -> _T:
    """A dataclass field whose value must lie in [lo, hi] (or (lo, hi] with `above`)."""
    return field(default=default, metadata={"bounds": Bounds(lo, hi, above, why)})


def duration(
    default: _T, lo: float = MIN_DURATION_S, why: str = "about 49.7 days, a uint32 of milliseconds"
) -> _T:
    """A duration in seconds: at least a millisecond (or `lo`), at most MAX_DURATION_S."""
    return bounded(default, lo, MAX_DURATION_S, why=why)


def numeric_kind(hint: Any) -> type | None:
    """int or float for `int`, `float` and their `| None` forms; None for anything else."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    return hint if hint in (int, float) else None


def check_number(key: str, value: object, kind: type, bounds: Bounds) -> None:
    """The one numeric check: right type (a bool is no number), finite, within bounds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and isinstance(value, float))
    ):
        raise ConfigError(key, f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    if not bounds.holds(value):
        raise ConfigError(key, f"must be {bounds.describe(kind)}, got {value}")
