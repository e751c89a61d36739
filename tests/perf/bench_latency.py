"""Added latency: produce -> handler start through Triage vs a plain confluent-kafka consumer.

The producer (this process) produces at a steady rate, 1,000 msg/s then 10,000 msg/s for
30 s each (`--rates`, `--seconds`), stamping each value with time.monotonic_ns(). Two
consumer processes read the same partition at the same time (tests/perf/latency_instance.py):
one instance through Triage (one Consumer, async no-op handler, `--concurrency` 64,
`--prefetch` 960; `--sync` for a sync handler) and a plain confluent-kafka consumer (its
defaults, a poll loop). Each records now - produced at handler start, so both use one clock
(CLOCK_MONOTONIC) on the same messages under the same load.

"Added" is the per-message difference, Triage minus plain for the same message; its p50,
p99 and max are what the targets judge: added p50 <= 2 ms and p99 <= 10 ms at 1k msg/s,
added p99 <= 20 ms at 10k msg/s. Beside it: a control, a second plain consumer minus the
first, the floor of that difference on this broker (Tansu answers a fetch that finds
nothing new only when fetch.wait.max.ms runs out, and its produce stalls release messages
to each consumer's fetch at different moments; no consumer can remove that), and the
difference of the two distributions' percentiles.

The broker's wait (`--fetch-wait-ms`, default 10): the proxy (`kafka.fetch_wait_ms`) and
both plain consumers (fetch.wait.max.ms) use the same one, so both sides wait on the
broker alike. Tansu holds a fetch that finds nothing new for the whole wait, even when
a record arrives meanwhile (a Kafka broker answers at once), so every consumer's
latency carries up to that wait of phase noise: at the proxy's default 100 ms it is
what the control measures, and it swamps the targets. A short wait bounds that noise;
`--fetch-wait-ms 100` measures at the default. What the short wait costs the broker
(more empty fetches) is measured first: Tansu's CPU over `--idle-seconds` with every
consumer connected and nothing produced. Measured (2 cores, 3 consumers): idle, Tansu
used 2-3% of a core at 100 ms, 6% at 20, 9-10% at 10, 10-18% at 5; at 1k msg/s about
28% / 38% / 66% / 61-94%. At 5 ms the broker became the bottleneck and the 10k phase
collapsed (phases of 46-194 s instead of 30), hence 10.

What else was tried on both sides alike (1k msg/s, 30 s, 2 rounds each, load 5.5-8.7 on
2 cores; Tansu's CPU / produce-ack p99 / control p99): the defaults 17-20 s / 1.1-1.7 s /
307-397 ms; socket.nagle.disable on every consumer 18-20 s / 0.36-1.5 s / 55-278 ms (no
consistent change); fetch wait 5 ms 15 s / 1.0-1.9 s / 641-942 ms (worse); the producer's
linger.ms 20 instead of 5: 6.7-7.6 s / 50-129 ms / 11-27 ms. Tansu's CPU goes with the
produced batches, not the messages (and grows with the log), and a Tansu starved of CPU
answers produces and fetches hundreds of ms late, at different moments for each consumer:
that, not the fetch wait, is most of the control's tail on the loaded machine.
Hence the producer's linger of 20 ms by default (`--linger-ms`): fair to both sides (one
producer, the same records), it adds about its own 15 ms to the absolute figures, not to
the difference. fetch.queue.backoff.ms and
queued.min.messages act only when a consumer's local queue is over its cap (10,000
messages in the proxy, 100,000 in the plain consumers), which the runs never reached (the
proxy's window, 10,000, was never full either: `fetching paused` below); fetch.min.bytes
above its default 1 could only make Tansu hold data back for more (not measured).

Each phase runs on a fresh stack (broker, proxy, consumers): Tansu's in-memory log costs
it more CPU per record the longer the log is: in four runs with the 10k phase on a used
log (after the 1k phase, or after another 10k phase) it cost Tansu 44.6-62.0 us per record
against 20.9-30.3 on a fresh log, and the control's p99 was 7.4-14.7 ms against 4.4-7.1.
A Kafka broker finds a fetch's offset through its index, whatever the log's length, so
the phases do not inherit each other's log; `--shared-log` runs them on one broker.

Why prefetch 960 (1,024 credits, 100 ms of 10k msg/s): the plain consumer's librdkafka
prefetches up to 100,000 messages, while a Triage stream has at most its credits in
flight, so a stream whose rate x credit round trip exceeds them falls behind and the
figure becomes its queue. With the Consumer's default prefetch (= concurrency, 128
credits) at 10k msg/s on the loaded 2-core machine, records waited for credits in the
proxy and Triage added 150-480 ms at p50; `--prefetch 64` shows it.

Per phase it also prints what each process cost and how long it waited for a CPU
(/proc/<pid>/task/*/schedstat: CPU time, and time runnable but not running; the main
thread's wait alone, the event loop's for Triage) and the share of the phase in which some
task on the machine waited (/proc/pressure/cpu): on the shared 2-core machine the 10k
phase is bound by CPU, and these say by how much, from the same run.

Commit lag: the proxy runs with the default commit.interval_s; after each phase and for
`--probes` single messages produced 1-2 s apart at random (so they fall at every phase of
the commit interval, not at one), the time from the last handler's return to the
committed offset covering it (the commit is polled every 5 ms).

Where Triage's latency goes (after the figures above, per phase): the proxy runs under
tests/perf/traced_proxy.py (the real `triage proxy`, with per-batch timestamps of where
each record is; nothing on the wire changes) and the Triage consumer stamps when it
unpacks each frame, so each message's produce -> handler start splits into
produce -> the proxy's Kafka read returned it (the broker's part: what a plain consumer
also waits, with its own phase of the fetch wait) and that read -> handler start (what
Triage itself adds), itself split into its stages: the fetch thread's hand-off to the
event loop, the wait for credits, the outbox, the gRPC hop and the client's
queue. Beside them, the proxy's event-loop lag (how late a 10 ms timer ran), where its
stalls went (the loop thread's schedstat), the garbage collector's pauses in the proxy and
the client (gc.callbacks), and how long the window was full: then the
fetcher pauses and records wait in librdkafka's queue, which this split counts in the
broker's part although it is Triage's backpressure.
`--client PROP=VALUE` sets a librdkafka property on every consumer alike (the proxy's,
through [kafka.client], and both plain ones), `--linger-ms` the producer's linger: what
the broker-side settings cost and buy is measured with them.
`--no-trace` runs the plain `triage proxy` (for comparing with a checkout without the
wrapper).

    .venv/bin/python -m tests.perf.bench_latency [--seconds 30] [--rates 1000,10000]
        [--probes 10] [--prefetch 960] [--sync] [--fetch-wait-ms 10] [--idle-seconds 5]
        [--no-trace] [--save FILE.json] [--client PROP=VALUE ...] [--linger-ms 20]
        [--shared-log]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Producer

from tests.commit_watcher import CommitWatcher
from tests.perf.common import ROOT, table
from triage_cli.devstack import DevStack
from triage_cli.embedded import HOST, stop_process, wait_for_port
from triage_cli.supervisor import proxy_command
from triage_proxy.config.loader import load_settings

TARGETS = {1000: (2.0, 10.0), 10_000: (None, 20.0)}
"""rate -> (added p50, added p99) targets in ms (None: no target)."""
WARM_UP = 0
PROBE = 99
WARM_TIMEOUT_S = 60.0
COMMIT_POLL_S = 0.005
FLUSH_TIMEOUT_S = 180.0
PRODUCE_TIMEOUT_MS = 1000
LINGER_MS = 20
"""The producer's linger (librdkafka's default is 5): Tansu's CPU goes with the produced
batches, and at 5 ms it starves the 2-core machine and answers every consumer hundreds of
ms late at different moments, which swamps the difference being measured. It delays both
sides alike (one producer, the same records): it adds to the absolute figures, not to the
difference. `--linger-ms 5` measures at librdkafka's default."""
SLOW_ACK_MS = 100.0
"""A produce acknowledged later than this was delayed by the broker, not by a consumer."""
FETCH_WAIT_MS = 10
"""The broker's fetch wait for the proxy (kafka.fetch_wait_ms) and the plain consumers
alike (see the docstring); the proxy's default is 100."""
PREFETCH = 960
"""The Triage Consumer's prefetch: with concurrency 64, 1,024 credits (see the docstring)."""
PROXY_START_S = 30.0
PROXY_STOP_S = 30.0
PROBE_GAP_S = (1.0, 2.0)
"""Probes are this far apart, uniformly at random: every phase of the 1 s commit interval."""


