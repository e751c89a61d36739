"""The conformance kit against the Python client: every scenario must pass.

Runs `python -m triage_conformance` as a child process (it starts and stops its own
stack by PID), with the checkout's root on PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from triage_conformance.scenarios import SCENARIOS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_python_client_passes_every_scenario(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "triage_conformance", "--work-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    for name in SCENARIOS:
        assert f"PASS  {name}" in report, report
    assert "lost 0" in report


def test_a_failing_client_fails_the_kit(tmp_path: Path) -> None:
    """A client that acks nothing (it exits at once) must not pass: the kit's checks bite."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "triage_conformance",
            "--client",
            f"{sys.executable} -c pass",
            "--scenario",
            "wrong-token",
            "--work-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  wrong-token" in out.stdout
