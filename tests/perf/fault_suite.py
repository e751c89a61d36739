"""Fault suite: real processes are killed and stalled while Triage works, and nothing is lost.

Why: Triage's promise is that every message is acked or durably dead-lettered no matter
which process dies when. Unit tests with in-memory twins cannot show that, so this suite
runs the real thing (Tansu, moto server, the proxy and consumer instances, each its own
process), kills them with SIGKILL at random moments, freezes the broker and the DynamoDB
endpoint with SIGSTOP, and then checks every produced offset against what the handlers
did and what the dead-letter table holds.

One run:
1. A DevStack (1 partition) with short deadlines, fast retry backoff and a 0.2 s commit
   interval; `commit.encode_settled` on or off.
2. A seeded workload, produced at a steady rate so the faults land on live traffic; each
   value says what the handler does (see tests/perf/fault_instance.py): ok (ack), nack
   (dead-letter now), retry-then-ok, slow (past the ack deadline on attempt 1) and crash
   (os._exit(1) on every attempt: must end dead-lettered with attempts == max_attempts).
3. N instance processes, each logging every invocation before acting. A supervisor
   restarts any instance that exits; a fault thread, one fault at a time, kill -9s
   instances and the proxy (restarting the proxy), and SIGSTOPs moto and the broker once
   each for --outage-s (both are in-memory: they are never killed).
4. Done when the group's committed offset reaches the end of the partition and every
   fault has run; bounded by --timeout-s.
5. Verify: lost = produced offsets neither completed by a handler nor in the dead-letter
   table (must be 0); crash pills; dead letters byte-exact; every logged offset maps to
   the value produced at it. Reported, not judged: messages dead-lettered though their
   behaviour never asked for it (attempts used up as collateral of crashes), listed in
   <run dir>/dead-lettered-not-asked.txt beside timeline.txt and the process logs.

Duplicates. Each handler invocation after an offset's first is attributed to what made
the proxy redeliver it, taken from the previous invocation of the same offset: it asked
for it (retry, its own crash, a slow handler past its deadline: expected, up to what the
behaviour needs: retry 1, slow 1, crash max_attempts - 1), or the first fault between
the two invocations (a proxy kill, the previous instance killed by the suite, the
previous instance crashed by another message's crash pill), or none ("other"). Expected
redeliveries beyond the behaviour's need (a crash pill starting again at attempt 1 on a
restarted proxy) count as duplicates of the proxy kill that reset its attempts. This is
stricter than `invocations - unique offsets - expected`: a missing expected redelivery
cannot hide an unexpected one, and every duplicate has a cause.

Targets: lost == 0 and crash pills exact (exit 1 otherwise); with the encoding,
duplicates per proxy kill no more than the in-flight window (instances x credits); with
--encode-settled both, at least 5x fewer duplicates per proxy kill with the encoding than
without (exit 2 when only a figure target fails).

    .venv/bin/python -m tests.perf.fault_suite [--messages N] [--proxy-kills N]
        [--consumer-kills N] [--outage-s S] [--instances N] [--seed N]
        [--encode-settled on|off|both] [--max-attempts N] [--ack-deadline-s S]

Every process started is stopped by PID on the way out, also on error, Ctrl-C and
SIGTERM (which raises SystemExit so the context managers run).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException, Producer

from tests.perf.common import ROOT, CommitWatcher
from tests.perf.fault_instance import plan_for
from triage_cli.devstack import DevStack
from triage_cli.exitcodes import ExitCode

logger = logging.getLogger(__name__)

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
FAULT_GAP_S = 0.5
"""Least time between the end of one fault and the start of the next."""
PROXY_DOWN_S = (0.1, 1.0)
"""Range of the time a killed proxy stays down before it is restarted."""
PROXY_START_TRIES = 5
PROXY_KILL_SLACK_S = 1.0
"""An invocation that started up to this long after a proxy kill may still have been
delivered by the dead proxy (it sat in the instance's local queue)."""
SETTLE_SLACK_S = 1.0
"""An instance that died this long after a handler completed may not have sent the ack."""
LEASE_S = 2.0
"""The proxy's ownership.lease_s: a restarted proxy waits up to this long (as a standby)
for the killed one's lease to lapse, and a DynamoDB outage longer than ~0.8x this makes the
proxy give the partition up (exit 3), after which the suite restarts it as a standby."""
LEASE_LOSS_SLACK_S = 5.0
"""A proxy exit 3 up to this long after a DynamoDB outage is its lease lapsing in it."""
MAX_UNEXPECTED_PROXY_EXITS = 5
"""A proxy that dies on its own this often is broken: the run stops and reports it."""
TICK_S = 0.05
STOP_INSTANCE_S = 10.0
RATIO_TARGET = 5.0


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


# --- the workload --------------------------------------------------------------------------


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


class Production(threading.Thread):
    """Produces the workload at a steady rate; records the offset of every index."""

    def __init__(
        self, bootstrap: str, workload: Workload, duration_s: float, outage_s: float
    ) -> None:
        super().__init__(name="producer", daemon=True)
        patience_ms = int(max(120.0, 3 * outage_s) * 1000)
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "linger.ms": 5,
                # Ride out a SIGSTOPped broker without a timeout-driven resend, which could
                # write a record twice and move the end of the partition.
                "request.timeout.ms": patience_ms,
                "socket.timeout.ms": patience_ms,
                "message.timeout.ms": 0,
            }
        )
        self._workload = workload
        self._duration_s = duration_s
        self._halt = threading.Event()
        self.offsets: dict[int, int] = {}
        """index -> offset, from the delivery reports."""
        self.errors: list[str] = []
        self.started_at = 0.0
        self.finished = threading.Event()
        self._closed = False

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.errors.append(str(err))
            return
        index = int(msg.value().split(b":", 1)[1])
        self.offsets[index] = msg.offset()

    def run(self) -> None:
        try:
            self._produce()
        except Exception as exc:  # noqa: BLE001 - reported by the supervisor loop
            self.errors.append(f"producer failed: {exc!r}")
        finally:
            self.finished.set()

    def _produce(self) -> None:
        count = len(self._workload.behaviours)
        rate = count / self._duration_s
        self.started_at = time.time()
        start = time.monotonic()
        index = 0
        while index < count and not self._halt.is_set():
            due = min(count, int((time.monotonic() - start) * rate) + 1)
            while index < due:
                try:
                    self._producer.produce(
                        TOPIC,
                        value=self._workload.value(index),
                        key=str(index).encode(),
                        partition=0,
                        on_delivery=self._on_delivery,
                    )
                except BufferError:
                    self._producer.poll(0.05)
                    continue
                index += 1
            self._producer.poll(0)
            self._halt.wait(0.01)
        while not self._halt.is_set() and self._producer.flush(0.5) > 0:
            pass

    def stop(self) -> None:
        """Stop producing and close the client (it would log the stack going away)."""
        self._halt.set()
        self.join(30)
        if not self.is_alive() and not self._closed:
            self._closed = True
            self._producer.close()