class Reader:
    """A consumer process whose stdout lines are read on a thread (the last is its JSON)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self.warm = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.decode())

    def check_warm(self) -> bool:
        while not self.warm:
            try:
                self.warm = self.lines.get_nowait().strip() == "warm"
            except queue.Empty:
                break
        return self.warm

    def stop(self) -> dict[str, object]:
        stop_process(self.proc, 60)
        self._thread.join(10)
        last = ""
        while not self.lines.empty():
            last = self.lines.get_nowait()
        return json.loads(last) if last.strip().startswith("{") else {}


class SteadyProducer:
    def __init__(self, bootstrap: str, topic: str, linger_ms: int = LINGER_MS) -> None:
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "linger.ms": linger_ms,
                # Tansu was seen to leave a produce request unanswered until librdkafka's
                # 60 s socket timeout (then it drops the connection): every message behind
                # it waited a minute, for both consumers alike. Time out and retry in 1 s.
                "request.timeout.ms": PRODUCE_TIMEOUT_MS,
                "socket.timeout.ms": PRODUCE_TIMEOUT_MS,
            }
        )
        self._topic = topic
        self.produced = 0
        self.failed = 0
        self.end = 0
        """The log end: one past the highest offset the broker acknowledged (a retried
        produce may have written a duplicate, so it can be past `produced`)."""
        self.acked: dict[int, list[float]] = {}
        """phase -> produce() -> broker acknowledged, ms, per message."""

    def _on_delivery(self, err: object, message: Any) -> None:
        now = time.monotonic_ns()
        if err is not None:
            self.failed += 1
            return
        self.end = max(self.end, message.offset() + 1)
        phase, _, sent = message.value().split(b":")
        self.acked.setdefault(int(phase), []).append((now - int(sent)) / 1e6)

    def send(self, phase: int, index: int) -> None:
        value = f"{phase}:{index}:{time.monotonic_ns()}".encode()
        while True:
            try:
                self._producer.produce(
                    self._topic, value=value, partition=0, on_delivery=self._on_delivery
                )
                break
            except BufferError:
                self._producer.poll(0.001)
        self.produced += 1

    def steady(self, phase: int, rate: int, seconds: float) -> int:
        """Produce `rate` x `seconds` messages on schedule (each due at start + i / rate)."""
        total = round(rate * seconds)
        start, i = time.monotonic(), 0
        while i < total:
            due = min(total, int((time.monotonic() - start) * rate) + 1)
            while i < due:
                self.send(phase, i)
                i += 1
            self._producer.poll(0)
            time.sleep(0.0005)
        self.flush()
        return total

    def close(self) -> None:
        """Let librdkafka go before the broker does (else it retries its connection to the
        stopped broker, and prints every retry, until the process exits)."""
        self._producer.flush(0)
        del self._producer

    def flush(self) -> None:
        # Generous: Tansu has been seen to drop the producer's connection under load, and
        # librdkafka then retries what was in flight.
        if self._producer.flush(FLUSH_TIMEOUT_S) != 0:
            raise RuntimeError("produce did not complete")


def wait_committed(watcher: CommitWatcher, end: int, timeout_s: float) -> int:
    """Block until the committed offset is at least `end` (after a flush: the producer's
    `end`); return time.monotonic_ns() then."""
    deadline = time.monotonic() + timeout_s
    while watcher.offsets()[0] < end:
        if time.monotonic() > deadline:
            raise TimeoutError(f"committed {watcher.offsets()}, expected {end}")
        time.sleep(COMMIT_POLL_S)
    return time.monotonic_ns()


def percentiles(values_ms: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values_ms)
    if not ordered:
        return (float("nan"),) * 3

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return at(0.5), at(0.99), ordered[-1]


def fmt(p: tuple[float, float, float]) -> str:
    return f"{p[0]:.2f} / {p[1]:.2f} / {p[2]:.1f} ms"


def sched(pid: int) -> tuple[int, int, int]:
    """(CPU ns, ns runnable but waiting for a CPU) summed over the process's threads, and
    that wait for its main thread alone (the event loop's, for Triage): /proc schedstat."""
    cpu = wait = 0
    main = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ran, waited, _ = (int(x) for x in f.read().split())
            cpu, wait = cpu + ran, wait + waited
            if int(task) == pid:
                main = waited
    except (OSError, ValueError):
        pass  # gone, or no schedstat on this kernel: zeros
    return cpu, wait, main


def cpu_pressure_us() -> int:
    """Total microseconds some runnable task waited for a CPU (/proc/pressure/cpu), or 0."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


@dataclass
class Load:
    """What each process cost over one phase, and how long the machine's CPUs kept it
    waiting: the proof when a phase is bound by the machine rather than by Triage."""

    pids: dict[str, int]
    start: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    end: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    pressure: tuple[int, int] = (0, 0)
    wall: tuple[float, float] = (0.0, 0.0)

    def begin(self) -> None:
        self.start = {name: sched(pid) for name, pid in self.pids.items()}
        self.pressure = (cpu_pressure_us(), 0)
        self.wall = (time.monotonic(), 0.0)

    def finish(self) -> None:
        self.end = {name: sched(pid) for name, pid in self.pids.items()}
        self.pressure = (self.pressure[0], cpu_pressure_us())
        self.wall = (self.wall[0], time.monotonic())

    def rows(self, messages: int) -> list[tuple[str, str]]:
        seconds = self.wall[1] - self.wall[0]
        waited = (self.pressure[1] - self.pressure[0]) / 1e6
        rows = [
            (
                "CPU ms (us per message) / ms waiting for a CPU (main thread)",
                f"machine: some task waiting {100 * waited / max(seconds, 1e-9):.0f}% of "
                f"{seconds:.1f} s",
            )
        ]
        for name in self.pids:
            (c0, w0, m0), (c1, w1, m1) = self.start[name], self.end[name]
            rows.append(
                (
                    f"  {name}",
                    f"{(c1 - c0) / 1e6:.0f} ({(c1 - c0) / 1e3 / messages:.1f}) / "
                    f"{(w1 - w0) / 1e6:.0f} ({(m1 - m0) / 1e6:.0f})",
                )
            )
        return rows


@dataclass
class Phase:
    number: int
    rate: int
    count: int
    produced_end: int
    """The partition's end offset after this phase."""
    committed_at_ns: int = 0
    load: Load | None = None


@dataclass
class Run:
    """What one stack's phases recorded (see `run_stack`)."""

    phases: list[Phase]
    probes: list[int]
    docs: tuple[dict[str, object], dict[str, object], dict[str, object]]
    acked: dict[int, list[float]]
    failed: int
    trace: dict[str, list[int]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rates", default="1000,10000")
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prefetch", type=int, default=PREFETCH)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--fetch-wait-ms", type=int, default=FETCH_WAIT_MS)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument(
        "--client",
        action="append",
        default=[],
        help="PROP=VALUE: a librdkafka property of the proxy's consumer and both plain ones",
    )
    parser.add_argument("--linger-ms", type=int, default=LINGER_MS)
    parser.add_argument(
        "--shared-log",
        action="store_true",
        help="run every rate on one broker, each phase after the others' records",
    )
    parser.add_argument("--save", help="write what the consumers and the proxy recorded here")
    args = parser.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"added latency on {os.cpu_count()} cores, load average {load}")
    print(
        f"broker fetch wait (proxy kafka.fetch_wait_ms and the plain consumers' "
        f"fetch.wait.max.ms): {args.fetch_wait_ms} ms"
    )
    client = dict(pair.split("=", 1) for pair in args.client)
    if client:
        print(f"librdkafka properties of every consumer (the proxy's and the plain ones): {client}")
    print(f"producer linger.ms: {args.linger_ms}")
    numbered = list(enumerate(rates, 1))
    groups = [numbered] if args.shared_log else [[one] for one in numbered]
    print(
        "one broker for every phase (--shared-log)"
        if args.shared_log
        else "each phase on a fresh broker (Tansu's CPU per record grows with its log)"
    )
    runs = [
        run_stack(args, group, idle=k == 0, probes=args.probes if k == len(groups) - 1 else 0)
        for k, group in enumerate(groups)
    ]
    if args.save:
        with open(args.save, "w") as out:
            json.dump([save_doc(run) for run in runs], out)
    ok = True
    for run in runs:
        ok = report(args, run) and ok
        if run.trace:
            decompose(run.phases, run.docs[0], run.docs[1], run.trace)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def save_doc(run: Run) -> dict[str, object]:
    walls = [p.load.wall if p.load else (0.0, 0.0) for p in run.phases]
    saved = [(p.number, p.rate, p.count, w) for p, w in zip(run.phases, walls, strict=True)]
    return {"docs": run.docs, "trace": run.trace, "phases": saved}


