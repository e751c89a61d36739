"""Short-work efficiency: how close Triage comes to a perfect first-in-first-out schedule.

Workload: 4,000 messages of 2 ms work (`--work-ms`: 1 for the short-work case), 2% slow
(200 ms), 1% poison pills (raise at once), SYNC handlers. Arrangements (`--arrangements`,
each PROCESSESxCONSUMERSxHANDLERS; a trailing `s`: the Consumers of a process share one
event loop, `run_async` under one gather; a trailing `a`: ASYNC handlers, whose work is
`await asyncio.sleep`): one process running 4 `Consumer` objects x 8 handlers (1x4x8), and
2 processes x 1 Consumer x 16 handlers (2x1x16); 32 slots either way; `1x1x32a` is one
Consumer of 32 async handlers. Each arrangement gets its own dev stack.

Every slot is busy at time zero (tests/perf/slots_instance.py holds the first deliveries
at a gate until all slots wait), so the bound (tests/perf/fifo_bound.py: list scheduling of
the workload's exact durations on the 32 slots) and the run start together. Measured: gate
opened -> last handler returned. Target: bound / measured >= 90% in every arrangement
(`--target`, in percent: 95 for the short-work case).

Beside each arrangement, in the same dev stack just before the instances start, the
same handlers run the same workload under a perfect in-process FIFO dispatcher
(tests/perf/fifo_ideal.py: the arrangement's slots as threads, or as tasks in one event
loop for async handlers; no Kafka, no proxy, no client): Python's own floor on this
machine at that moment. Printed: its efficiency against the bound, and Triage's makespan
against its (ideal / measured), which is Triage's own share of the distance (`--no-ideal`
skips it).

Also printed, to say where the rest goes: the bound over the handlers' MEASURED durations
(what is left is slots idle, not handlers overrunning their sleeps), the idle gap between a
handler thread's return and its next start (hand-off: settle, credit, delivery, thread
wake-up), gate -> everything committed (commit.interval_s 0.1, dead-letter writes), and the
CPU seconds the instances and the proxy spent meanwhile, per message: on a machine shared
with other work the efficiency swings with its load, the CPU per message much less.

    .venv/bin/python -m tests.perf.bench_efficiency [--messages N] [--arrangements 1x4x8,...]
        [--work-ms 2] [--target 90]
        [--profile DIR [--profile-gil]]   (py-spy on the proxy and the instance processes)
        [--switch-interval-ms MS]          (the instances' GIL switch interval, an experiment)
        [--prefetch N]                     (Consumer(prefetch=N), an experiment)
        [--client-path DIR]                (the instances import another triage_client, e.g.
                                            the code before a change: side by side)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.commit_watcher import CommitWatcher
from tests.perf.common import (
    ROOT,
    Profiler,
    print_frames,
    produce_values,
    table,
    top_frames,
)
from tests.perf.cpumeter import cpu_seconds
from tests.perf.fifo_bound import efficiency, fifo_bound
from triage_cli.demo import count_dead_letters
from triage_cli.devstack import DevStack

TARGET_EFFICIENCY = 0.90
ORDINARY_MS, SLOW_MS = 2, 200
"""An ordinary message's work by default (`--work-ms`), and a slow one's."""
SLOW_SHARE, POISON_SHARE = 0.02, 0.01
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Arrangement:
    processes: int
    consumers: int
    handlers: int
    shared_loop: bool = False
    """`PxCxHs`: the C Consumers of a process run in one event loop (slots_instance.py)."""
    asynchronous: bool = False
    """`PxCxHa`: async handlers (slots_instance.py --async)."""

    @classmethod
    def parse(cls, text: str) -> Arrangement:
        text = text.lower()
        asynchronous = text.endswith("a")
        text = text.removesuffix("a")
        shared = text.endswith("s")
        p, c, h = (int(x) for x in text.removesuffix("s").split("x"))
        return cls(p, c, h, shared, asynchronous)

    @property
    def slots(self) -> int:
        return self.processes * self.consumers * self.handlers

    def __str__(self) -> str:
        loops = ", one shared loop" if self.shared_loop else ""
        return (
            f"{self.processes} process(es) x {self.consumers} Consumer(s) x {self.handlers} "
            f"{'async' if self.asynchronous else 'sync'}{loops}"
        )


def workload(count: int, seed: int = 7, work_ms: int = ORDINARY_MS) -> list[tuple[str, int]]:
    """(kind, ms) per offset: exactly round(count*share) slow and poison, at random places;
    the rest ordinary, `work_ms` each."""
    rng = random.Random(seed)
    n_slow, n_poison = round(count * SLOW_SHARE), round(count * POISON_SHARE)
    kinds = [("slow", SLOW_MS)] * n_slow + [("poison", 0)] * n_poison
    kinds += [("ordinary", work_ms)] * (count - len(kinds))
    rng.shuffle(kinds)
    return kinds


@dataclass(frozen=True)
class Ideal:
    """The workload under a perfect in-process FIFO dispatcher (fifo_ideal.py)."""

    makespan: float
    cpu: float
    """Its process's CPU seconds over the run: the handlers' own work and the runtime's."""
    records: list[list[float]]
    """[offset, start, finish] per message."""