class CommitPoller(threading.Thread):
    """Keeps the group's latest committed offset; a stalled broker only makes it stale."""

    def __init__(self, stack: DevStack) -> None:
        super().__init__(name="commit-poller", daemon=True)
        self._watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, TOPIC, 1)
        self._halt = threading.Event()
        self.committed = -1

    def run(self) -> None:
        while not self._halt.is_set():
            with contextlib.suppress(KafkaException):
                self.committed = self._watcher.offsets()[0]
            self._halt.wait(0.1)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        self._watcher.close()


# --- consumer instances --------------------------------------------------------------------


@dataclass
class Incarnation:
    """One consumer instance process; each has its own invocation log."""

    slot: int
    number: int
    log: Path
    proc: subprocess.Popen[bytes]
    started: float
    killed_at: float | None = None
    ended: float | None = None
    fate: str = "running"
    """running, killed (by the suite), crashed (exit 1: a crash pill), stopped, exit N."""


class Fleet:
    """Keeps `count` instance processes alive; kills one on request; stops all by PID."""

    def __init__(
        self, run_dir: Path, target: str, token: str, count: int, options: Options
    ) -> None:
        self._dir = run_dir / "instances"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._target = target
        self._token = token
        self._count = count
        self._options = options
        self._lock = threading.Lock()
        self._live: dict[int, Incarnation] = {}
        self.history: list[Incarnation] = []
        self._stopping = False

    def _spawn(self, slot: int) -> Incarnation:
        number = sum(1 for i in self.history if i.slot == slot)
        name = f"slot{slot}-{number}"
        log = self._dir / f"{name}.log"
        with open(self._dir / f"{name}.err", "ab") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.perf.fault_instance",
                    "--target",
                    self._target,
                    "--log",
                    str(log),
                    "--concurrency",
                    str(self._options.concurrency),
                    "--slow-s",
                    str(self._options.ack_deadline_s * SLOW_FACTOR),
                    "--id",
                    f"fault-{name}",
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), "TRIAGE_TOKEN": self._token},
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                start_new_session=True,  # a Ctrl-C must not reach them before we stop them
            )
        inc = Incarnation(slot, number, log, proc, time.time())
        self.history.append(inc)
        self._live[slot] = inc
        return inc

    def start(self) -> None:
        with self._lock:
            for slot in range(self._count):
                self._spawn(slot)

    def supervise(self) -> int:
        """Record exited instances and start replacements; return how many were restarted."""
        restarted = 0
        with self._lock:
            for slot, inc in list(self._live.items()):
                code = inc.proc.poll()
                if code is None:
                    continue
                inc.ended = time.time()
                if inc.killed_at is not None:
                    inc.fate = "killed"
                elif code == 1:
                    inc.fate = "crashed"
                else:
                    inc.fate = f"exit {code}"
                del self._live[slot]
                if not self._stopping:
                    self._spawn(slot)
                    restarted += 1
        return restarted

    def kill_one(self, rng: random.Random) -> Incarnation | None:
        """SIGKILL a random live instance (the supervisor restarts it)."""
        with self._lock:
            alive = [i for i in self._live.values() if i.proc.poll() is None]
            if not alive:
                return None
            victim = rng.choice(sorted(alive, key=lambda i: i.slot))
            victim.killed_at = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.proc.pid, signal.SIGKILL)
            return victim

    def stop(self) -> None:
        """SIGTERM every live instance by PID, SIGKILL what outlives the grace; safe twice."""
        with self._lock:
            self._stopping = True
            live = list(self._live.values())
            self._live.clear()
        for inc in live:
            if inc.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inc.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_INSTANCE_S
        for inc in live:
            try:
                inc.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inc.proc.pid, signal.SIGKILL)
                inc.proc.wait()
            inc.ended = inc.ended or time.time()
            if inc.fate == "running":
                inc.fate = "stopped"