def run_stack(
    args: argparse.Namespace, numbered: list[tuple[int, int]], idle: bool, probes: int
) -> Run:
    """One broker, proxy and three consumers; the phases `numbered` ((number, rate)) one
    after another, then `probes` commit-lag probes."""
    script = str(ROOT / "tests" / "perf" / "latency_instance.py")
    phases: list[Phase] = []
    client = dict(pair.split("=", 1) for pair in args.client)
    overrides: dict[str, dict[str, Any]] = {
        "kafka": {"fetch_wait_ms": args.fetch_wait_ms, "client": client}
    }
    trace_dir = tempfile.mkdtemp(prefix="bench-latency-")
    trace_path = os.path.join(trace_dir, "proxy-trace.json")
    probed: list[int] = []
    with DevStack(topic="bench-latency", proxy_overrides=overrides, start_proxies=False) as stack:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRIAGE_TOKEN": stack.token}
        proxy = start_proxy(stack, env, None if args.no_trace else trace_path)
        port = load_settings(stack.config_path).server.port
        bootstrap, target = stack.broker.bootstrap, f"{HOST}:{port}"
        triage = Reader(
            [sys.executable, script, "--target", target, "--concurrency", str(args.concurrency)]
            + (["--sync"] if args.sync else [])
            + ["--prefetch", str(args.prefetch)],
            env,
        )
        plain_command = [
            *(sys.executable, script, "--bootstrap", bootstrap, "--topic", stack.topic),
            *("--fetch-wait-ms", str(args.fetch_wait_ms)),
            *(a for pair in args.client for a in ("--client", pair)),
        ]
        plain, control = Reader(plain_command, env), Reader(plain_command, env)
        watcher = CommitWatcher(bootstrap, stack.group_id, stack.topic, 1)
        producer = SteadyProducer(bootstrap, stack.topic, args.linger_ms)
        try:
            deadline, i = time.monotonic() + WARM_TIMEOUT_S, 0
            while not all(r.check_warm() for r in (triage, plain, control)):
                if time.monotonic() > deadline:
                    raise TimeoutError("a consumer never saw the warm-up messages")
                producer.send(WARM_UP, i)
                producer.flush()
                i += 1
                time.sleep(0.05)
            wait_committed(watcher, producer.end, 60)
            pids = {
                "Tansu (broker)": stack.broker.pid,
                "Triage proxy": proxy.pid,
                "Triage consumer": triage.proc.pid,
                "plain consumer": plain.proc.pid,
                "this producer": os.getpid(),
            }
            if idle and args.idle_seconds > 0:
                meter = Load({"Tansu (broker)": stack.broker.pid})
                meter.begin()
                time.sleep(args.idle_seconds)
                meter.finish()
                busy = meter.end["Tansu (broker)"][0] - meter.start["Tansu (broker)"][0]
                print(
                    f"idle, 3 consumers connected, nothing produced: Tansu used "
                    f"{busy / 1e7 / (meter.wall[1] - meter.wall[0]):.1f}% of a core "
                    f"over {meter.wall[1] - meter.wall[0]:.1f} s"
                )
            for number, rate in numbered:
                cost = Load(pids)
                cost.begin()
                count = producer.steady(number, rate, args.seconds)
                phase = Phase(number, rate, count, producer.end, load=cost)
                phase.committed_at_ns = wait_committed(watcher, producer.end, 300)
                cost.finish()
                phases.append(phase)
            gaps = random.Random(15)
            for k in range(probes):
                time.sleep(gaps.uniform(*PROBE_GAP_S))
                producer.send(PROBE, k)
                producer.flush()
                probed.append(wait_committed(watcher, producer.end, 60))
            time.sleep(0.5)  # the plain consumer has read everything by now
        finally:
            producer.close()
            through = triage.stop()
            baseline = plain.stop()
            second = control.stop()
            watcher.close()
            stop_process(proxy, PROXY_STOP_S)  # it drains, commits, writes its trace
    trace = read_trace(trace_path)
    docs = (through, baseline, second)
    return Run(phases, probed, docs, producer.acked, producer.failed, trace)


