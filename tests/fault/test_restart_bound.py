"""A kill -9 inside a restarted proxy's reconnection burst redelivers at most the window.

Why: a restarted proxy's instances reconnect to a backlog and settle it far faster than
the commit interval; before the window counted records until their settlement was
durably recorded, a second kill in that burst redelivered everything settled since the
last commit (932 in one fault-suite kill, against an in-flight window of 96). Here the
real processes (Tansu, moto server, the proxy, two fault-suite instances that log every
invocation before acting) go through: a kill -9 of the idle proxy while a backlog is
produced, a restart, a kill -9 once the instances have completed twice the window of
that backlog, a restart, a kill -9 as soon as they completed a few records, a restart.
Each burst kill must find the backlog not yet committed. Then every produced record must
be acked or dead-lettered (2% are nacked) and each
kill's duplicates (tests/fault/verify.py: every handler invocation after an offset's
first, charged to the kill between the two, each kill once per offset, and only what its
replacement delivered: verify.kill_redelivering) at most window.max_messages.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.fault.processes import CommitPoller, Fleet, restart_proxy
from tests.fault.report import Report
from tests.fault.scenario import TOPIC, Options, Workload, proxy_overrides
from tests.fault.verify import scan_dead_letters, verify
from triage_cli.devstack import DevStack
from triage_proxy.kafka.logs import KafkaLog

# Kills inside catch-up bursts want the CPU the bursts need: with the other CPU-heavy
# tests on one worker (--dist loadgroup).
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("cpu-heavy")]

INSTANCES = 2
CONCURRENCY = 16
WINDOW = INSTANCES * 2 * CONCURRENCY
"""window.max_messages: the instances' in-flight window (credits are 2 x concurrency)."""
WARM_UP = 200
BACKLOG = 3000
"""Produced while the proxy is down: the burst its restart meets."""
BURST_WAIT_S = 60.0
"""Most time for the instances to get into a burst (generous: a busy 2-core machine)."""
FINISH_S = 90.0


class Logs:
    """Counts completed handler invocations in the instances' logs, reading what is new."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._read: dict[Path, int] = {}
        self.done_times: list[float] = []

    def poll(self) -> None:
        for log in sorted(self._dir.glob("*.log")):
            start = self._read.get(log, 0)
            with open(log, "rb") as f:
                f.seek(start)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # a line being written waits for the next poll
            self._read[log] = start + end
            for line in chunk[:end].splitlines():
                parts = line.split()
                if len(parts) == 5 and parts[3] == b"done":
                    self.done_times.append(float(parts[4]))

    def done_since(self, since: float) -> int:
        self.poll()
        return sum(1 for t in self.done_times if t >= since)


def produce(bootstrap: str, workload: Workload, indexes: range, offsets: dict[int, int]) -> None:
    """Produce `indexes` of the workload and wait for every delivery report."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **KafkaLog().config()})

    def delivered(err: object, msg: object) -> None:
        assert err is None, err
        index = int(msg.value().split(b":", 1)[1])  # type: ignore[attr-defined]
        offsets[index] = msg.offset()  # type: ignore[attr-defined]

    for index in indexes:
        producer.produce(
            TOPIC, value=workload.value(index), key=str(index).encode(), on_delivery=delivered
        )
        producer.poll(0)
    assert producer.flush(60) == 0


def wait_for(predicate: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not in {within:g} s: {what}"
        time.sleep(0.01)


@pytest.mark.usefixtures("cpu_heavy")  # kills inside bursts want the CPU to itself
def test_a_kill_inside_a_reconnection_burst_redelivers_at_most_the_window(
    tmp_path: Path,
) -> None:
    messages = WARM_UP + 2 * BACKLOG
    options = Options(
        messages=messages,
        proxy_kills=3,
        consumer_kills=0,
        outage_s=0.0,
        instances=INSTANCES,
        concurrency=CONCURRENCY,
        seed=26,
        work_dir=tmp_path,
        shares=(("nack", 0.02),),
    )
    workload = Workload.generate(messages, dict(options.shares), options.seed)
    overrides = proxy_overrides(options)
    overrides["window"] = {"max_messages": WINDOW}
    report = Report(options, tmp_path)
    offsets: dict[int, int] = {}
    kills: list[float] = []
    committed_at_kill: list[int] = []
    restarts: list[tuple[float, float]] = []
    """Per kill: when its replacement was started, when it listened (verify.py)."""

    def restart() -> float:
        """Restart the proxy; returns when the replacement listened."""
        started = time.time()
        restart_proxy(stack)
        restarts.append((started, time.time()))
        return restarts[-1][1]

    stack = DevStack(topic=TOPIC, state_dir=tmp_path / "stack", proxy_overrides=overrides)
    stack.start()
    try:
        target = stack.describe()["proxies"][0]["target"]
        fleet = Fleet(tmp_path, target, stack.token, INSTANCES, options)
        poller = CommitPoller(stack)
        try:
            fleet.start()
            poller.start()
            logs = Logs(tmp_path / "instances")

            def kill() -> None:
                kills.append(time.time())
                stack.stop_proxy(0, signal.SIGKILL)
                committed_at_kill.append(poller.committed)

            produce(stack.broker.bootstrap, workload, range(WARM_UP), offsets)
            wait_for(lambda: poller.committed >= WARM_UP, FINISH_S, "the warm-up committed")

            kill()  # idle: the backlog builds up behind it
            produce(stack.broker.bootstrap, workload, range(WARM_UP, WARM_UP + BACKLOG), offsets)
            restarted = restart()
            wait_for(
                lambda: logs.done_since(restarted) >= 2 * WINDOW,
                BURST_WAIT_S,
                "the instances completing twice the window after the restart",
            )
            kill()  # deep in the burst

            produce(stack.broker.bootstrap, workload, range(WARM_UP + BACKLOG, messages), offsets)
            restarted = restart()
            wait_for(
                lambda: logs.done_since(restarted) >= WINDOW // 4,
                BURST_WAIT_S,
                "the instances completing a few records after the restart",
            )
            kill()  # at the start of the burst
            restart()

            wait_for(lambda: poller.committed >= messages, FINISH_S, "everything committed")
            report.committed = poller.committed
        finally:
            fleet.stop()
            poller.stop()
        dead = scan_dead_letters(stack)
    finally:
        stack.stop()

    report.proxy_kills = len(kills)
    (tmp_path / "kills.json").write_text(json.dumps({"kills": kills, "restarts": restarts}))
    verify(report, workload, offsets, fleet.history, dead, kills, restarts)
    per_kill = [report.per_kill[i] for i in range(len(kills))]
    summary = (
        f"duplicates per kill {per_kill} (window {WINDOW}); by cause "
        f"{dict(report.duplicates_by_cause)}; acked {report.acked}, dead-lettered "
        f"{report.dead_lettered}, lost {report.lost[:10]}"
    )
    print(summary)
    assert report.produced == messages, summary
    assert report.lost == [], summary
    assert report.acked + report.dead_lettered == messages, summary
    assert not report.not_exact, summary
    assert not report.mismatched, summary
    assert max(per_kill) <= WINDOW, summary
    # The burst kills did land in bursts: the backlog was not committed yet.
    assert committed_at_kill[1] < WARM_UP + BACKLOG, committed_at_kill
    assert committed_at_kill[2] < messages, committed_at_kill
