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
   value says what the handler does (see tests/fault/instance.py): ok (ack), nack
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
the two invocations (a proxy kill, the proxy exiting on its own, the previous instance
killed by the suite, the previous instance crashed by another message's crash pill), or
none ("other"). A proxy that exits on its own is one that lost its lease in the DynamoDB
outage (exit 3, restarted as a standby): what it settled while the table was frozen
reached no checkpoint, and its redeliveries are that exit's, not those of a kill of the
proxy that came back after the outage (before, they were charged to that later kill). An
instance that dies takes at most credits (the in-flight window's share) unacked
deliveries with it, the ones it completed last: only those, and the ones it never
completed, can be its collateral (before, everything it completed in its last second
was, and a later proxy kill's redeliveries of them were hidden as crash collateral). Expected
redeliveries beyond the behaviour's need (a crash pill starting again at attempt 1 on a
restarted proxy) count as duplicates of the proxy kill that reset its attempts. This is
stricter than `invocations - unique offsets - expected`: a missing expected redelivery
cannot hide an unexpected one, and every duplicate has a cause.

Targets: lost == 0, crash pills exact and no proxy exit but a lease lost in the DynamoDB
outage (exit 1 otherwise); with the encoding,
duplicates per proxy kill no more than the in-flight window (instances x credits, which
the run sets as the proxy's window.max_messages: with the encoding a kill redelivers at
most the window, see the README's guarantees); with
--encode-settled both, at least 5x fewer duplicates per proxy kill with the encoding than
without (exit 2 when only a figure target fails).

    .venv/bin/python -m tests.fault.fault_suite [--scenario single|fleet] [--messages N]
        [--proxy-kills N] [--consumer-kills N] [--outage-s S] [--instances N] [--seed N]
        [--encode-settled on|off|both] [--max-attempts N] [--ack-deadline-s S]
        [--redelivery-span-s S]

Every process started is stopped by PID on the way out, also on error, Ctrl-C and
SIGTERM (which raises SystemExit so the context managers run).

`--scenario fleet` runs tests/fault/fleet.py instead: partitions moving between fleet
processes (a join, a SIGTERM, a SIGKILL) under crash pills, nothing lost.

This module runs it (`run_suite`, `main`); the parts live beside it: scenario.py (options,
workload, fault plan), processes.py (producer, fleet, faults), verify.py (the checks above),
report.py (the table and targets), instance.py (the consumer process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.fault.processes import (
    TICK_S,
    CommitPoller,
    FaultRecord,
    FaultRunner,
    Fleet,
    Incarnation,
    Production,
    restart_proxy,
)
from tests.fault.report import Report, checks, details, render
from tests.fault.scenario import BEHAVIOURS, TOPIC, Options, Workload, plan_faults, proxy_overrides
from tests.fault.verify import scan_dead_letters, verify
from triage_cli.devstack import DevStack
from triage_cli.exitcodes import ExitCode

LEASE_LOSS_SLACK_S = 5.0
"""A proxy exit 3 up to this long after a DynamoDB outage is its lease lapsing in it."""
MAX_UNEXPECTED_PROXY_EXITS = 5
"""A proxy that dies on its own this often is broken: the run stops and reports it."""


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
        overrides = proxy_overrides(options)
        # The proxy's window is the instances' in-flight window, so that "a kill redelivers
        # at most the window" (with the encoding) is the suite's target itself.
        overrides["window"] = {"max_messages": options.in_flight_window}
        stack = DevStack(topic=TOPIC, state_dir=run_dir / "stack", proxy_overrides=overrides)
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
    exits = [FaultRecord("proxy-exit", t, t, "on its own") for t in report.proxy_exits]
    write_timeline(run_dir / "timeline.txt", faults.records + exits, fleet.history)
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
                    report.proxy_exits.append(time.time())
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


# --- command line --------------------------------------------------------------------------


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    scenario = argparse.ArgumentParser(add_help=False)
    scenario.add_argument("--scenario", choices=("single", "fleet"), default="single")
    picked, rest = scenario.parse_known_args(args_in)
    if picked.scenario == "fleet":
        from tests.fault.fleet import main as fleet_main

        return fleet_main(rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenario",
        choices=("single", "fleet"),
        default="single",
        help="single: one partition, kill -9s and outages (below); fleet: tests/fault/fleet.py",
    )
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
    parser.add_argument("--redelivery-span-s", type=float, default=Options.redelivery_span_s)
    parser.add_argument(
        "--duration-s", type=float, default=None, help="production time (default: sized)"
    )
    parser.add_argument("--timeout-s", type=float, default=Options.timeout_s)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(args_in)
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
        redelivery_span_s=args.redelivery_span_s,
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