def start_proxy(stack: DevStack, env: dict[str, str], trace: str | None) -> subprocess.Popen[bytes]:
    """The stack's proxy for partition 0, under the tracing wrapper unless `trace` is None
    (then exactly `triage proxy`, as DevStack starts it)."""
    command = proxy_command(stack.config_path, 0)
    if trace is not None:
        command = [sys.executable, "-m", "tests.perf.traced_proxy", *command[3:]]
        env = {**env, "TRIAGE_BENCH_TRACE": trace}
    log = open(stack.state_dir / "proxy-0.log", "ab")  # noqa: SIM115
    with log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=ROOT
        )
    try:
        wait_for_port(HOST, load_settings(stack.config_path).server.port, PROXY_START_S, proc)
    except BaseException:
        stop_process(proc, PROXY_STOP_S)
        raise
    return proc


def read_trace(path: str) -> dict[str, list[int]]:
    try:
        with open(path) as f:
            trace: dict[str, list[int]] = json.load(f)
    except (OSError, ValueError):
        return {}
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
            os.rmdir(os.path.dirname(path))
    return trace


def report(args: argparse.Namespace, run: Run) -> bool:
    """Print each phase's figures and verdicts, and the commit-lag probes; True if every
    target was met."""

    def by_message(doc: dict[str, object]) -> dict[tuple[int, int], int]:
        return {(row[0], row[1]): row[2] for row in doc.get("latencies", [])}  # type: ignore[attr-defined]

    phases, probes, docs, acked = run.phases, run.probes, run.docs, run.acked
    through = docs[0]
    t, b, c = (by_message(doc) for doc in docs)
    returned_t: dict[str, int] = through.get("returned", {})  # type: ignore[assignment]
    ok = True
    handler = "sync" if args.sync else "async"
    for phase in phases:
        keys = [(phase.number, i) for i in range(phase.count)]
        both = [k for k in keys if k in t and k in b]
        lt = [t[k] / 1e6 for k in keys if k in t]
        lb = [b[k] / 1e6 for k in keys if k in b]
        added = [(t[k] - b[k]) / 1e6 for k in both]
        floor = [(c[k] - b[k]) / 1e6 for k in keys if k in b and k in c]
        pt, pb, pa = percentiles(lt), percentiles(lb), percentiles(added)
        pc = percentiles(floor)
        lag_ms = (phase.committed_at_ns - returned_t.get(str(phase.number), 0)) / 1e6
        print(f"\n{phase.rate:,} msg/s for {args.seconds:.0f} s ({phase.count} messages)")
        print(
            table(
                [
                    ("produce -> handler start, p50 / p99 / max", ""),
                    (
                        f"  through Triage (1 Consumer, {handler} no-op, "
                        f"concurrency {args.concurrency}, prefetch {args.prefetch})",
                        fmt(pt),
                    ),
                    ("  plain confluent-kafka consumer", fmt(pb)),
                    ("  produce() -> broker acknowledged", fmt(percentiles(acked[phase.number]))),
                    ("added, per message: Triage - plain", fmt(pa)),
                    ("control, per message: a 2nd plain - plain", fmt(pc)),
                    (
                        "percentiles' difference: Triage - plain",
                        " / ".join(f"{t - b:.2f}" for t, b in zip(pt, pb, strict=True)) + " ms",
                    ),
                    (
                        f"  acknowledged later than {SLOW_ACK_MS:.0f} ms",
                        f"{sum(a > SLOW_ACK_MS for a in acked[phase.number])} messages",
                    ),
                    ("seen through Triage / plain", f"{len(lt)} / {len(lb)}"),
                    ("last handler return -> committed", f"{lag_ms:.0f} ms"),
                    *(phase.load.rows(phase.count) if phase.load else []),
                ]
            )
        )
        p50_target, p99_target = TARGETS.get(phase.rate, (None, None))
        complete = len(lt) == len(lb) == phase.count
        ok = ok and complete
        for name, at, limit in (("p50", 0, p50_target), ("p99", 1, p99_target)):
            if limit is not None:
                good = complete and pa[at] <= limit
                ok = ok and good
                verdict = "PASS" if good else "FAIL"
                print(
                    f"{verdict} added {name} {pa[at]:.2f} ms <= {limit:.0f} ms at {phase.rate:,}/s"
                    f" (control {name} {pc[at]:.2f} ms"
                    + (": the broker alone exceeds the target)" if pc[at] > limit else ")")
                )
    returns: dict[str, int] = through.get("probes", {})  # type: ignore[assignment]
    lags = [(c - returns[str(k)]) / 1e6 for k, c in enumerate(probes) if str(k) in returns]
    if probes:
        low, high = PROBE_GAP_S
        print(
            f"\ncommit lag at the default commit.interval_s, {len(probes)} single messages "
            f"{low:.0f}-{high:.0f} s apart, handler return -> committed: "
            + (", ".join(f"{lag:.0f}" for lag in lags) + " ms" if lags else "none handled")
        )
        if lags:
            print(f"  mean {sum(lags) / len(lags):.0f} ms, max {max(lags):.0f} ms")
    if run.failed:
        print(f"produce failures reported by librdkafka: {run.failed}")
    return ok