# --- faults --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    kind: str
    """proxy-kill, consumer-kill, broker-outage or aws-outage."""
    at_s: float
    """Planned start, seconds after production started."""


@dataclass
class FaultRecord:
    kind: str
    started: float
    ended: float = 0.0
    detail: str = ""


def plan_faults(options: Options, duration_s: float, rng: random.Random) -> list[Fault]:
    """Every fault once at a random moment inside production, in time order."""
    kinds = ["proxy-kill"] * options.proxy_kills + ["consumer-kill"] * options.consumer_kills
    if options.outage_s > 0:
        kinds += ["aws-outage", "broker-outage"]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.05, 0.9) * duration_s for _ in kinds)
    return [Fault(kind, at) for kind, at in zip(kinds, times, strict=True)]


class FaultRunner(threading.Thread):
    """Runs the planned faults one after another; never leaves a process SIGSTOPped."""

    def __init__(
        self,
        stack: DevStack,
        fleet: Fleet,
        plan: list[Fault],
        options: Options,
        rng: random.Random,
        proxy_lock: threading.Lock,
    ) -> None:
        super().__init__(name="faults", daemon=True)
        self._stack = stack
        self._fleet = fleet
        self._plan = plan
        self._options = options
        self._rng = rng
        self._proxy_lock = proxy_lock
        self._halt = threading.Event()
        self.records: list[FaultRecord] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.start_at = 0.0

    def run(self) -> None:
        try:
            free_at = 0.0
            for fault in self._plan:
                wait = max(self.start_at + fault.at_s, free_at) - time.time()
                if self._halt.wait(max(0.0, wait)):
                    return
                record = FaultRecord(fault.kind, time.time())
                self.records.append(record)
                getattr(self, "_" + fault.kind.replace("-", "_"))(record)
                record.ended = time.time()
                free_at = record.ended + FAULT_GAP_S
        except BaseException as exc:  # noqa: BLE001 - handed to the supervisor loop
            self.error = exc
        finally:
            self.finished.set()

    def _proxy_kill(self, record: FaultRecord) -> None:
        with self._proxy_lock:
            pid = self._stack.proxy_process(0).pid
            record.started = time.time()
            self._stack.stop_proxy(0, signal.SIGKILL)
            down = self._rng.uniform(*PROXY_DOWN_S)
            record.detail = f"pid {pid}, down {down:.2f} s"
            if self._halt.wait(down):
                return
            restart_proxy(self._stack, self._halt)

    def _consumer_kill(self, record: FaultRecord) -> None:
        deadline = time.monotonic() + 10
        while (victim := self._fleet.kill_one(self._rng)) is None:
            if time.monotonic() > deadline or self._halt.wait(TICK_S):
                record.detail = "no live instance"
                return
        record.started = victim.killed_at or record.started
        record.detail = f"slot {victim.slot} #{victim.number} pid {victim.proc.pid}"

    def _aws_outage(self, record: FaultRecord) -> None:
        self._outage(self._stack.aws, record)

    def _broker_outage(self, record: FaultRecord) -> None:
        self._outage(self._stack.broker, record)

    def _outage(self, process: Any, record: FaultRecord) -> None:
        process.signal(signal.SIGSTOP)
        try:
            self._halt.wait(self._options.outage_s)
        finally:
            process.signal(signal.SIGCONT)
        record.detail = f"SIGSTOP pid {process.pid} for {self._options.outage_s:g} s"

    def stop(self) -> None:
        self._halt.set()
        self.join(PROXY_START_TRIES * 35)


def restart_proxy(stack: DevStack, halt: threading.Event | None = None) -> None:
    """start_proxy, retried: a proxy may exit at start while the broker is busy."""
    for attempt in range(1, PROXY_START_TRIES + 1):
        try:
            stack.start_proxy(0)
            return
        except Exception:
            if attempt == PROXY_START_TRIES:
                raise
            logger.warning("proxy restart %d failed; retrying", attempt, exc_info=True)
            if halt is not None and halt.wait(1.0):
                return
            if halt is None:
                time.sleep(1.0)


# --- verification --------------------------------------------------------------------------


@dataclass
class Invocation:
    offset: int
    attempt: int
    index: int
    plan: str
    t: float
    incarnation: Incarnation
    done_t: float | None = None


