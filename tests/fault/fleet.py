"""Fault suite, fleet scenario: partitions move between proxy processes while they work,
and nothing is lost.

Why: a fleet process serves the partitions Kafka's group coordinator assigns it, and a
partition moves whenever a process joins, leaves or dies. The promise is the same as for
one pinned proxy (every message acked or durably dead-lettered), plus two of the fleet's
own: a partition that moves is redelivered at most what was in flight for it, and no
partition waits long for a new process.

One run:
1. A DevStack with `--partitions` partitions (6) and no proxy of its own; the same short
   deadlines, retry backoff, commit interval and 2 s lease as the single-partition suite.
   `--processes` (3) fleet processes (`triage proxy --slot K`, no `--partition`) join the
   deployment's group; `--instances` consumer instances (tests/fault/instance.py, a
   topic-level Consumer given slot 0's address, which stays up) consume every partition.
2. A seeded workload keyed round-robin over the partitions, produced at a steady rate, with
   `--crash-share` (0.5%) crash pills (os._exit(1) on every attempt) beside the usual
   nack, retry-then-ok and slow messages; a supervisor restarts any instance that exits.
3. At 25% of production a new process joins (slot K = processes), at 50% slot 1 is
   stopped with SIGTERM, at 75% slot 2 is killed with SIGKILL (neither comes back); each
   waits until the fleet serves every partition again after the one before (and the
   joiner serves some), so each partition's longest gap is one move's.
4. Throughout, every process's /status is read every 0.5 s: which process serves which
   partition, from which the partition moves and each partition's longest time without a
   serving process are taken (a process that refuses the connection serves nothing; one
   that does not answer in time keeps its last answer).
5. Done when every partition's committed offset reaches its end; bounded by --timeout-s.

Verified (exit 1 when one fails): lost = 0 (every produced message completed by a handler
or in the dead-letter table, byte-exact); every crash pill dead-lettered; every partition's
commit reached its end; the duplicates each partition move caused are no more than the
in-flight window (instances x credits, bounded by window.max_messages); no partition was
without a serving process for more than 15 s. Each redelivery is attributed as in the
single-partition suite (verify.py), with "partition move" in place of "proxy kill": the
first move of the message's partition between the two invocations.

    .venv/bin/python -m tests.fault.fleet [--messages N] [--partitions N] [--processes N]
        [--instances N] [--crash-share F] [--max-attempts N] [--duration-s S] [--seed N]
    .venv/bin/python -m tests.fault.fault_suite --scenario fleet [the same options]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.commit_watcher import CommitWatcher
from tests.fault.instance import plan_for
from tests.fault.processes import TICK_S, Fleet, Incarnation, Production
from tests.fault.scenario import DEFAULT_SHARES, TOPIC, Options, Workload, proxy_overrides
from tests.fault.verify import (
    SETTLE_SLACK_S,
    Invocation,
    expected_budget,
    first_kill_between,
    mark_acks_sent,
    read_invocations,
    scan_dead_letters,
)
from triage_cli.devstack import DevStack
from triage_cli.embedded import HOST
from triage_cli.supervisor import fleet_command
from triage_proxy.kafka.logs import KafkaLog

logger = logging.getLogger(__name__)

MAX_GAP_S = 15.0
"""Longest a partition may go without a serving process."""
STATUS_POLL_S = 0.5
STATUS_TIMEOUT_S = 2.0
STOP_PROXY_S = 30.0
FLEET_READY_S = 120.0
SETTLE_WAIT_S = 60.0
"""Longest an event waits for the fleet to settle after the one before."""
"""Longest wait for the first processes to serve every partition before production."""
EXPECTED = ("retry", "own crash", "deadline")


@dataclass(frozen=True)
class FleetOptions:
    """One fleet run's parameters."""

    messages: int = 50_000
    partitions: int = 6
    processes: int = 3
    """Fleet processes at start; one more joins, one is SIGTERMed, one SIGKILLed."""
    instances: int = 3
    concurrency: int = 16
    crash_share: float = 0.005
    """Share of crash pills (each crashes an instance max_attempts times)."""
    max_attempts: int = 5
    duration_s: float = 120.0
    """Seconds over which the workload is produced; the faults land at 25/50/75%."""
    seed: int = 1
    timeout_s: float = 900.0
    """Longest wait after production for every commit to reach its partition's end."""
    work_dir: Path | None = None

    def base(self) -> Options:
        """The single-partition suite's options this run shares (deadlines, instances)."""
        shares = {**DEFAULT_SHARES, "crash": self.crash_share}
        return Options(
            messages=self.messages,
            instances=self.instances,
            concurrency=self.concurrency,
            seed=self.seed,
            max_attempts=self.max_attempts,
            encode_settled=True,
            timeout_s=self.timeout_s,
            work_dir=self.work_dir,
            shares=tuple(shares.items()),
        )