def run_ideal(arr: Arrangement, kinds: list[tuple[str, int]]) -> Ideal:
    argv = [sys.executable, str(ROOT / "tests" / "perf" / "fifo_ideal.py")]
    argv += ["--slots", str(arr.slots), *(["--async"] if arr.asynchronous else [])]
    done = subprocess.run(
        argv, input=json.dumps(kinds).encode(), capture_output=True, timeout=300, check=True
    )
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return Ideal(float(out["makespan"]), float(out["cpu"]), out["records"])


@dataclass
class Run:
    arrangement: Arrangement
    t0: float
    committed: float
    records: list[list[float]]
    """[offset, start, finish, thread, consumer, poison] per delivery, plus the process index."""
    dead: int
    frames: dict[str, list[tuple[str, float, float]]]
    cpu: dict[str, float]
    """CPU seconds (user + system) each process spent from the gate to everything committed:
    a figure the load of other work on the machine barely moves."""
    ideal: Ideal | None = None


@dataclass(frozen=True)
class Options:
    """Experiments on the instances (none changes the workload or the bound)."""

    switch_ms: float | None = None
    """sys.setswitchinterval in the instances."""
    prefetch: int | None = None
    """Consumer(prefetch=...) instead of the default."""
    client_path: Path | None = None
    """A directory holding another copy of `triage_client` (e.g. the code before a change,
    from `git archive`), imported by the instances instead of this one: side by side."""


def start_instances(
    stack: DevStack, arr: Arrangement, options: Options
) -> list[subprocess.Popen[bytes]]:
    client = options.client_path
    path = str(ROOT) if client is None else f"{client}{os.pathsep}{ROOT}"
    env = {**os.environ, "PYTHONPATH": path, "TRIAGE_TOKEN": stack.token}
    target = stack.describe()["proxies"][0]["target"]
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "perf" / "slots_instance.py"),
                "--target",
                target,
                "--consumers",
                str(arr.consumers),
                "--concurrency",
                str(arr.handlers),
                "--id",
                f"eff-{i}",
                *(
                    []
                    if options.switch_ms is None
                    else ["--switch-interval-ms", str(options.switch_ms)]
                ),
                *([] if options.prefetch is None else ["--prefetch", str(options.prefetch)]),
                *(["--shared-loop"] if arr.shared_loop else []),
                *(["--async"] if arr.asynchronous else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for i in range(arr.processes)
    ]


