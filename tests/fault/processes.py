"""The processes a fault-suite run starts, kills, stalls and stops, each by PID.

The producer and the commit poller are threads; consumer instances (the fleet) are
processes of tests/fault/instance.py; the fault runner kill -9s and SIGSTOPs the proxy,
instances, the broker and moto one fault at a time and never leaves one stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException, Producer

from tests.commit_watcher import CommitWatcher
from tests.fault.scenario import SLOW_FACTOR, TOPIC, Fault, Options, Workload
from triage_cli.devstack import DevStack
from triage_proxy.kafka.logs import KafkaLog

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]

FAULT_GAP_S = 0.5
"""Least time between the end of one fault and the start of the next."""
PROXY_DOWN_S = (0.1, 1.0)
"""Range of the time a killed proxy stays down before it is restarted."""
PROXY_START_TRIES = 5
TICK_S = 0.05
STOP_INSTANCE_S = 10.0


class Production(threading.Thread):
    """Produces the workload at a steady rate; records the offset of every index.

    With `partitions` > 1 (the fleet scenario) index i goes to partition i % partitions
    and `positions` says where each one landed."""

    def __init__(
        self,
        bootstrap: str,
        workload: Workload,
        duration_s: float,
        outage_s: float,
        partitions: int = 1,
        linger_ms: int = 5,
    ) -> None:
        super().__init__(name="producer", daemon=True)
        patience_ms = int(max(120.0, 3 * outage_s) * 1000)
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "linger.ms": linger_ms,
                # Ride out a SIGSTOPped broker without a timeout-driven resend, which could
                # write a record twice and move the end of the partition.
                "request.timeout.ms": patience_ms,
                "socket.timeout.ms": patience_ms,
                "message.timeout.ms": 0,
                **KafkaLog().config(),
            }
        )
        self._workload = workload
        self._duration_s = duration_s
        self._halt = threading.Event()
        self._partitions = partitions
        self.offsets: dict[int, int] = {}
        """index -> offset, from the delivery reports."""
        self.positions: dict[int, tuple[int, int]] = {}
        """index -> (partition, offset), from the delivery reports."""
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
        self.positions[index] = (msg.partition(), msg.offset())

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
                        partition=index % self._partitions,
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
                    "tests.fault.instance",
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

    def restart_one(self, rng: random.Random) -> Incarnation | None:
        """SIGTERM a random live instance, as a deploy would (it releases what it never
        started and finishes its running handlers); the supervisor starts a new one."""
        with self._lock:
            alive = [i for i in self._live.values() if i.proc.poll() is None]
            if not alive:
                return None
            victim = rng.choice(sorted(alive, key=lambda i: i.slot))
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.proc.pid, signal.SIGTERM)
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


@dataclass
class FaultRecord:
    kind: str
    started: float
    ended: float = 0.0
    detail: str = ""


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