# --- the proxy processes ----------------------------------------------------------------------


class ProxyFleet:
    """The fleet processes by slot; each stopped by PID on the way out."""

    def __init__(self, stack: DevStack, run_dir: Path) -> None:
        from triage_proxy.config.loader import load_settings

        self._stack = stack
        self._dir = run_dir
        self.server = load_settings(stack.config_path).server
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.exits: dict[int, int] = {}
        self.unexpected: list[str] = []

    def http_port(self, slot: int) -> int:
        port = self.server.http_port
        assert port is not None
        return port + slot

    def target(self, slot: int) -> str:
        return f"{HOST}:{self.server.port + slot}"

    def start(self, slot: int) -> None:
        with open(self._dir / f"proxy-{slot}.log", "ab") as log:
            self.procs[slot] = subprocess.Popen(
                fleet_command(self._stack.config_path, slot),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def signal(self, slot: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[slot].pid, sig)

    def check(self) -> None:
        """Record a process that exited without being told to (and start it again)."""
        for slot, proc in list(self.procs.items()):
            if slot in self.exits or proc.poll() is None:
                continue
            self.unexpected.append(f"slot {slot} pid {proc.pid} exited with {proc.returncode}")
            self.start(slot)

    def stop(self) -> None:
        """SIGTERM every live process, SIGKILL what outlives the grace; safe twice."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_PROXY_S
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Episode:
    """One process serving one partition without a break, as the polls saw it."""

    pid: int
    first: float
    last: float


class ServingPoller(threading.Thread):
    """Reads every process's /status each STATUS_POLL_S: who serves which partition."""

    def __init__(self, fleet: ProxyFleet, partitions: int) -> None:
        super().__init__(name="serving-poller", daemon=True)
        self._fleet = fleet
        self._partitions = partitions
        self._halt = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="status")
        self._last: dict[int, tuple[int, list[int]]] = {}
        """slot -> (pid, served) from its last answer."""
        self.samples: list[tuple[float, dict[int, set[int]]]] = []
        """(time, partition -> pids serving it) per round."""

    def _ask(self, slot: int) -> tuple[int, list[int]] | None:
        port = self._fleet.http_port(slot)
        try:
            with urllib.request.urlopen(
                f"http://{HOST}:{port}/status", timeout=STATUS_TIMEOUT_S
            ) as reply:
                doc = json.loads(reply.read())
        except TimeoutError:
            return self._last.get(slot)  # busy, not gone: keep its last answer
        except (OSError, ValueError):
            return None
        return int(doc["pid"]), [int(p) for p in doc.get("served", [])]

    def serving_now(self) -> dict[int, set[int]]:
        """One round: every process asked at once (a slow one delays the round by at most
        STATUS_TIMEOUT_S, which a measured gap then includes: it errs long)."""
        round_: dict[int, set[int]] = {p: set() for p in range(self._partitions)}
        procs = list(self._fleet.procs.items())
        answers = list(
            self._pool.map(lambda sp: self._ask(sp[0]) if sp[1].poll() is None else None, procs)
        )
        for (slot, _), answer in zip(procs, answers, strict=True):
            if answer is None:
                self._last.pop(slot, None)
                continue
            self._last[slot] = answer
            for p in answer[1]:
                round_.setdefault(p, set()).add(answer[0])
        return round_

    def run(self) -> None:
        while not self._halt.is_set():
            started = time.monotonic()
            round_ = self.serving_now()
            self.samples.append((time.time(), round_))
            self._halt.wait(max(0.0, STATUS_POLL_S - (time.monotonic() - started)))

    def all_served(self) -> bool:
        return bool(self.samples) and all(self.samples[-1][1].values())

    def settled(self, pid: int | None = None) -> bool:
        """Every partition served, and by process `pid` too when given (a joiner)."""
        if not self.all_served():
            return False
        return pid is None or any(pid in pids for pids in self.samples[-1][1].values())

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        self._pool.shutdown(wait=True)

    def episodes(self, partition: int) -> list[Episode]:
        """Each process's unbroken serving of `partition`, in time order."""
        open_: dict[int, Episode] = {}
        done: list[Episode] = []
        for t, round_ in self.samples:
            pids = round_.get(partition, set())
            for pid in list(open_):
                if pid not in pids:
                    done.append(open_.pop(pid))
            for pid in pids:
                if pid in open_:
                    open_[pid].last = t
                else:
                    open_[pid] = Episode(pid, t, t)
        done += open_.values()
        return sorted(done, key=lambda e: e.first)

    def longest_gap(self, partition: int, until: float) -> float:
        """Longest time between two rounds that saw `partition` served, from the first
        such round (to `until` if it was never served again)."""
        seen = [t for t, round_ in self.samples if round_.get(partition)]
        if not seen:
            return float("inf")
        gaps = [b - a for a, b in itertools.pairwise(seen)]
        if self.samples and not self.samples[-1][1].get(partition):
            gaps.append(until - seen[-1])
        return max(gaps, default=0.0)


