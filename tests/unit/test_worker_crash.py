"""A worker that dies ends the run at once, with the dead worker's test failed, and what
it had started is killed when the run ends (tests/leftovers.py).

With pytest-xdist 3.8's default (restart a dead worker, up to four per worker),
`--dist loadgroup` replaced the worker and then handed out nothing more: every worker
idle, the run stuck until CI's own timeout. pyproject's `--max-worker-restart=0` turns
that into a failed run; this runs pyproject's addopts on a module whose test kills its
own worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CRASHING_MODULE = """
import os, signal, subprocess, sys

import pytest


@pytest.mark.parametrize("n", range(6))
def test_one(n):
    if n == 2:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        with open(os.environ["CHILD_PID_FILE"], "w") as out:
            out.write(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_worker_fails_the_run_within_its_bound(tmp_path: Path) -> None:
    (tmp_path / "test_crashing.py").write_text(CRASHING_MODULE)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),  # its addopts, with -n 2 for this small run
            "--rootdir",
            str(tmp_path),
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",  # the repo's hooks: the marker and the sweep
            str(tmp_path / "test_crashing.py"),
        ],
        cwd=tmp_path,
        env={
            # not an xdist worker's environment, which would make the nested run's
            # controller take itself for a worker (tests/conftest.py's WORKER), nor the
            # options given to this run (PYTEST_ADDOPTS)
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
            "PYTHONPATH": str(ROOT),
            "CHILD_PID_FILE": str(tmp_path / "child.pid"),
        },
        capture_output=True,
        text=True,
        timeout=120,  # the stuck run waited forever; a run that ends takes seconds
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "crashed while running" in run.stdout, run.stdout
    assert "test_crashing.py::test_one[2]" in run.stdout, run.stdout
    child = int((tmp_path / "child.pid").read_text())
    assert f"pid {child}: " in run.stdout, run.stdout
    assert (
        not Path(f"/proc/{child}").exists()
        or b"time.sleep(300)" not in Path(f"/proc/{child}/cmdline").read_bytes()
    ), "the dead worker's child outlived the run"