def read_invocations(history: list[Incarnation]) -> tuple[list[Invocation], int]:
    """Every handler invocation from every instance log; also how many lines were torn."""
    invocations: list[Invocation] = []
    torn = 0
    for inc in history:
        if not inc.log.exists():
            continue
        open_: dict[tuple[int, int], Invocation] = {}
        for line in inc.log.read_text().splitlines():
            parts = line.split()
            try:
                offset, attempt, index, what, t = (
                    int(parts[0]),
                    int(parts[1]),
                    int(parts[2]),
                    parts[3],
                    float(parts[4]),
                )
            except (IndexError, ValueError):
                torn += 1
                continue
            if what == "done":
                if (inv := open_.get((offset, attempt))) is not None:
                    inv.done_t = t
                continue
            inv = Invocation(offset, attempt, index, what, t, inc)
            invocations.append(inv)
            open_[(offset, attempt)] = inv
        if inc.fate == "crashed" and inc.ended is not None:
            # The crash happened when the crash pill's line was written, not when the
            # supervisor noticed the exit.
            crash_times = [i.t for i in open_.values() if i.plan == "crash"]
            if crash_times:
                inc.ended = max(crash_times)
    return invocations, torn


def scan_dead_letters(stack: DevStack) -> list[Any]:
    import boto3

    from triage_proxy.table.items import dead_letter_from_item

    client = boto3.client(
        "dynamodb",
        endpoint_url=stack.aws.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        items: list[Any] = []
        for page in client.get_paginator("scan").paginate(TableName=stack.table):
            items.extend(page["Items"])
        # The proxy keeps its settled-above checkpoint in the same table at offset -1.
        return [dead_letter_from_item(i) for i in items if int(i["offset"]["N"]) >= 0]
    finally:
        client.close()


EXPECTED_CAUSES = ("retry", "own crash", "deadline")
FAULT_CAUSES = ("proxy kill", "consumer kill", "crash collateral", "other")


def redelivery_cause(prev: Invocation, cur: Invocation, proxy_kills: list[float]) -> str:
    """Why `cur` followed `prev` for the same offset (see the module docstring)."""
    if prev.plan == "retry":
        return "retry"
    if prev.plan == "crash":
        return "own crash"
    candidates: list[tuple[float, str]] = []
    kill = first_kill_between(proxy_kills, prev.t, cur.t)
    if kill is not None:
        candidates.append((proxy_kills[kill], "proxy kill"))
    inc = prev.incarnation
    died = inc.killed_at if inc.fate == "killed" else inc.ended
    unsettled = prev.done_t is None or (died or 0.0) - prev.done_t < SETTLE_SLACK_S
    if died is not None and died <= cur.t and unsettled:
        if inc.fate == "killed":
            candidates.append((died, "consumer kill"))
        elif inc.fate == "crashed":
            candidates.append((died, "crash collateral"))
    if candidates:
        return min(candidates)[1]
    if prev.plan == "slow" and (prev.done_t is None or prev.done_t > cur.t):
        return "deadline"
    return "other"


def first_kill_between(proxy_kills: list[float], since: float, until: float) -> int | None:
    """Index of the first proxy kill that can explain a redelivery of an invocation made
    at `since` seen again at `until`, or None."""
    i = bisect.bisect_right(proxy_kills, since - PROXY_KILL_SLACK_S)
    return i if i < len(proxy_kills) and proxy_kills[i] <= until else None


def expected_budget(behaviour: str, max_attempts: int) -> dict[str, int]:
    """Redeliveries a behaviour asks for itself, by cause."""
    return {
        "retry": 1 if behaviour == "retry" else 0,
        "own crash": max_attempts - 1 if behaviour == "crash" else 0,
        "deadline": 1 if behaviour == "slow" else 0,
    }


@dataclass
class Report:
    """What one run did and what the verification found."""

    options: Options
    work_dir: Path
    produced: int = 0
    behaviour_counts: dict[str, int] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)
    proxy_kills: int = 0
    consumer_kills: int = 0
    outages: list[str] = field(default_factory=list)
    instance_crashes: int = 0
    unexpected_proxy_exits: list[str] = field(default_factory=list)
    lease_losses: list[str] = field(default_factory=list)
    """Proxy exits because the lease lapsed in a DynamoDB outage (expected; restarted)."""
    committed: int = -1
    end_offset: int = 0
    unfinished: str = ""
    """Why the run ended before the committed offset reached the end (empty: it did)."""
    wall_s: float = 0.0
    acked: int = 0
    dead_lettered: int = 0
    dead_by_behaviour: dict[str, int] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    unfinished_offsets: int = 0
    """Offsets at or above the committed offset still unsettled when the run stopped."""
    collateral: list[str] = field(default_factory=list)
    """Dead letters of messages whose behaviour never asked for it (attempts used up)."""
    started_at: float = 0.0
    lost_detail: list[str] = field(default_factory=list)
    crash_pills: int = 0
    crash_pills_ok: int = 0
    crash_detail: list[str] = field(default_factory=list)
    not_exact: list[int] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    produce_errors: list[str] = field(default_factory=list)
    torn_lines: int = 0
    invocations: int = 0
    unique_offsets: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    duplicates_by_cause: Counter[str] = field(default_factory=Counter)
    per_kill: Counter[int] = field(default_factory=Counter)
    """Duplicates attributed to each proxy kill, by its index in time order."""

    @property
    def duplicates(self) -> int:
        return sum(self.duplicates_by_cause.values())

    @property
    def per_proxy_kill(self) -> float:
        """NaN without proxy kills."""
        kills = self.proxy_kills
        return self.duplicates_by_cause["proxy kill"] / kills if kills else math.nan

    @property
    def per_consumer_kill(self) -> float:
        kills = self.consumer_kills
        return self.duplicates_by_cause["consumer kill"] / kills if kills else math.nan

    @property
    def correct(self) -> bool:
        """Nothing lost, crash pills exact, dead letters exact, every record accounted."""
        return (
            not self.lost
            and not self.unfinished
            and self.crash_pills_ok == self.crash_pills
            and not self.not_exact
            and not self.mismatched
            and not self.produce_errors
        )