def wait_ready(procs: list[subprocess.Popen[bytes]]) -> None:
    def read(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        proc.stdout.readline()

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
        if reader.is_alive():
            raise TimeoutError("an instance never filled all its handler slots")


def stop_instances(procs: list[subprocess.Popen[bytes]]) -> list[list[float]]:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    records = []
    for index, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        lines = out.decode().strip().splitlines()
        if lines:
            records += [[*r, index] for r in json.loads(lines[-1])["records"]]
    return records


def run_arrangement(
    arr: Arrangement,
    kinds: list[tuple[str, int]],
    profile: Path | None,
    gil: bool = False,
    options: Options = Options(),
    ideal: bool = True,
) -> Run:
    overrides = {"commit": {"interval_s": 0.1}}
    name = f"bench-eff-{arr.processes}x{arr.consumers}x{arr.handlers}"
    frames: dict[str, list[tuple[str, float, float]]] = {}
    with DevStack(topic=name, proxy_overrides=overrides) as stack:
        values = (f"{k}:{ms}:{i}".encode() for i, (k, ms) in enumerate(kinds))
        produce_values(stack.broker.bootstrap, stack.topic, values)
        watcher = CommitWatcher(stack.broker.bootstrap, stack.group_id, stack.topic, 1)
        floor = run_ideal(arr, kinds) if ideal else None
        procs = start_instances(stack, arr, options)
        profiler = None
        try:
            wait_ready(procs)
            if profile is not None:
                pids = {"proxy": stack.proxy_process(0).pid}
                pids.update({f"instance-{i}": p.pid for i, p in enumerate(procs)})
                profiler = Profiler(pids, profile / name, gil=gil)
                time.sleep(2.0)  # py-spy attaches (slowly on a loaded machine)
            cpu0 = {
                "proxy": cpu_seconds(stack.proxy_process(0).pid),
                "instances": sum(cpu_seconds(p.pid) for p in procs),
                "broker": cpu_seconds(stack.broker.pid),
                "aws": cpu_seconds(stack.aws.pid),
            }
            t0 = time.monotonic()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"g")
                proc.stdin.flush()
            watcher.wait_for([len(kinds)], timeout_s=300, poll_s=0.005)
            committed = time.monotonic()
            cpu = {
                "proxy": cpu_seconds(stack.proxy_process(0).pid) - cpu0["proxy"],
                "instances": sum(cpu_seconds(p.pid) for p in procs) - cpu0["instances"],
                "broker": cpu_seconds(stack.broker.pid) - cpu0["broker"],
                "aws": cpu_seconds(stack.aws.pid) - cpu0["aws"],
            }
        finally:
            if profiler is not None:
                profiler.stop()
            records = stop_instances(procs)
            watcher.close()
        dead = count_dead_letters(stack.aws.endpoint_url, stack.table)
    if profiler is not None:
        frames = {name: top_frames(path) for name, path in profiler.files.items()}
    return Run(arr, t0, committed, records, dead, frames, cpu, floor)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(run: Run, kinds: list[tuple[str, int]], target: float = TARGET_EFFICIENCY) -> bool:
    arr = run.arrangement
    nominal = [ms / 1000 for _, ms in kinds]
    bound = fifo_bound(nominal, arr.slots)
    first: dict[int, list[float]] = {}
    for r in sorted(run.records, key=lambda r: r[1]):
        first.setdefault(int(r[0]), r)
    measured_durations = [first[o][2] - first[o][1] for o in sorted(first)]
    measured_bound = fifo_bound(measured_durations, arr.slots)
    makespan = max(r[2] for r in run.records) - run.t0
    busy = sum(r[2] - r[1] for r in run.records)
    by_thread: dict[tuple[int, int], list[list[float]]] = {}
    for r in run.records:
        by_thread.setdefault((int(r[6]), int(r[3])), []).append(r)
    gaps = []
    for rs in by_thread.values():
        rs.sort(key=lambda r: r[1])
        gaps += [b[1] - a[2] for a, b in itertools.pairwise(rs)]
    overrun = [
        (first[o][2] - first[o][1]) - ms / 1000
        for o, (kind, ms) in enumerate(kinds)
        if o in first and kind == "ordinary"
    ]
    lost = len(kinds) - len(first)
    ideal_rows: list[tuple[str, object]] = []
    if run.ideal is not None:
        ideal = run.ideal
        ideal_overrun = [
            (finish - start) - kinds[int(offset)][1] / 1000
            for offset, start, finish in ideal.records
            if kinds[int(offset)][0] == "ordinary"
        ]
        ideal_rows = [
            (
                "ideal in-process FIFO (no Kafka, no Triage): makespan, bound / it",
                f"{ideal.makespan:.3f} s, {efficiency(bound, ideal.makespan):.1%}",
            ),
            (
                "  its ordinary handlers' overrun, p50 / p99",
                f"{percentile(ideal_overrun, 0.5) * 1000:.2f} / "
                f"{percentile(ideal_overrun, 0.99) * 1000:.2f} ms",
            ),
            ("Triage against the ideal (ideal / measured)", f"{ideal.makespan / makespan:.1%}"),
            (
                "  its CPU (the handlers' own work and Python's)",
                f"{ideal.cpu:.2f} s ({ideal.cpu / len(kinds) * 1e6:.0f} us per message)",
            ),
        ]
    pills = sum(1 for k, _ in kinds if k == "poison")
    eff = efficiency(bound, makespan)
    ok = eff >= target and lost == 0 and run.dead == pills
    work_ms = next((ms for kind, ms in kinds if kind == "ordinary"), 0)
    print(f"\n{arr} ({arr.slots} slots)")
    print(
        table(
            [
                ("FIFO bound, exact durations", f"{bound:.3f} s"),
                ("measured, gate -> last handler returned", f"{makespan:.3f} s"),
                (
                    "efficiency (bound / measured)",
                    f"{eff:.1%} (target >= {target:.0%})",
                ),
                *ideal_rows,
                ("FIFO bound, measured handler durations", f"{measured_bound:.3f} s"),
                ("efficiency against that bound", f"{efficiency(measured_bound, makespan):.1%}"),
                (
                    f"ordinary handler overran its {work_ms} ms sleep, p50 / p99",
                    f"{percentile(overrun, 0.5) * 1000:.2f} / "
                    f"{percentile(overrun, 0.99) * 1000:.2f} ms",
                ),
                (
                    "slots idle (slots x measured - busy)",
                    f"{arr.slots * makespan - busy:.3f} slot-s of {arr.slots * makespan:.3f}",
                ),
                (
                    "hand-off gap per thread, mean / p50 / p99 / max",
                    f"{statistics.fmean(gaps) * 1000:.2f} / {percentile(gaps, 0.5) * 1000:.2f}"
                    f" / {percentile(gaps, 0.99) * 1000:.2f} / {max(gaps) * 1000:.1f} ms"
                    if gaps
                    else "-",
                ),
                ("gate -> everything committed", f"{run.committed - run.t0:.3f} s"),
                (
                    "CPU in that time, instances / proxy",
                    f"{run.cpu['instances']:.2f} / {run.cpu['proxy']:.2f} s "
                    f"({run.cpu['instances'] / len(kinds) * 1e6:.0f} / "
                    f"{run.cpu['proxy'] / len(kinds) * 1e6:.0f} us per message)",
                ),
                (
                    "  beside them: broker (Tansu) / AWS endpoint (moto)",
                    f"{run.cpu['broker']:.2f} / {run.cpu['aws']:.2f} s",
                ),
                ("deliveries / distinct offsets", f"{len(run.records)} / {len(first)}"),
                ("lost", lost),
                ("dead letters (poison pills)", f"{run.dead} ({pills})"),
            ]
        )
    )
    print_frames(run.frames)
    print(("PASS" if ok else "FAIL") + f" efficiency {arr}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--arrangements", default="1x4x8,2x1x16")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument(
        "--no-ideal",
        dest="ideal",
        action="store_false",
        help="skip the in-process FIFO run beside each arrangement",
    )
    parser.add_argument("--profile-gil", action="store_true", help="py-spy --gil")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval in the instances (an experiment; Python's default is 5)",
    )
    parser.add_argument(
        "--prefetch", type=int, default=None, help="Consumer(prefetch=N) (an experiment)"
    )
    parser.add_argument(
        "--client-path",
        type=Path,
        default=None,
        help="import triage_client from this directory in the instances (another version of "
        "the client, side by side: `git archive REV client_lib | tar -x -C DIR`, then "
        "DIR/client_lib)",
    )
    parser.add_argument(
        "--work-ms", type=int, default=ORDINARY_MS, help="an ordinary message's work (ms)"
    )
    parser.add_argument(
        "--target", type=float, default=TARGET_EFFICIENCY * 100, help="efficiency target (%%)"
    )
    args = parser.parse_args()
    options = Options(args.switch_interval_ms, args.prefetch, args.client_path)
    kinds = workload(args.messages, work_ms=args.work_ms)
    arrangements = [Arrangement.parse(a) for a in args.arrangements.split(",")]
    print(
        f"short-work efficiency on {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}: {args.messages} messages, "
        f"{args.work_ms} ms work, {SLOW_SHARE:.0%} at {SLOW_MS} ms, {POISON_SHARE:.0%} poison"
    )
    ok = True
    for arr in arrangements:
        ok = (
            report(
                run_arrangement(arr, kinds, args.profile, args.profile_gil, options, args.ideal),
                kinds,
                args.target / 100,
            )
            and ok
        )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
