"""What one fault-suite run does: its options, the workload and the fault plan (pure).

Each message value is `<behaviour>:<index>`; tests/fault/instance.py does what the
behaviour says. Seeded, so a run can be repeated exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOPIC = "fault-suite"
BEHAVIOURS = ("ok", "nack", "retry", "slow", "crash")
LABELS = {"retry": "retry-then-ok"}
DEFAULT_SHARES = {"nack": 0.01, "retry": 0.02, "slow": 0.005, "crash": 0.0005}
"""Crash pills are rare on purpose: each one costs max_attempts instance crashes."""
SLOW_FACTOR = 1.5
"""A slow handler sleeps this many ack deadlines on its first attempt."""
RETRY_INITIAL_S = 0.05
RETRY_MAX_S = 0.5
COMMIT_INTERVAL_S = 0.2
DRAIN_TIMEOUT_S = 2.0
PROXY_KILL_BUDGET_S = 4.0
"""Planning allowance for one proxy kill: down time, restart, reconnects."""
CONSUMER_KILL_BUDGET_S = 1.0
MIN_DURATION_S = 10.0
LEASE_S = 2.0
"""The proxy's ownership.lease_s: a restarted proxy waits up to this long (as a standby)
for the killed one's lease to lapse, and a DynamoDB outage longer than ~0.8x this makes the
proxy give the partition up (exit 3), after which the suite restarts it as a standby."""


@dataclass(frozen=True)
class Options:
    """One run's parameters (the CLI's --encode-settled both makes two runs)."""

    messages: int = 50_000
    """Messages produced."""
    proxy_kills: int = 10
    """kill -9s of the proxy, each followed by a restart."""
    consumer_kills: int = 10
    """kill -9s of a random consumer instance (the supervisor restarts it)."""
    outage_s: float = 20.0
    """How long moto, then the broker, are SIGSTOPped (once each)."""
    instances: int = 3
    """Consumer instance processes kept running."""
    concurrency: int = 16
    """Handlers per instance (credits are twice that: the client's default prefetch)."""
    seed: int = 1
    """Seeds the workload, the fault schedule and the choice of victims."""
    encode_settled: bool = True
    """The proxy's commit.encode_settled."""
    max_attempts: int = 5
    """The proxy's delivery.max_attempts."""
    ack_deadline_s: float = 2.0
    """The proxy's delivery.ack_deadline_s; slow handlers sleep 1.5x this."""
    redelivery_span_s: float = 2.0
    """The proxy's delivery.redelivery_span_s: least time from a crash pill's first crash
    to its dead letter. Short, like the deadlines above: at the default 60 s the pills
    would hold the commit for a minute and make a run three times longer."""
    duration_s: float | None = None
    """Seconds over which the workload is produced (faults land inside it); None: sized
    from the fault budget."""
    timeout_s: float = 900.0
    """Longest wait, once production is due to end, for the committed offset to reach the
    end of the partition."""
    work_dir: Path | None = None
    """Where logs go (a fresh temporary directory if None); kept for inspection."""
    shares: tuple[tuple[str, float], ...] = tuple(DEFAULT_SHARES.items())
    """Share of each non-ok behaviour in the workload."""

    @property
    def credits(self) -> int:
        return 2 * self.concurrency

    @property
    def in_flight_window(self) -> int:
        """Most deliveries the instances may hold unsettled at once."""
        return self.instances * self.credits

    def production_s(self) -> float:
        if self.duration_s is not None:
            return self.duration_s
        budget = (
            2 * self.outage_s
            + self.proxy_kills * PROXY_KILL_BUDGET_S
            + self.consumer_kills * CONSUMER_KILL_BUDGET_S
        )
        return max(MIN_DURATION_S, 1.5 * budget)


@dataclass(frozen=True)
class Workload:
    """Behaviour of each message, in produce order; the value is `<behaviour>:<index>`."""

    behaviours: tuple[str, ...]

    @classmethod
    def generate(cls, count: int, shares: dict[str, float], seed: int) -> Workload:
        """Exactly round(count * share) of each behaviour (at least one crash pill)."""
        rng = random.Random(seed)
        kinds: list[str] = []
        for behaviour, share in shares.items():
            n = round(count * share)
            if behaviour == "crash" and share > 0:
                n = max(1, n)
            kinds += [behaviour] * n
        if len(kinds) > count:
            raise ValueError("the behaviour shares add up to more than the messages")
        kinds += ["ok"] * (count - len(kinds))
        rng.shuffle(kinds)
        return cls(tuple(kinds))

    def value(self, index: int) -> bytes:
        return f"{self.behaviours[index]}:{index}".encode()

    def count(self, behaviour: str) -> int:
        return self.behaviours.count(behaviour)


@dataclass(frozen=True)
class Fault:
    kind: str
    """proxy-kill, consumer-kill, broker-outage or aws-outage."""
    at_s: float
    """Planned start, seconds after production started."""


def plan_faults(options: Options, duration_s: float, rng: random.Random) -> list[Fault]:
    """Every fault once at a random moment inside production, in time order."""
    kinds = ["proxy-kill"] * options.proxy_kills + ["consumer-kill"] * options.consumer_kills
    if options.outage_s > 0:
        kinds += ["aws-outage", "broker-outage"]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.05, 0.9) * duration_s for _ in kinds)
    return [Fault(kind, at) for kind, at in zip(kinds, times, strict=True)]


def proxy_overrides(options: Options) -> dict[str, dict[str, Any]]:
    return {
        "delivery": {
            "ack_deadline_s": float(options.ack_deadline_s),
            "max_attempts": options.max_attempts,
            "redelivery_span_s": options.redelivery_span_s,
        },
        "retry": {"initial_backoff_s": RETRY_INITIAL_S, "max_backoff_s": RETRY_MAX_S},
        "commit": {"interval_s": COMMIT_INTERVAL_S, "encode_settled": options.encode_settled},
        "shutdown": {"drain_timeout_s": DRAIN_TIMEOUT_S},
        "ownership": {"lease_s": LEASE_S},
    }