def verify(
    report: Report,
    workload: Workload,
    offsets: dict[int, int],
    history: list[Incarnation],
    dead: list[Any],
    proxy_kill_times: list[float],
) -> None:
    """Fill in the verification half of `report` (see the module docstring)."""
    options = report.options
    index_at = {offset: index for index, offset in offsets.items()}
    behaviour_at = {offset: workload.behaviours[i] for offset, i in index_at.items()}
    report.produced = len(offsets)
    if len(index_at) != len(offsets):
        report.mismatched.append("two indexes were reported at the same offset")
    missing = len(workload.behaviours) - len(offsets)
    if missing and not report.unfinished:
        report.mismatched.append(f"{missing} messages have no delivery report")

    invocations, report.torn_lines = read_invocations(history)
    by_offset: dict[int, list[Invocation]] = defaultdict(list)
    for inv in invocations:
        by_offset[inv.offset].append(inv)
        if index_at.get(inv.offset) != inv.index:
            report.mismatched.append(
                f"offset {inv.offset} delivered index {inv.index}, "
                f"produced index {index_at.get(inv.offset)}"
            )
        elif inv.plan != plan_for(behaviour_at[inv.offset], inv.attempt):
            report.mismatched.append(f"offset {inv.offset} attempt {inv.attempt}: {inv.plan}")
    report.invocations = len(invocations)
    report.unique_offsets = len(by_offset)
    acked = {inv.offset for inv in invocations if inv.done_t is not None}
    report.acked = len(acked & set(index_at))

    dead_at = {dl.record.offset: dl for dl in dead}
    report.dead_lettered = len(dead_at)
    report.dead_by_behaviour = dict(
        Counter(behaviour_at.get(o, "unknown") for o in dead_at).most_common()
    )
    for offset, dl in sorted(dead_at.items()):
        index = index_at.get(offset)
        if (
            index is None
            or dl.record.value != workload.value(index)
            or dl.record.key != str(index).encode()
        ):
            report.not_exact.append(offset)

    # Lost: the proxy committed past it, yet no handler completed it and it is not in the
    # table. (When the run finished, the committed offset is the end: every offset.)
    unsettled = set(index_at) - acked - set(dead_at)
    report.lost = sorted(o for o in unsettled if o < report.committed)
    report.unfinished_offsets = len(unsettled) - len(report.lost)
    report.collateral = [
        f"offset {o} ({behaviour_at[o]}, completed by a handler "
        f"{sum(1 for i in by_offset[o] if i.done_t)} times): attempts {dl.attempts}, {dl.reason}"
        for o, dl in sorted(dead_at.items())
        if behaviour_at.get(o) not in ("nack", "crash")
    ]
    for offset in report.lost[:10]:
        seen = ", ".join(
            f"#{i.attempt} {i.plan}{' done' if i.done_t else ''} ({i.incarnation.fate})"
            for i in sorted(by_offset.get(offset, []), key=lambda i: i.t)
        )
        report.lost_detail.append(
            f"offset {offset} ({behaviour_at[offset]}): {seen or 'never delivered'}"
        )

    for offset, behaviour in sorted(behaviour_at.items()):
        if behaviour != "crash":
            continue
        report.crash_pills += 1
        dl = dead_at.get(offset)
        if dl is not None and dl.attempts == options.max_attempts:
            report.crash_pills_ok += 1
        else:
            got = "not dead-lettered" if dl is None else f"attempts {dl.attempts}"
            if dl is None and offset >= report.committed:
                got += " (still unsettled when the run stopped)"
            report.crash_detail.append(f"offset {offset}: {got}")

    for offset, invs in by_offset.items():
        invs.sort(key=lambda i: i.t)
        causes = []
        for a, b in itertools.pairwise(invs):
            cause = redelivery_cause(a, b, proxy_kill_times)
            causes.append(cause)
            kill = first_kill_between(proxy_kill_times, a.t, b.t)
            if cause == "proxy kill" and kill is not None:
                report.per_kill[kill] += 1
        report.causes.update(causes)
        for cause in FAULT_CAUSES:
            report.duplicates_by_cause[cause] += causes.count(cause)
        budget = expected_budget(behaviour_at.get(offset, "ok"), options.max_attempts)
        excess = sum(max(0, causes.count(c) - budget[c]) for c in EXPECTED_CAUSES)
        if excess:
            # e.g. a crash pill starting over at attempt 1 on a restarted proxy
            reset = first_kill_between(proxy_kill_times, invs[0].t, invs[-1].t)
            report.duplicates_by_cause["other" if reset is None else "proxy kill"] += excess
            if reset is not None:
                report.per_kill[reset] += excess


