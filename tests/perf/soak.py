"""Soak: the embedded stack under steady load for half an hour, with restarts and kills.

Not a CI test (it takes 30 minutes): a benchmark run by hand. It starts the embedded
stack (Tansu, moto server and a real proxy process, `triage_cli.devstack`) and the fault
suite's consumer instances (tests/fault/instance.py: each invocation logged before it
acts), produces 2,000 messages a second of which 1% are nacked (dead-lettered) and 0.1%
are slow (past the ack deadline on their first attempt, then acked), restarts one
instance gracefully (SIGTERM, then a new one) every 2 minutes and kill -9s the proxy
every 5 minutes (restarting it at once). Once production ends it waits for the committed
offset to reach the end of the partition and checks every produced offset against the
handlers' logs and the dead-letter table (tests/fault/verify.py). It prints:

- lost: produced offsets neither completed by a handler nor dead-lettered (must be 0);
- duplicates per proxy kill, each kill's own, against the bound (window.max_messages,
  `--window`: a kill redelivers at most the window);
- the proxy's resident memory, file descriptors and threads at minute 5 (just before the
  first kill) and at the end, once production stopped (growth of memory <= 10%,
  descriptors and threads none; each the median of 5 samples 1 s apart), and every
  minute's sample with the threads by name and descriptors by kind that changed since
  the same proxy's previous sample. With a kill every 5 minutes both are of a proxy 5
  minutes old; what grows across restarts or within a proxy's life shows; then the
  threads by name and the descriptors by kind that differ between the first and the
  last sample;
- the commit lag: every 0.5 s, how long the oldest record not committed yet has been in
  the partition (0 when everything produced is committed), p50 / p99 / max, over the
  whole run and outside the 20 s after each kill.

The proxy runs with the fault suite's short deadlines (ack deadline 2 s, commit interval
0.2 s) and a 6 s lease, so that a kill costs seconds, not the defaults' tens of seconds.

    .venv/bin/python -m tests.perf.soak [--minutes 30] [--rate 2000] [--window 1000]
        [--scaled] [--kill-every-s S] [--restart-every-s S] [--seed N] [--work-dir DIR]

`--minutes` shortens the run; the kill and restart intervals stay 5 and 2 minutes unless
`--scaled` scales them (and the first sample) with the run (a 3-minute run: a kill every
30 s, a restart every 12 s) or they are given in seconds. Exit 1 when lost > 0 or the run
did not finish, 2 when a figure misses its target.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.fault.processes import CommitPoller, Fleet, Production, restart_proxy
from tests.fault.report import Report
from tests.fault.scenario import TOPIC, Options, Workload, proxy_overrides
from tests.fault.verify import scan_dead_letters, verify
from triage_cli.devstack import DevStack

MINUTES = 30.0
RATE = 2000.0
NACK_SHARE = 0.01
SLOW_SHARE = 0.001
KILL_EVERY_S = 300.0
RESTART_EVERY_S = 120.0
WINDOW = 1000
LINGER_MS = 50
"""The producer's linger: ~100 records a batch at 2,000 msg/s. Tansu's in-memory store
costs each fetch time in proportion to the batches the partition holds (at 5 ms, ~10
records a batch, 3.6M records are 360,000 batches, and fetching from the middle of them
slowed to a crawl by minute 20); the soak measures the proxy, not that."""
"""The proxy's window.max_messages: what one kill may redeliver at most."""
PROXY_DOWN_S = 0.5
"""How long a killed proxy stays down before it is restarted."""
LAG_POLL_S = 0.5
AFTER_KILL_S = 20.0
"""Lag samples this long after a kill are left out of the 'outside kills' figure."""
FINISH_TIMEOUT_S = 300.0
"""Longest wait, once production ended, for the commit to reach the end."""
MEMORY_GROWTH = 0.10
SAMPLES = 5
"""Samples per measuring point (minute 5, the end), SAMPLE_GAP_S apart: their median."""
SAMPLE_GAP_S = 1.0
PROXY_GONE_S = 60.0
LEASE_S = 6.0
"""The proxy's ownership.lease_s: the fault suite's 2 s lapsed under a loaded machine's
slow DynamoDB renewals (the proxy then exits 3 and is restarted, counted apart)."""
TICK_S = 0.1


@dataclass
class Sample:
    """The proxy process as psutil sees it at one moment."""

    at_s: float
    pid: int
    rss_mib: float
    fds: int
    threads: int
    thread_names: Counter[str] = field(default_factory=Counter)
    """Threads by name (librdkafka's `rdk:*`, gRPC's `event_engine`, Python's `python`)."""
    fd_kinds: Counter[str] = field(default_factory=Counter)
    """Descriptors by what they point at, numbers blanked (`socket:[N]`, `pipe:[N]`)."""