STAGE_ROWS = (
    ("fetched", "added", "  fetch thread -> event loop (Dispatcher.add)"),
    ("added", "queued", "  event loop -> a session's outbox (waiting for credits)"),
    ("queued", "sent", "  outbox -> the gRPC stream handler took the frame"),
    ("sent", "received", "  gRPC -> the client unpacked the frame"),
    ("received", "start", "  client unpacked -> handler start (its queue, its loop)"),
)
"""Consecutive stamps of one message's way through Triage (traced_proxy.py), and what
the time between them is."""


def stamps(flat: list[int]) -> dict[int, int]:
    """offset -> ns of the first stamp covering it, from [ns, first, last, ...]."""
    out: dict[int, int] = {}
    for k in range(0, len(flat) - 2, 3):
        ns, first, last = flat[k], flat[k + 1], flat[k + 2]
        for offset in range(first, last + 1):
            out.setdefault(offset, ns)
    return out


STALL_MS = 5.0
"""A 10 ms timer of the proxy's loop this late or later is counted as a stall."""


def stall_row(lags: list[float], ran: list[int], waited: list[int]) -> tuple[str, str]:
    """The stalls' lateness beside what the loop's thread did in those intervals: waited
    for a CPU (the machine's doing) or ran (the proxy's own work). Lateness the wait does
    not cover was work, or blocking (the GIL, I/O)."""
    stalls = [k for k, lag in enumerate(lags) if lag >= STALL_MS]
    late = sum(lags[k] for k in stalls)
    queued = sum(waited[k] for k in stalls) / 1e6
    on_cpu = sum(ran[k] for k in stalls) / 1e6
    return (
        f"  its stalls (>= {STALL_MS:.0f} ms late): count, lateness in all",
        f"{len(stalls)}, {late:.0f} ms; in them its thread waited {queued:.0f} ms for a CPU "
        f"and ran {on_cpu:.0f} ms",
    )