# --- one run -------------------------------------------------------------------------------


def proxy_overrides(options: Options) -> dict[str, dict[str, Any]]:
    return {
        "delivery": {
            "ack_deadline_s": float(options.ack_deadline_s),
            "max_attempts": options.max_attempts,
        },
        "retry": {"initial_backoff_s": RETRY_INITIAL_S, "max_backoff_s": RETRY_MAX_S},
        "commit": {"interval_s": COMMIT_INTERVAL_S, "encode_settled": options.encode_settled},
        "shutdown": {"drain_timeout_s": DRAIN_TIMEOUT_S},
        "ownership": {"lease_s": LEASE_S},
    }


def run_suite(options: Options) -> Report:
    """One run against a fresh stack; every process it starts is stopped before it returns."""
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="triage-fault-"))
    run_dir = work_dir / f"encode-{'on' if options.encode_settled else 'off'}"
    run_dir.mkdir(parents=True, exist_ok=True)
    report = Report(options, run_dir)
    shares = dict(options.shares)
    workload = Workload.generate(options.messages, shares, options.seed)
    report.behaviour_counts = {b: workload.count(b) for b in BEHAVIOURS}
    duration_s = options.production_s()
    plan = plan_faults(options, duration_s, random.Random(options.seed + 1))
    rng = random.Random(options.seed + 2)
    proxy_lock = threading.Lock()

    with contextlib.ExitStack() as cleanup:
        stack = DevStack(
            topic=TOPIC, state_dir=run_dir / "stack", proxy_overrides=proxy_overrides(options)
        )
        stack.start()
        cleanup.callback(stack.stop)
        target = stack.describe()["proxies"][0]["target"]
        fleet = Fleet(run_dir, target, stack.token, options.instances, options)
        cleanup.callback(fleet.stop)
        poller = CommitPoller(stack)
        cleanup.callback(poller.stop)
        producer = Production(stack.broker.bootstrap, workload, duration_s, options.outage_s)
        cleanup.callback(producer.stop)
        faults = FaultRunner(stack, fleet, plan, options, rng, proxy_lock)
        cleanup.callback(faults.stop)  # runs first: SIGCONTs whatever it stopped

        fleet.start()
        poller.start()
        producer.start()
        faults.start_at = report.started_at = time.time()
        faults.start()
        report.unfinished, finished_at = _supervise(
            stack, fleet, poller, producer, faults, proxy_lock, report, options
        )
        report.wall_s = finished_at - faults.start_at

        faults.stop()
        if faults.error is not None:
            report.unfinished += f" ({faults.error!r})"
        fleet.stop()
        producer.stop()
        report.produce_errors = producer.errors[:10]
        report.committed = poller.committed
        poller.stop()
        dead = scan_dead_letters(stack)

    report.faults = faults.records
    report.proxy_kills = sum(1 for r in faults.records if r.kind == "proxy-kill")
    report.consumer_kills = sum(1 for r in faults.records if r.kind == "consumer-kill")
    report.outages = [r.kind for r in faults.records if r.kind.endswith("outage")]
    report.instance_crashes = sum(1 for i in fleet.history if i.fate == "crashed")
    kill_times = sorted(r.started for r in faults.records if r.kind == "proxy-kill")
    verify(report, workload, producer.offsets, fleet.history, dead, kill_times)
    write_timeline(run_dir / "timeline.txt", faults.records, fleet.history)
    collateral = "".join(f"{line}\n" for line in report.collateral)
    (run_dir / "dead-lettered-not-asked.txt").write_text(collateral)
    return report


def write_timeline(path: Path, faults: list[FaultRecord], history: list[Incarnation]) -> None:
    """Faults and instance lifetimes in unix time, to read beside the instance logs."""
    lines = [f"{r.started:.6f} {r.ended:.6f} {r.kind} {r.detail}" for r in faults]
    lines += [
        f"{i.started:.6f} {i.ended or 0.0:.6f} instance slot{i.slot}-{i.number} "
        f"pid {i.proc.pid} {i.fate}" + (f" killed at {i.killed_at:.6f}" if i.killed_at else "")
        for i in history
    ]
    path.write_text("\n".join(sorted(lines)) + "\n")