@dataclass
class Soak:
    """What one run recorded besides the fault suite's report."""

    kills: list[float] = field(default_factory=list)
    restarts: int = 0
    samples: list[Sample] = field(default_factory=list)
    first: Sample | None = None
    last: Sample | None = None
    lag_s: list[tuple[float, float]] = field(default_factory=list)
    """(unix time, seconds the oldest uncommitted record has waited)."""
    unexpected_exits: list[str] = field(default_factory=list)


class TimedProduction(Production):
    """Production that also notes when the broker acknowledged each offset."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acked_at: dict[int, float] = {}

    def _on_delivery(self, err: Any, msg: Any) -> None:
        super()._on_delivery(err, msg)
        if err is None:
            self.acked_at[msg.offset()] = time.time()


def sample(stack: DevStack, started: float, count: int = 1) -> Sample:
    """The proxy now; with `count` > 1, the median of that many samples SAMPLE_GAP_S apart
    (a descriptor or thread that comes and goes with one connection is not growth), and
    the last one's threads by name and descriptors by kind."""
    taken = []
    for i in range(count):
        if i:
            time.sleep(SAMPLE_GAP_S)
        taken.append(_one_sample(stack, started))
    return Sample(
        taken[-1].at_s,
        taken[-1].pid,
        statistics.median(s.rss_mib for s in taken),
        int(statistics.median(s.fds for s in taken)),
        int(statistics.median(s.threads for s in taken)),
        taken[-1].thread_names,
        taken[-1].fd_kinds,
    )


def kinds(pid: int) -> tuple[Counter[str], Counter[str]]:
    """The process's threads by name and descriptors by kind, from /proc (best effort: a
    thread or descriptor that goes while they are read is skipped)."""
    names: Counter[str] = Counter()
    fds: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                names[Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()] += 1
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                fds[re.sub(r"\d+", "N", os.readlink(f"/proc/{pid}/fd/{fd}"))] += 1
    return names, fds


def differences(first: Counter[str], last: Counter[str]) -> str:
    """Each name whose count differs, as "name a -> b"; "none" when no count differs."""
    changed = sorted(k for k in first.keys() | last.keys() if first[k] != last[k])
    return ", ".join(f"{k} {first[k]} -> {last[k]}" for k in changed) or "none"


def changes(samples: list[Sample]) -> list[str]:
    """For each sample, the threads by name and descriptors by kind that changed since the
    previous sample of the same process ("" for a process's first): growth within one
    proxy's life, which comparing the first and the last proxy cannot show."""
    previous: dict[int, Sample] = {}
    out = []
    for s in samples:
        before = previous.get(s.pid)
        previous[s.pid] = s
        if before is None:
            out.append("")
            continue
        threads = differences(before.thread_names, s.thread_names)
        fds = differences(before.fd_kinds, s.fd_kinds)
        out.append(f"threads: {threads}; fds: {fds}")
    return out


def process_sample(pid: int, at_s: float) -> Sample:
    """One process's sample. Its counts are the sums of its breakdown, from the same read
    of /proc, so the two never disagree about one moment."""
    proc = psutil.Process(pid)
    if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet waited for: no descriptors
        raise psutil.ZombieProcess(pid)
    rss_mib = proc.memory_info().rss / 2**20
    names, fds = kinds(pid)
    if not names:  # it went while /proc was read: a live process has a thread
        raise psutil.NoSuchProcess(pid)
    return Sample(at_s, pid, rss_mib, sum(fds.values()), sum(names.values()), names, fds)


def _one_sample(stack: DevStack, started: float) -> Sample:
    """One sample of the live proxy; while it is being restarted (it exited on its own),
    the next one's, within PROXY_GONE_S."""
    deadline = time.monotonic() + PROXY_GONE_S
    while True:
        try:
            return process_sample(stack.proxy_process(0).pid, time.time() - started)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def commit_lag(producer: TimedProduction, committed: int, now: float) -> float:
    """How long the record at the committed offset (the oldest not committed) has been in
    the partition; 0 when every acknowledged record is committed."""
    at = producer.acked_at.get(committed)
    return 0.0 if at is None else max(0.0, now - at)