def moves(episodes: list[Episode]) -> list[float]:
    """When the partition stopped being served by one process (the last round that saw
    it there) and was later served again, by another process or the same one anew."""
    return sorted(e.last for e in episodes[:-1]) if len(episodes) > 1 else []


# --- the faults ---------------------------------------------------------------------------------


@dataclass
class FleetEvent:
    kind: str
    """join, sigterm or sigkill."""
    slot: int
    at: float = 0.0
    detail: str = ""


class Events(threading.Thread):
    """The join, the SIGTERM and the SIGKILL at 25, 50 and 75% of production, each once
    the fleet has settled after the one before (`settled`, waited for at most
    SETTLE_WAIT_S): on a loaded machine a late start of the joining process put the
    SIGTERM's hand-over on the member the SIGKILL then removed, so one partition waited
    through two moves and a session timeout back to back (20.5 s unserved), which says
    nothing about how long one move takes."""

    def __init__(
        self, fleet: ProxyFleet, options: FleetOptions, settled: Callable[[int | None], bool]
    ) -> None:
        super().__init__(name="fleet-events", daemon=True)
        self._fleet = fleet
        self._options = options
        self._settled = settled
        self._halt = threading.Event()
        self.start_at = 0.0
        self.records: list[FleetEvent] = []
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        plan = [
            (0.25, FleetEvent("join", self._options.processes)),
            (0.50, FleetEvent("sigterm", 1)),
            (0.75, FleetEvent("sigkill", 2)),
        ]
        joined: int | None = None
        try:
            for share, event in plan:
                wait = self.start_at + share * self._options.duration_s - time.time()
                if self._halt.wait(max(0.0, wait)):
                    return
                settle_by = time.monotonic() + SETTLE_WAIT_S
                while not self._settled(joined) and time.monotonic() < settle_by:
                    if self._halt.wait(STATUS_POLL_S):
                        return
                event.at = time.time()
                self.records.append(event)
                if event.kind == "join":
                    self._fleet.start(event.slot)
                    event.detail = f"pid {self._fleet.procs[event.slot].pid}"
                    joined = self._fleet.procs[event.slot].pid
                    continue
                proc = self._fleet.procs[event.slot]
                self._fleet.exits[event.slot] = -1  # told to: not an unexpected exit
                sig = signal.SIGTERM if event.kind == "sigterm" else signal.SIGKILL
                self._fleet.signal(event.slot, sig)
                code = proc.wait(STOP_PROXY_S)
                self._fleet.exits[event.slot] = code
                event.detail = f"pid {proc.pid} exited {code} after {time.time() - event.at:.1f} s"
        except BaseException as exc:  # noqa: BLE001 - handed to the supervisor loop
            self.error = exc
        finally:
            self.finished.set()

    def stop(self) -> None:
        self._halt.set()
        self.join(STOP_PROXY_S + 5)


