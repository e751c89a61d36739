"""tests/perf/cpu_by_process.py counts the CPU of the processes a command starts, by kind,
and exits as the command did."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.perf.cpu_by_process import kind

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass"
SPAWN = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', *sys.argv[1:]], check=True)"
GRANDCHILD = f"{SPAWN}\nsys.exit(3)"
"""The command: a Python that starts one that starts a busy one (a grandchild is
counted because its parent is), then exits 3."""


def test_a_grandchild_s_cpu_is_counted_and_the_exit_code_kept() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.perf.cpu_by_process",
            "--every",
            "0.05",
            "--",
            sys.executable,
            "-c",
            GRANDCHILD,
            SPAWN,
            BUSY,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 3, out.stderr
    row = re.search(r"^\s*([\d.]+)\s+[\d.]+%\s+(\d+)\s+[\d.]+\s+other Python$", out.stdout, re.M)
    assert row, out.stdout
    # the three, with at least most of the busy one's 0.8 s of CPU
    assert float(row.group(1)) >= 0.6, out.stdout
    assert int(row.group(2)) == 3, out.stdout


def test_kinds_are_read_from_the_command_line() -> None:
    assert kind("/v/bin/python -m triage_cli.main proxy --config c.toml") == "proxy"
    assert kind("/v/bin/python -m triage_cli.main status -c c.toml") == "triage command"
    assert kind("/v/bin/python -m triage_cli.motoserver -p 1") == "moto server"
    assert kind("/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))") == (
        "pytest worker (tests in-process)"
    )
    assert kind("/usr/bin/java -cp x org.apache.spark.deploy.worker.Worker") == "Spark JVM"
    assert kind("/opt/bin/something --flag") == "something"