def run(args: argparse.Namespace) -> tuple[Report, Soak]:
    duration_s = args.minutes * 60.0
    scale = args.minutes / MINUTES if args.scaled else 1.0
    kill_every = args.kill_every_s or KILL_EVERY_S * scale
    restart_every = args.restart_every_s or RESTART_EVERY_S * scale
    messages = int(args.rate * duration_s)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="triage-soak-"))
    options = Options(
        messages=messages,
        proxy_kills=int(duration_s // kill_every),
        consumer_kills=0,
        outage_s=0.0,
        instances=args.instances,
        seed=args.seed,
        duration_s=duration_s,
        work_dir=work_dir,
        shares=(("nack", NACK_SHARE), ("slow", SLOW_SHARE)),
    )
    report = Report(options, work_dir)
    soak = Soak()
    workload = Workload.generate(messages, dict(options.shares), args.seed)
    overrides = proxy_overrides(options)
    overrides["window"] = {"max_messages": args.window}
    overrides["ownership"] = {"lease_s": LEASE_S}
    rng = random.Random(args.seed + 1)
    print(
        f"soak: {args.minutes:g} min at {args.rate:g} msg/s ({messages} messages), "
        f"{NACK_SHARE:.0%} nacks, {SLOW_SHARE:.1%} slow, a consumer restart every "
        f"{restart_every:g} s, a proxy kill -9 every {kill_every:g} s, window "
        f"{args.window}; logs in {work_dir}",
        flush=True,
    )
    with contextlib.ExitStack() as cleanup:
        stack = DevStack(topic=TOPIC, state_dir=work_dir / "stack", proxy_overrides=overrides)
        stack.start()
        cleanup.callback(stack.stop)
        target = stack.describe()["proxies"][0]["target"]
        fleet = Fleet(work_dir, target, stack.token, options.instances, options)
        cleanup.callback(fleet.stop)
        poller = CommitPoller(stack)
        cleanup.callback(poller.stop)
        producer = TimedProduction(
            stack.broker.bootstrap, workload, duration_s, 0.0, linger_ms=LINGER_MS
        )
        cleanup.callback(producer.stop)

        fleet.start()
        poller.start()
        started = report.started_at = time.time()
        producer.start()
        next_kill, next_restart, next_sample = kill_every, restart_every, 60.0
        next_lag = 0.0
        killing = threading.Thread()  # the kill under way, if any
        deadline = duration_s + FINISH_TIMEOUT_S
        while True:
            now_s = time.time() - started
            fleet.supervise()
            proc = stack.proxy_process(0)
            if not killing.is_alive() and proc.poll() is not None:  # it died on its own
                soak.unexpected_exits.append(f"pid {proc.pid} exited with {proc.returncode}")
                report.proxy_exits.append(time.time())
                restart_proxy(stack)
            if now_s >= next_lag:
                next_lag = now_s + LAG_POLL_S
                soak.lag_s.append(
                    (time.time(), commit_lag(producer, poller.committed, time.time()))
                )
            if now_s >= next_sample and now_s < duration_s and not killing.is_alive():
                soak.samples.append(sample(stack, started))
                next_sample += 60.0
            if now_s >= next_restart and now_s < duration_s:
                next_restart += restart_every
                if fleet.restart_one(rng) is not None:
                    soak.restarts += 1
            sampling_s = (SAMPLES - 1) * SAMPLE_GAP_S  # the kill comes after its samples
            last_kill = next_kill >= duration_s  # none at the very end: the end is sampled
            if now_s >= next_kill - sampling_s and not last_kill and not killing.is_alive():
                next_kill += kill_every
                killing = threading.Thread(
                    target=kill_and_restart, args=(stack, soak, started, poller), daemon=True
                )
                killing.start()
            if producer.finished.is_set() and soak.last is None and not killing.is_alive():
                soak.last = sample(stack, started, SAMPLES)
                soak.samples.append(soak.last)
                report.end_offset = max(producer.offsets.values(), default=-1) + 1
            if soak.last is not None and poller.committed >= report.end_offset:
                break
            if now_s > deadline:
                report.unfinished = f"timed out (committed {poller.committed})"
                break
            time.sleep(TICK_S)
        report.wall_s = time.time() - started
        if killing.is_alive():
            killing.join()
        fleet.stop()
        producer.stop()
        report.produce_errors = producer.errors[:10]
        report.committed = poller.committed
        poller.stop()
        dead = scan_dead_letters(stack)
    report.proxy_kills = len(soak.kills)
    verify(report, workload, producer.offsets, fleet.history, dead, sorted(soak.kills))
    return report, soak


def kill_and_restart(stack: DevStack, soak: Soak, started: float, poller: CommitPoller) -> None:
    """Sample the proxy, kill -9 it, restart it after PROXY_DOWN_S (its own thread, so the
    lag is still sampled while the new proxy waits for the lease)."""
    taken = sample(stack, started, SAMPLES)
    soak.samples.append(taken)
    soak.first = soak.first or taken
    soak.kills.append(time.time())
    stack.stop_proxy(0, signal.SIGKILL)
    time.sleep(PROXY_DOWN_S)
    restart_proxy(stack)
    print(
        f"  {taken.at_s / 60:5.1f} min: kill -9 #{len(soak.kills)} (RSS {taken.rss_mib:.1f} "
        f"MiB, {taken.fds} fds, {taken.threads} threads), committed {poller.committed}",
        flush=True,
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(report: Report, soak: Soak, window: int) -> list[tuple[str, bool, bool]]:
    """Print the figures; return the checks as (text, passed, correctness)."""
    kills = soak.kills
    per_kill = [report.per_kill[i] for i in range(len(kills))]
    print(
        f"wall time {report.wall_s:.0f} s; produced {report.produced}, committed "
        f"{report.committed} of {report.end_offset}"
    )
    print(f"acked {report.acked}, dead-lettered {report.dead_lettered}, lost {len(report.lost)}")
    for line in report.lost_detail:
        print(f"  {line}")
    mean = statistics.fmean(per_kill) if per_kill else float("nan")
    print(
        f"proxy kills {len(kills)}: duplicates per kill {mean:.1f} (each: "
        f"{', '.join(map(str, per_kill))}; bound: the window, {window})"
    )
    causes = ", ".join(f"{c} {n}" for c, n in report.duplicates_by_cause.items() if n)
    print(f"consumer restarts {soak.restarts}; duplicates by cause: {causes or 'none'}")
    if soak.unexpected_exits:
        print(f"proxy exits on its own: {soak.unexpected_exits}")
    print("proxy samples (minute, pid, RSS MiB, fds, threads; what changed since its last):")
    for s, change in zip(soak.samples, changes(soak.samples), strict=True):
        print(
            f"  {s.at_s / 60:5.1f}  {s.pid:>7}  {s.rss_mib:7.1f}  {s.fds:4d}  {s.threads:3d}"
            f"  {change}"
        )
    first, last = soak.first, soak.last
    if first is not None and last is not None:
        threads = differences(first.thread_names, last.thread_names)
        descriptors = differences(first.fd_kinds, last.fd_kinds)
        print(f"proxy threads by name, first -> last: {threads}")
        print(f"proxy descriptors by kind, first -> last: {descriptors}")
    lags = [lag for _, lag in soak.lag_s]
    quiet = [lag for t, lag in soak.lag_s if not _after_kill(kills, t)]
    print(
        f"commit lag (s): p50 {percentile(lags, 0.5):.3f}, p99 {percentile(lags, 0.99):.3f}, "
        f"max {max(lags, default=float('nan')):.3f} over {len(lags)} samples; outside "
        f"{AFTER_KILL_S:g} s after kills p50 {percentile(quiet, 0.5):.3f}, p99 "
        f"{percentile(quiet, 0.99):.3f}, max {max(quiet, default=float('nan')):.3f}"
    )
    checks = [
        ("finished: everything produced committed", not report.unfinished, True),
        (f"lost 0 (got {len(report.lost)})", not report.lost, True),
        ("dead letters byte-exact", not report.not_exact and not report.mismatched, True),
        (
            f"duplicates of every kill <= the window {window} (most {max(per_kill, default=0)})",
            max(per_kill, default=0) <= window,
            False,
        ),
    ]
    if first is not None and last is not None:
        growth = last.rss_mib / first.rss_mib - 1
        checks += [
            (
                f"proxy RSS {first.rss_mib:.1f} -> {last.rss_mib:.1f} MiB ({growth:+.1%}, "
                f"limit +{MEMORY_GROWTH:.0%})",
                growth <= MEMORY_GROWTH,
                False,
            ),
            (f"proxy fds {first.fds} -> {last.fds} (no growth)", last.fds <= first.fds, False),
            (
                f"proxy threads {first.threads} -> {last.threads} (no growth)",
                last.threads <= first.threads,
                False,
            ),
        ]
    return checks


def _after_kill(kills: list[float], t: float) -> bool:
    i = bisect.bisect_right(kills, t)
    return i > 0 and t - kills[i - 1] < AFTER_KILL_S


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=MINUTES)
    parser.add_argument("--rate", type=float, default=RATE, help="messages per second")
    parser.add_argument("--window", type=int, default=WINDOW, help="window.max_messages")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument(
        "--scaled", action="store_true", help="scale the kill and restart intervals with --minutes"
    )
    parser.add_argument("--kill-every-s", type=float, default=None)
    parser.add_argument("--restart-every-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.window < 1:
        parser.error("--minutes and --rate must be > 0 and --window >= 1")
    signal.signal(signal.SIGTERM, _raise_exit)
    print(
        f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}; "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    report, soak = run(args)
    print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    checks = summarize(report, soak, args.window)
    for text, passed, _ in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}")
    if any(not passed for _, passed, correctness in checks if correctness):
        return 1
    return 2 if any(not passed for _, passed, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