def _supervise(
    stack: DevStack,
    fleet: Fleet,
    poller: CommitPoller,
    producer: Production,
    faults: FaultRunner,
    proxy_lock: threading.Lock,
    report: Report,
    options: Options,
) -> tuple[str, float]:
    """Restart exited instances (and a proxy that died on its own) until the committed
    offset reaches the end and every fault ran; return (why it ended early, when)."""
    deadline = time.monotonic() + options.production_s() + options.timeout_s
    while True:
        fleet.supervise()
        if faults.error is not None:
            return "aborted: a fault could not be carried out", time.time()
        if proxy_lock.acquire(blocking=False):
            try:
                proc = stack.proxy_process(0)
                if proc.poll() is not None:
                    exit_ = f"pid {proc.pid} exited with {proc.returncode}"
                    if proc.returncode == ExitCode.UNAVAILABLE and _after_aws_outage(faults):
                        report.lease_losses.append(exit_)
                    else:
                        report.unexpected_proxy_exits.append(exit_)
                    if len(report.unexpected_proxy_exits) >= MAX_UNEXPECTED_PROXY_EXITS:
                        return "aborted: the proxy keeps exiting on its own", time.time()
                    restart_proxy(stack)
            finally:
                proxy_lock.release()
        if producer.finished.is_set():
            report.end_offset = max(producer.offsets.values(), default=-1) + 1
            if faults.finished.is_set() and poller.committed >= report.end_offset:
                return "", time.time()
        if time.monotonic() > deadline:
            return f"timed out (committed {poller.committed})", time.time()
        time.sleep(TICK_S)


def _after_aws_outage(faults: FaultRunner) -> bool:
    """Whether a DynamoDB outage is under way or ended less than LEASE_LOSS_SLACK_S ago."""
    now = time.time()
    return any(
        r.kind == "aws-outage" and (not r.ended or now - r.ended < LEASE_LOSS_SLACK_S)
        for r in list(faults.records)
    )


# --- the table -----------------------------------------------------------------------------


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:.1f}"


def rows(report: Report) -> list[tuple[str, str]]:
    o = report.options
    counts = report.behaviour_counts
    mix = " / ".join(f"{counts.get(b, 0)} {LABELS.get(b, b)}" for b in BEHAVIOURS)
    dead = ", ".join(f"{n} {LABELS.get(b, b)}" for b, n in report.dead_by_behaviour.items())
    by_cause = report.duplicates_by_cause
    return [
        ("commit.encode_settled", "on" if o.encode_settled else "off"),
        ("messages produced", f"{report.produced} of {o.messages}"),
        ("  behaviours", mix),
        ("proxy kills (SIGKILL + restart)", str(report.proxy_kills)),
        ("consumer kills (SIGKILL)", str(report.consumer_kills)),
        ("instance crashes (crash pills)", str(report.instance_crashes)),
        ("outages (SIGSTOP)", f"{', '.join(report.outages) or 'none'} ({o.outage_s:g} s each)"),
        ("unexpected proxy exits", str(len(report.unexpected_proxy_exits))),
        ("lease lost in the DynamoDB outage (exit 3)", str(len(report.lease_losses))),
        ("committed offset / end", f"{report.committed} / {report.end_offset}"),
        ("acked (handler completed)", str(report.acked)),
        ("dead-lettered", f"{report.dead_lettered} ({dead or 'none'})"),
        ("lost", str(len(report.lost))),
        ("unsettled when the run stopped", str(report.unfinished_offsets)),
        ("dead-lettered though not asked", str(len(report.collateral))),
        ("crash pills ok (attempts == max)", f"{report.crash_pills_ok} / {report.crash_pills}"),
        ("dead letters not byte-exact", str(len(report.not_exact))),
        ("records not as produced", str(len(report.mismatched))),
        ("handler invocations / offsets", f"{report.invocations} / {report.unique_offsets}"),
        (
            "expected redeliveries",
            ", ".join(f"{report.causes[c]} {c}" for c in EXPECTED_CAUSES),
        ),
        ("duplicates", str(report.duplicates)),
        (
            "  by cause",
            ", ".join(f"{by_cause[c]} {c}" for c in FAULT_CAUSES),
        ),
        (
            "duplicates per proxy kill",
            f"{_fmt(report.per_proxy_kill)} (in-flight window {o.in_flight_window})",
        ),
        ("duplicates per consumer kill", _fmt(report.per_consumer_kill)),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("finished", report.unfinished or "committed offset reached the end"),
    ]


def render(reports: list[Report]) -> str:
    table = [rows(r) for r in reports]
    names = [name for name, _ in table[0]]
    width = max(len(n) for n in names)
    cols = [max(len(v) for _, v in t) for t in table]
    lines = []
    for i, name in enumerate(names):
        cells = [f"{t[i][1]:<{w}}" for t, w in zip(table, cols, strict=True)]
        lines.append(f"  {name:<{width}}  " + "  |  ".join(cells).rstrip())
    return "\n".join(lines)


