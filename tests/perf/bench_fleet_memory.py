"""Fleet memory benchmark: resident memory of one proxy process serving 16 idle
partitions vs one serving 1 (without fleet processes a 64-partition topic needs 64).

Both processes run on the dev stack's broker and DynamoDB endpoint (DevStack with 17
partitions and no proxies of its own), each pinned with
`--partition`, idle (nothing produced). RSS is read from /proc once both are ready and
have settled for a few seconds. Target: ratio <= 2.0. Then, side by side over the same
`--idle-seconds` (default 20), the CPU each idle process uses (every thread, from /proc):
what a standby or quiet process costs the machine for nothing.

    .venv/bin/python -m tests.perf.bench_fleet_memory [--idle-seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.perf.common import table
from tests.perf.cpumeter import cpu_seconds
from triage_cli.devstack import DevStack, write_config
from triage_cli.embedded import HOST, free_port_block, stop_process

PARTITIONS = 16
TARGET_RATIO = 2.0
PER_PARTITION_MB = 5.0
"""Resident memory each partition beyond the first may add (issue 29)."""
SETTLE_S = 5.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/status", timeout=1) as r:
            doc = json.loads(r.read())
    except OSError:
        return False
    return bool(doc.get("ready"))


def start(stack: DevStack, name: str, partitions: list[int]) -> tuple[subprocess.Popen[bytes], int]:
    base = free_port_block(2)
    config = stack.state_dir / f"{name}.toml"
    values = stack.config_values(base)
    values["server"] = {"host": HOST, "port": base, "http_port": base + 1}
    write_config(config, values)
    command = [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config), "--slot", "0"]
    for p in partitions:
        command += ["-p", str(p)]
    log = open(stack.state_dir / f"{name}.log", "ab")  # noqa: SIM115
    with log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    return proc, base + 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    args = parser.parse_args()
    # One partition more than the big process serves: the small one pins it, so neither
    # waits for the other's lease.
    with DevStack(
        topic="bench-fleet-memory", partitions=PARTITIONS + 1, start_proxies=False
    ) as stack:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            one, one_http = start(stack, "one", [PARTITIONS])
            procs.append(one)
            many, many_http = start(stack, "many", list(range(PARTITIONS)))
            procs.append(many)
            deadline = time.monotonic() + 120
            while not (ready(one_http) and ready(many_http)):
                if time.monotonic() > deadline:
                    print("proxies not ready; see", stack.state_dir)
                    return 1
                time.sleep(0.5)
            time.sleep(SETTLE_S)
            a, b = rss_mb(one.pid), rss_mb(many.pid)
            cpu0 = (cpu_seconds(one.pid), cpu_seconds(many.pid))
            started = time.monotonic()
            time.sleep(args.idle_seconds)  # what is measured: the CPU idle processes use
            spent = time.monotonic() - started
            idle_one = (cpu_seconds(one.pid) - cpu0[0]) / spent * 100
            idle_many = (cpu_seconds(many.pid) - cpu0[1]) / spent * 100
        finally:
            for proc in procs:
                stop_process(proc, 30)
    ratio = b / a
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        table(
            [
                ("cores, load average", f"{os.cpu_count()}, {load}"),
                ("RSS, 1 partition (MB)", f"{a:.1f}"),
                (f"RSS, {PARTITIONS} partitions in one process (MB)", f"{b:.1f}"),
                (
                    f"RSS per partition beyond the first (MB; issue 29: <= {PER_PARTITION_MB})",
                    f"{(b - a) / (PARTITIONS - 1):.2f}",
                ),
                ("ratio", f"{ratio:.2f}"),
                (
                    f"idle CPU over {spent:.0f} s, 1 / {PARTITIONS} partitions (% of a core)",
                    f"{idle_one:.2f} / {idle_many:.2f}",
                ),
                ("target", f"<= {TARGET_RATIO}"),
                ("met", ratio <= TARGET_RATIO),
            ]
        )
    )
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