def gc_row(who: str, flat: list[int], start: int, end: int) -> tuple[str, str]:
    """The cyclic garbage collector's pauses in `who` within [start, end] ns, from
    [ns, pause ns, generation, ...]: count by generation, total, p99 and longest (each
    stops every thread of the process)."""
    pauses = [
        (flat[k + 1] / 1e6, flat[k + 2])
        for k in range(0, len(flat) - 2, 3)
        if start <= flat[k] <= end
    ]
    if not pauses:
        return (f"{who} GC pauses: count (gen 0/1/2), total, p99, max", "none")
    counts = [sum(1 for _, g in pauses if g == gen) for gen in (0, 1, 2)]
    ms = [p for p, _ in pauses]
    return (
        f"{who} GC pauses: count (gen 0/1/2), total, p99, max",
        f"{len(ms)} ({'/'.join(map(str, counts))}), {sum(ms):.1f} ms, "
        f"{percentiles(ms)[1]:.2f} ms, {max(ms):.2f} ms",
    )


def paused_ms(flat: list[int], start: int, end: int) -> float:
    """How long, within [start, end] ns, the proxy's fetcher was paused ([ns, 1|0, ...])."""
    total, since = 0, None
    for k in range(0, len(flat) - 1, 2):
        ns, paused = flat[k], flat[k + 1]
        if paused and since is None:
            since = ns
        elif not paused and since is not None:
            total += max(0, min(ns, end) - max(since, start))
            since = None
    if since is not None:
        total += max(0, end - max(since, start))
    return total / 1e6