# --- verification ------------------------------------------------------------------------------


@dataclass
class FleetReport:
    options: FleetOptions
    run_dir: Path
    unfinished: str = ""
    wall_s: float = 0.0
    produced: int = 0
    acked: int = 0
    dead_lettered: int = 0
    lost: list[tuple[int, int]] = field(default_factory=list)
    not_exact: list[tuple[int, int]] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    crash_pills: int = 0
    crash_pills_dead: int = 0
    crash_attempts: Counter[int] = field(default_factory=Counter)
    instance_crashes: int = 0
    invocations: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    ends: dict[int, int] = field(default_factory=dict)
    committed: dict[int, int] = field(default_factory=dict)
    gaps: dict[int, float] = field(default_factory=dict)
    moves: dict[int, list[float]] = field(default_factory=dict)
    per_move: dict[tuple[int, int], int] = field(default_factory=dict)
    """(partition, move index) -> duplicates it caused."""
    window: int = 0
    events: list[FleetEvent] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    produce_errors: list[str] = field(default_factory=list)
    written_twice: int = 0
    """Records the producer wrote twice (a resent batch): each copy must be settled."""
    collateral_dead: int = 0
    """Dead-lettered messages whose behaviour never asked for it (attempts used up by
    crashes of the instance they were in flight at)."""
    blamed_unrun: Counter[tuple[int, int]] = field(default_factory=Counter)
    """Healthy messages' attempts used up with no handler run (an attempt number missing
    from the message's invocations below its last one): a crash blamed it while it was
    reported started and not yet running. Reported, not judged: it shows how close the
    run came to dead-lettering a healthy message."""
    collateral: list[str] = field(default_factory=list)
    """Each of those: where it was, and the attempts its handler ran (an attempt missing
    there was used up by a crash before its handler started)."""


def cause_of(prev: Invocation, cur: Invocation, move_times: list[float]) -> str:
    """Why `cur` followed `prev` for the same message (verify.redelivery_cause, with the
    partition's moves in place of proxy kills)."""
    if prev.plan == "retry":
        return "retry"
    if prev.plan == "crash":
        return "own crash"
    candidates: list[tuple[float, str]] = []
    move = first_kill_between(move_times, prev.t, cur.t)
    if move is not None:
        candidates.append((move_times[move], "partition move"))
    inc = prev.incarnation
    died = inc.killed_at if inc.fate == "killed" else inc.ended
    unsettled = prev.done_t is None or (
        prev.ack_may_be_lost and (died or 0.0) - prev.done_t < SETTLE_SLACK_S
    )
    if died is not None and died <= cur.t and unsettled and inc.fate == "crashed":
        candidates.append((died, "crash collateral"))
    if candidates:
        return min(candidates)[1]
    if prev.plan == "slow" and (prev.done_t is None or prev.done_t > cur.t):
        return "deadline"
    return "other"