def checks(reports: list[Report]) -> list[tuple[str, bool, bool]]:
    """(description, passed, is a correctness check) for every target."""
    out: list[tuple[str, bool, bool]] = []
    for r in reports:
        tag = f"[encode {'on' if r.options.encode_settled else 'off'}]"
        out.append((f"{tag} lost == 0 (lost {len(r.lost)})", not r.lost, True))
        out.append(
            (f"{tag} committed offset reached the end {r.unfinished}", not r.unfinished, True)
        )
        out.append(
            (
                f"{tag} every crash pill dead-lettered with attempts == {r.options.max_attempts}",
                r.crash_pills_ok == r.crash_pills,
                True,
            )
        )
        out.append((f"{tag} dead letters byte-exact", not r.not_exact, True))
        out.append(
            (
                f"{tag} every record delivered as produced",
                not r.mismatched and not r.produce_errors,
                True,
            )
        )
        if r.options.encode_settled:
            out.append(
                (
                    f"{tag} duplicates per proxy kill {_fmt(r.per_proxy_kill)} <= in-flight "
                    f"window {r.options.in_flight_window}",
                    not r.unfinished and r.per_proxy_kill <= r.options.in_flight_window,
                    False,
                )
            )
    on = [r for r in reports if r.options.encode_settled]
    off = [r for r in reports if not r.options.encode_settled]
    if on and off:
        a, b = off[0].per_proxy_kill, on[0].per_proxy_kill
        ratio = a / b if b else (math.inf if a else math.nan)
        if off[0].unfinished or on[0].unfinished:
            ratio = math.nan
        out.append(
            (
                f"duplicates per proxy kill without / with the encoding = {_fmt(a)} / "
                f"{_fmt(b)} = {_fmt(ratio)}x >= {RATIO_TARGET:g}x",
                ratio >= RATIO_TARGET,
                False,
            )
        )
    return out


def details(report: Report) -> Iterator[str]:
    tag = f"[encode {'on' if report.options.encode_settled else 'off'}]"
    yield f"{tag} logs: {report.work_dir}"
    for line in report.lost_detail:
        yield f"{tag} lost {line}"
    for line in report.collateral[:10]:
        yield f"{tag} dead-lettered though not asked: {line}"
    for line in report.crash_detail:
        yield f"{tag} crash pill {line}"
    for line in report.mismatched[:10]:
        yield f"{tag} mismatch: {line}"
    for line in report.produce_errors:
        yield f"{tag} produce error: {line}"
    if report.proxy_kills:
        each = ", ".join(str(report.per_kill[i]) for i in range(report.proxy_kills))
        yield f"{tag} duplicates of each proxy kill, in order: {each}"
    for line in report.unexpected_proxy_exits:
        yield f"{tag} proxy exited on its own: {line}"
    if report.torn_lines:
        yield f"{tag} {report.torn_lines} torn log lines skipped"
    start = report.started_at
    timeline = ", ".join(
        f"{r.kind}@{r.started - start:.1f}s({r.ended - r.started:.1f}s)" for r in report.faults
    )
    yield f"{tag} faults: {timeline}"


# --- command line --------------------------------------------------------------------------


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=Options.messages)
    parser.add_argument("--proxy-kills", type=int, default=Options.proxy_kills)
    parser.add_argument("--consumer-kills", type=int, default=Options.consumer_kills)
    parser.add_argument("--outage-s", type=float, default=Options.outage_s)
    parser.add_argument("--instances", type=int, default=Options.instances)
    parser.add_argument("--concurrency", type=int, default=Options.concurrency)
    parser.add_argument("--seed", type=int, default=Options.seed)
    parser.add_argument("--encode-settled", choices=("on", "off", "both"), default="both")
    parser.add_argument("--max-attempts", type=int, default=Options.max_attempts)
    parser.add_argument("--ack-deadline-s", type=float, default=Options.ack_deadline_s)
    parser.add_argument(
        "--duration-s", type=float, default=None, help="production time (default: sized)"
    )
    parser.add_argument("--timeout-s", type=float, default=Options.timeout_s)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_exit)

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="triage-fault-"))
    base = Options(
        messages=args.messages,
        proxy_kills=args.proxy_kills,
        consumer_kills=args.consumer_kills,
        outage_s=args.outage_s,
        instances=args.instances,
        concurrency=args.concurrency,
        seed=args.seed,
        max_attempts=args.max_attempts,
        ack_deadline_s=args.ack_deadline_s,
        duration_s=args.duration_s,
        timeout_s=args.timeout_s,
        work_dir=work_dir,
    )
    settings = {"on": [True], "off": [False], "both": [False, True]}[args.encode_settled]
    print(
        f"fault suite: seed {base.seed}, {base.messages} messages over "
        f"{base.production_s():.0f} s, {base.instances} instances x {base.concurrency} "
        f"handlers, logs in {work_dir}",
        flush=True,
    )
    reports = []
    for encode in settings:
        print(f"running with commit.encode_settled={'on' if encode else 'off'} ...", flush=True)
        reports.append(run_suite(dataclasses.replace(base, encode_settled=encode)))
    print(render(reports))
    for report in reports:
        for line in details(report):
            print(line)
    results = checks(reports)
    for text, passed, _ in results:
        print(f"{'PASS' if passed else 'FAIL'}  {text}")
    if any(not passed for _, passed, correctness in results if correctness):
        return 1
    if any(not passed for _, passed, _ in results):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