def decompose(
    phases: list[Phase],
    through: dict[str, object],
    baseline: dict[str, object],
    trace: dict[str, list[int]],
) -> None:
    """Print where each phase's Triage latency went (see the module docstring)."""
    at = {name: stamps(trace.get(name, [])) for name in ("fetched", "added", "queued", "sent")}
    at["received"] = stamps(through.get("received", []))  # type: ignore[arg-type]
    rows_t: list[list[int]] = through.get("latencies", [])  # type: ignore[assignment]
    plain = {(r[0], r[1]): r[2] for r in baseline.get("latencies", [])}  # type: ignore[attr-defined]
    lag_flat = trace.get("lag", [])
    lag_times, lag_values = lag_flat[0::2], lag_flat[1::2]
    print("\nwhere Triage's latency goes (proxy under tests/perf/traced_proxy.py)")
    for phase in phases:
        mine = [r for r in rows_t if r[0] == phase.number]
        at["start"] = {r[3]: r[4] for r in mine}
        produced = {r[3]: r[4] - r[2] for r in mine}
        keys = {r[3]: (r[0], r[1]) for r in mine}
        fetched = at["fetched"]
        broker = [(fetched[o] - produced[o]) / 1e6 for o in produced if o in fetched]
        own = [(at["start"][o] - fetched[o]) / 1e6 for o in produced if o in fetched]
        noise = [
            (fetched[o] - produced[o] - plain[keys[o]]) / 1e6
            for o in produced
            if o in fetched and keys[o] in plain
        ]
        rows: list[tuple[str, str]] = [
            ("p50 / p99 / max", ""),
            ("produce -> the proxy's Kafka read returned it (broker)", fmt(percentiles(broker))),
            (
                "  beside it: produce -> plain consumer's handler start",
                fmt(percentiles([plain[k] / 1e6 for k in keys.values() if k in plain])),
            ),
            ("  per message: proxy's read - plain's handler start", fmt(percentiles(noise))),
            ("the proxy's Kafka read -> handler start (Triage itself)", fmt(percentiles(own))),
        ]
        for a, b, label in STAGE_ROWS:
            first, then = at[a], at[b]
            part = [(then[o] - first[o]) / 1e6 for o in produced if o in first and o in then]
            rows.append((label, fmt(percentiles(part))))
        if phase.load is not None:
            start, end = (int(w * 1e9) for w in phase.load.wall)
            lo, hi = bisect_right(lag_times, start), bisect_right(lag_times, end)
            lags = [v / 1e6 for v in lag_values[lo:hi]]
            rows.append(("proxy event loop: lateness of a 10 ms timer", fmt(percentiles(lags))))
            sched = trace.get("lag_sched", [])
            if len(sched) == len(lag_flat):
                rows.append(stall_row(lags, sched[0::2][lo:hi], sched[1::2][lo:hi]))
            rows.append(gc_row("proxy", trace.get("gc", []), start, end))
            rows.append(gc_row("client", through.get("gc", []), start, end))  # type: ignore[arg-type]
            if "paused" in trace:
                full = paused_ms(trace["paused"], start, end)
                rows.append(
                    (
                        "window full, fetching paused (records wait in librdkafka)",
                        f"{full:.0f} ms of {(end - start) / 1e6:.0f} ms",
                    )
                )
        p50_target, p99_target = TARGETS.get(phase.rate, (None, None))
        print(f"\n{phase.rate:,} msg/s: {len(own)} of {len(mine)} messages traced")
        print(table(rows))
        p_own = percentiles(own)
        for name, index, limit in (("p50", 0, p50_target), ("p99", 1, p99_target)):
            if limit is not None:
                verdict = "within" if p_own[index] <= limit else "OVER"
                print(
                    f"  Triage itself {name} {p_own[index]:.2f} ms: {verdict} the added-{name} "
                    f"target of {limit:.0f} ms"
                )


if __name__ == "__main__":
    sys.exit(main())