class TopicLog:
    """The topic as the broker holds it: the authority on which record sits where.

    Why not the producer's delivery reports: a producer that resends a batch (a request
    that timed out on the loaded broker) writes its records twice, and its report names
    only the second copy; both copies are messages the proxies must settle."""

    def __init__(self, bootstrap: str, partitions: int) -> None:
        from confluent_kafka import Consumer

        self._partitions = partitions
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"fault-log-{time.time_ns()}",
                **KafkaLog().config(),
            }
        )

    def ends(self) -> dict[int, int]:
        from confluent_kafka import TopicPartition

        return {
            p: self._consumer.get_watermark_offsets(
                TopicPartition(TOPIC, p), timeout=10, cached=False
            )[1]
            for p in range(self._partitions)
        }

    def records(self, at_least: dict[int, int]) -> dict[tuple[int, int], int]:
        """(partition, offset) -> the index its value carries, for every record up to the
        end of each partition (the greater of the broker's high watermark and
        `at_least`, e.g. what the group committed)."""
        from confluent_kafka import TopicPartition

        fresh = self.ends()
        ends = {p: max(fresh[p], at_least.get(p, 0)) for p in fresh}
        found: dict[tuple[int, int], int] = {}
        reached = {p: 0 for p in ends}
        self._consumer.assign([TopicPartition(TOPIC, p, 0) for p in range(self._partitions)])
        deadline = time.monotonic() + 180
        while any(reached[p] < ends[p] for p in ends) and time.monotonic() < deadline:
            for message in self._consumer.consume(5000, 1.0):
                partition, offset = message.partition(), message.offset()
                if message.error() is None and partition is not None and offset is not None:
                    index = int((message.value() or b"-:-1").split(b":", 1)[1])
                    found[(partition, offset)] = index
                    reached[partition] = max(reached[partition], offset + 1)
        return found

    def close(self) -> None:
        self._consumer.close()


