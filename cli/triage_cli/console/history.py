"""The last hour as the console saw it: one sample per gather, rates and rebalances.

`History.add(report, at)` takes a `triage status` report (its JSON form) read at wall
time `at` and keeps, for the plots: each partition's lag, the total lag, acks, nacks and
dead letters per second (from the proxies' running counters: the difference to the
previous sample of the same process, so a restarted proxy's counters starting from 0
cost one sample, never a negative rate) and the dead letters pending in the table. It
also notes a rebalance whenever the process serving a partition changes.

Pure: no I/O and no clock (the caller passes `at`); memory is bounded by `window_s`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 3600.0
"""How far back the plots and the rebalance list go."""
RATES = ("acked", "nacked", "dead_lettered")
"""The proxies' counters the plots show per second."""


@dataclass(frozen=True)
class Sample:
    """The fleet at one moment, reduced to what the plots show."""

    at: float
    """Wall time (epoch seconds)."""
    lag: Mapping[int, int | None]
    """Lag per partition (None: unknown)."""
    rates: Mapping[str, float | None]
    """Per second since the previous sample, summed over partitions (`RATES`)."""
    pending: int | None
    """Dead letters pending in the table (None: not read)."""
    partition_rates: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    """Per partition, per second since the previous sample (`RATES`)."""


@dataclass(frozen=True)
class Rebalance:
    """A partition that moved from one process to another (or to none)."""

    at: float
    """Wall time it was first seen (epoch seconds)."""
    partition: int
    before: str | None
    """The process that served it (owner id, or pid), None when none did."""
    after: str | None
    """The process that serves it now, None when none does."""


def _server(row: Mapping[str, Any]) -> str | None:
    served = row.get("served_by")
    if not served or row.get("proxy") != "running":
        return None
    return str(served.get("owner") or served.get("pid") or served.get("url"))


@dataclass
class History:
    """Samples and rebalances of the last `window_s` seconds (see the module docstring)."""

    window_s: float = WINDOW_S
    samples: deque[Sample] = field(default_factory=deque)
    rebalances: deque[Rebalance] = field(default_factory=deque)
    _counters: dict[tuple[int, str | None], dict[str, int]] = field(default_factory=dict)
    _servers: dict[int, str | None] = field(default_factory=dict)
    _last_at: float | None = None

    def add(self, report: Mapping[str, Any], at: float) -> Sample:
        """Add the report read at `at`; returns its sample."""
        rows = list(report.get("partitions") or [])
        dt = None if self._last_at is None else at - self._last_at
        sums = dict.fromkeys(RATES, 0.0)
        known = False
        per_partition: dict[int, dict[str, float]] = {}
        counters: dict[tuple[int, str | None], dict[str, int]] = {}
        for row in rows:
            now = {k: int(v) for k, v in (row.get("counters") or {}).items() if k in RATES}
            if not now:
                continue
            ident = (int(row["partition"]), _server(row))
            counters[ident] = now
            before = self._counters.get(ident)
            if before is None or dt is None or dt <= 0:
                continue
            known = True
            mine = per_partition.setdefault(ident[0], dict.fromkeys(RATES, 0.0))
            for name in RATES:
                delta = now.get(name, 0) - before.get(name, 0)
                if delta < 0:  # the counters restarted: count from 0
                    delta = now.get(name, 0)
                sums[name] += delta / dt
                mine[name] += round(delta / dt, 3)
        totals: dict[str, float | None] = {n: (sums[n] if known else None) for n in RATES}
        self._counters = counters
        self._last_at = at
        for row in rows:
            partition = int(row["partition"])
            server = _server(row)
            if partition in self._servers and self._servers[partition] != server:
                self.rebalances.append(Rebalance(at, partition, self._servers[partition], server))
            self._servers[partition] = server
        totals_doc = report.get("totals") or {}
        sample = Sample(
            at=at,
            lag={int(r["partition"]): r.get("lag") for r in rows},
            rates=totals,
            pending=totals_doc.get("dead_letters_pending"),
            partition_rates=per_partition,
        )
        self.samples.append(sample)
        self._prune(at)
        return sample

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self.samples and self.samples[0].at < horizon:
            self.samples.popleft()
        while self.rebalances and self.rebalances[0].at < horizon:
            self.rebalances.popleft()

    def last_rates(self) -> dict[str, dict[str, float]]:
        """Each partition's rates at the last sample (JSON keys: the partition as text)."""
        if not self.samples:
            return {}
        return {str(p): dict(r) for p, r in self.samples[-1].partition_rates.items()}

    def series(self) -> dict[str, Any]:
        """Columns for the plots: `t` (epoch s), `lag` per partition and in total, each
        rate, and `pending`; a missing value is None (a gap in the line)."""
        partitions = sorted({p for s in self.samples for p in s.lag})
        lag = {str(p): [s.lag.get(p) for s in self.samples] for p in partitions}
        total: list[int | None] = []
        for s in self.samples:
            values = list(s.lag.values())
            total.append(
                None
                if not values or any(v is None for v in values)
                else sum(v for v in values if v is not None)
            )
        return {
            "t": [s.at for s in self.samples],
            "lag": lag,
            "lag_total": total,
            **{name: [_rounded(s.rates.get(name)) for s in self.samples] for name in RATES},
            "pending": [s.pending for s in self.samples],
        }


def _rounded(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, 3)