def verify_fleet(
    report: FleetReport,
    workload: Workload,
    records: dict[tuple[int, int], int],
    history: list[Incarnation],
    dead: list[Any],
) -> None:
    """Every record of the log (`records`: (partition, offset) -> index) against the
    handlers' logs and the dead-letter table. An invocation's record is (its index's
    partition, its offset): the instance log names the offset and the index."""
    options = report.options
    partitions = options.partitions
    report.produced = len(records)
    report.written_twice = len(records) - len(set(records.values()))
    for pos, index in records.items():
        if pos[0] != index % partitions:
            report.mismatched.append(f"index {index} found in partition {pos[0]}")
    invocations, torn = read_invocations(history)
    # As in the single-partition suite, only an instance's latest completions can have
    # died with it unacked (the rest are a move's or another fault's); but an instance
    # here holds a stream per partition, each with its own `credits`. Bounded by one
    # stream's credits, the acks a crash lost beyond them were charged to the next move
    # of their partition (they wait as suspects meanwhile): 203 of one move's 208 in a
    # full run were such completions, each less than 1 s before its instance crashed.
    mark_acks_sent(invocations, options.base().credits * options.partitions)
    if torn:
        report.mismatched.append(f"{torn} torn log lines")
    by_record: dict[tuple[int, int], list[Invocation]] = defaultdict(list)
    for inv in invocations:
        pos = (inv.index % partitions, inv.offset)
        if records.get(pos) != inv.index:
            report.mismatched.append(f"index {inv.index} delivered at {pos}: {records.get(pos)}")
            continue
        if inv.plan != plan_for(workload.behaviours[inv.index], inv.attempt):
            report.mismatched.append(f"index {inv.index} attempt {inv.attempt}: {inv.plan}")
        by_record[pos].append(inv)
    report.invocations = len(invocations)
    acked = {pos for pos, invs in by_record.items() if any(v.done_t is not None for v in invs)}
    report.acked = len(acked)

    dead_at = {(dl.record.partition, dl.record.offset): dl for dl in dead}
    report.dead_lettered = len(dead_at)
    for pos, dl in sorted(dead_at.items()):
        found = records.get(pos)
        if found is None or dl.record.value != workload.value(found):
            report.not_exact.append(pos)
        elif workload.behaviours[found] not in ("nack", "crash"):
            report.collateral_dead += 1
            ran = sorted({inv.attempt for inv in by_record.get(pos, [])})
            report.collateral.append(
                f"partition {pos[0]} offset {pos[1]} (index {found}, "
                f"{workload.behaviours[found]}): dead-lettered at attempts {dl.attempts}, "
                f"its handler ran at attempts {ran}"
            )
    for pos, invs in by_record.items():
        if workload.behaviours[invs[0].index] in ("nack", "crash"):
            continue
        tried = {inv.attempt for inv in invs}
        missing = sum(1 for attempt in range(1, max(tried)) if attempt not in tried)
        if missing:
            report.blamed_unrun[pos] = missing
    for pos, index in sorted(records.items()):
        partition, offset = pos
        if pos not in acked and pos not in dead_at and offset < report.committed.get(partition, -1):
            report.lost.append(pos)
        if workload.behaviours[index] == "crash":
            report.crash_pills += 1
            dl = dead_at.get(pos)
            if dl is not None:
                report.crash_pills_dead += 1
                report.crash_attempts[dl.attempts] += 1

    for (partition, _), invs in by_record.items():
        move_times = report.moves.get(partition, [])
        invs.sort(key=lambda i: i.t)
        causes = []
        for a, b in itertools.pairwise(invs):
            cause = cause_of(a, b, move_times)
            causes.append(cause)
            if cause == "partition move":
                move = first_kill_between(move_times, a.t, b.t)
                assert move is not None
                key = (partition, move)
                report.per_move[key] = report.per_move.get(key, 0) + 1
        budget = expected_budget(workload.behaviours[invs[0].index], options.max_attempts)
        for cause in causes:
            report.causes[cause] += 1
        for cause in EXPECTED:
            excess = max(0, causes.count(cause) - budget[cause])
            if not excess:
                continue
            # e.g. a crash pill starting its attempts again on the partition's new process
            move = first_kill_between(move_times, invs[0].t, invs[-1].t)
            if move is None:
                report.causes["other"] += excess
            else:
                key = (partition, move)
                report.per_move[key] = report.per_move.get(key, 0) + excess
                report.causes["partition move"] += excess
            report.causes[cause] -= excess


def checks(report: FleetReport) -> list[tuple[str, bool]]:
    most = max(report.per_move.values(), default=0)
    longest = max(report.gaps.values(), default=float("inf"))
    ends_met = all(report.committed.get(p, -1) >= end for p, end in report.ends.items())
    return [
        ("the run finished (every commit at its partition's end)", not report.unfinished),
        ("every partition's commit reached its end", ends_met and bool(report.ends)),
        ("lost == 0", not report.lost),
        ("dead letters byte-exact", not report.not_exact),
        ("every invocation matches what was produced", not report.mismatched),
        (
            f"every crash pill dead-lettered ({report.crash_pills_dead}/{report.crash_pills})",
            report.crash_pills_dead == report.crash_pills,
        ),
        (
            f"no healthy message dead-lettered ({report.collateral_dead})",
            report.collateral_dead == 0,
        ),
        (
            f"duplicates per partition move <= the in-flight window {report.window} (most: {most})",
            most <= report.window,
        ),
        (
            f"no partition unserved for more than {MAX_GAP_S:g} s (longest {longest:.1f} s)",
            longest <= MAX_GAP_S,
        ),
        ("no fleet process exited on its own", not report.unexpected_exits),
    ]


def render(report: FleetReport) -> str:
    o = report.options
    lines = [
        f"fleet scenario: {o.processes} processes (+1 joins, 1 SIGTERM, 1 SIGKILL) on "
        f"{o.partitions} partitions, {o.instances} instances x {o.concurrency} handlers, "
        f"seed {o.seed}",
        f"  wall time                 {report.wall_s:.1f} s {report.unfinished}",
        f"  records in the topic      {report.produced} ({report.written_twice} written "
        "twice by the producer)",
        f"  acked / dead-lettered     {report.acked} / {report.dead_lettered}",
        f"  lost                      {len(report.lost)}",
        f"  crash pills dead-lettered {report.crash_pills_dead}/{report.crash_pills} "
        f"(attempts: {dict(sorted(report.crash_attempts.items()))})",
        f"  instance crashes          {report.instance_crashes}",
        f"  dead-lettered, not asked  {report.collateral_dead} (attempts used up by crashes)",
        f"  healthy attempts blamed   {sum(report.blamed_unrun.values())} with no handler run, "
        f"on {len(report.blamed_unrun)} messages (most on one: "
        f"{max(report.blamed_unrun.values(), default=0)})",
        f"  invocations               {report.invocations}",
        f"  redeliveries by cause     {dict(report.causes.most_common())}",
        f"  in-flight window          {report.window} per partition",
    ]
    for text in report.collateral[:10]:
        lines.append(f"  dead-lettered, not asked: {text}")
    for event in report.events:
        lines.append(f"  event {event.kind:<8} slot {event.slot}: {event.detail}")
    for p in sorted(report.ends):
        moved = report.moves.get(p, [])
        dups = [report.per_move.get((p, i), 0) for i in range(len(moved))]
        lines.append(
            f"  partition {p}: end {report.ends[p]}, committed {report.committed.get(p)}, "
            f"longest unserved {report.gaps.get(p, float('inf')):.1f} s, "
            f"{len(moved)} moves, duplicates per move {dups}"
        )
    for text in report.unexpected_exits:
        lines.append(f"  unexpected exit: {text}")
    for text in report.produce_errors[:5]:
        lines.append(f"  producer: {text}")
    for pos in report.lost[:10]:
        lines.append(f"  lost: partition {pos[0]} offset {pos[1]}")
    for text in report.mismatched[:5]:
        lines.append(f"  mismatch: {text}")
    return "\n".join(lines)


# --- the run -----------------------------------------------------------------------------------


def run_fleet(options: FleetOptions) -> FleetReport:
    """One run against a fresh stack; every process it starts is stopped before it returns."""
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="triage-fault-fleet-"))
    run_dir = work_dir / "fleet"
    run_dir.mkdir(parents=True, exist_ok=True)
    report = FleetReport(options, run_dir)
    base = options.base()
    workload = Workload.generate(options.messages, dict(base.shares), options.seed)

    with contextlib.ExitStack() as cleanup:
        stack = DevStack(
            topic=TOPIC,
            partitions=options.partitions,
            state_dir=run_dir / "stack",
            proxy_overrides=proxy_overrides(base),
            start_proxies=False,
        )
        stack.start()
        cleanup.callback(stack.stop)
        from triage_proxy.config.loader import load_settings

        settings = load_settings(stack.config_path)
        report.window = min(base.in_flight_window, settings.window.max_messages)
        proxies = ProxyFleet(stack, run_dir)
        cleanup.callback(proxies.stop)
        poller = ServingPoller(proxies, options.partitions)
        cleanup.callback(poller.stop)
        for slot in range(options.processes):
            proxies.start(slot)
        poller.start()
        deadline = time.monotonic() + FLEET_READY_S
        while not poller.all_served():
            if time.monotonic() > deadline:
                report.unfinished = "the fleet never served every partition"
                return report
            time.sleep(STATUS_POLL_S)

        instances = Fleet(run_dir, proxies.target(0), stack.token, options.instances, base)
        cleanup.callback(instances.stop)
        watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, TOPIC, options.partitions)
        cleanup.callback(watcher.close)
        log = TopicLog(stack.broker.bootstrap, options.partitions)
        cleanup.callback(log.close)
        producer = Production(
            stack.broker.bootstrap, workload, options.duration_s, 0.0, options.partitions
        )
        cleanup.callback(producer.stop)
        events = Events(proxies, options, poller.settled)
        cleanup.callback(events.stop)

        instances.start()
        producer.start()
        started = events.start_at = time.time()
        events.start()
        report.unfinished = _supervise(
            report, options, instances, proxies, producer, events, watcher, log
        )
        report.wall_s = time.time() - started
        events.stop()
        instances.stop()
        producer.stop()
        poller.stop()
        proxies.stop()
        dead = scan_dead_letters(stack)
        records = log.records(report.committed)

    now = time.time()
    report.events = events.records
    report.unexpected_exits = proxies.unexpected
    report.produce_errors = producer.errors[:10]
    report.instance_crashes = sum(1 for i in instances.history if i.fate == "crashed")
    for p in range(options.partitions):
        report.gaps[p] = poller.longest_gap(p, now)
        report.moves[p] = moves(poller.episodes(p))
    for partition, offset in records:  # the end, as the records in the topic say
        report.ends[partition] = max(report.ends.get(partition, 0), offset + 1)
    verify_fleet(report, workload, records, instances.history, dead)
    return report


def _supervise(
    report: FleetReport,
    options: FleetOptions,
    instances: Fleet,
    proxies: ProxyFleet,
    producer: Production,
    events: Events,
    watcher: CommitWatcher,
    log: TopicLog,
) -> str:
    """Restart exited instances until every commit reached its end; why it ended early."""
    deadline = time.monotonic() + options.duration_s + options.timeout_s
    next_commit_read = 0.0
    while True:
        instances.supervise()
        proxies.check()
        if events.error is not None:
            return f"aborted: {events.error!r}"
        due = time.monotonic() >= next_commit_read
        if producer.finished.is_set() and events.finished.is_set() and due:
            next_commit_read = time.monotonic() + 0.5
            with contextlib.suppress(Exception):
                # The broker's end, read afresh each time: it once answered a stale one.
                produced: dict[int, int] = defaultdict(int)
                for partition, offset in producer.positions.values():
                    produced[partition] = max(produced[partition], offset + 1)
                fresh = log.ends()
                report.ends = {p: max(fresh[p], produced[p]) for p in fresh}
                report.committed = dict(enumerate(watcher.offsets()))
            ends = report.ends.items()
            if ends and all(report.committed.get(p, -1) >= e for p, e in ends):
                return ""
        if time.monotonic() > deadline:
            with contextlib.suppress(Exception):
                report.committed = dict(enumerate(watcher.offsets()))
            return f"timed out (committed {report.committed})"
        time.sleep(TICK_S)


# --- command line ------------------------------------------------------------------------------


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    defaults = FleetOptions()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--partitions", type=int, default=defaults.partitions)
    parser.add_argument("--processes", type=int, default=defaults.processes)
    parser.add_argument("--instances", type=int, default=defaults.instances)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--crash-share", type=float, default=defaults.crash_share)
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts)
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.processes < 3:
        parser.error("--processes: at least 3 (slots 1 and 2 are stopped, slot 0 stays)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_exit)
    options = FleetOptions(
        messages=args.messages,
        partitions=args.partitions,
        processes=args.processes,
        instances=args.instances,
        concurrency=args.concurrency,
        crash_share=args.crash_share,
        max_attempts=args.max_attempts,
        duration_s=args.duration_s,
        seed=args.seed,
        timeout_s=args.timeout_s,
        work_dir=args.work_dir or Path(tempfile.mkdtemp(prefix="triage-fault-fleet-")),
    )
    print(
        f"fault suite, fleet scenario: {options.messages} messages over "
        f"{options.duration_s:.0f} s, logs in {options.work_dir}",
        flush=True,
    )
    report = run_fleet(options)
    print(render(report))
    results = checks(report)
    for text, passed in results:
        print(f"{'PASS' if passed else 'FAIL'}  {text}")
    return 0 if all(passed for _, passed in results) else 1


if __name__ == "__main__":
    sys.exit(main())
