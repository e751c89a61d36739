"""The conformance kit against the Python client (every scenario must pass) and against
the two reference push receivers (every push scenario, binary and batched).

Runs `python -m triage_conformance` as a child process (it starts and stops its own
stack and receivers by PID), with the checkout's root on PYTHONPATH.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from triage_conformance.push_scenarios import PUSH_SCENARIOS
from triage_conformance.scenarios import SCENARIOS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NODE_RECEIVER = ROOT / "conformance" / "receivers" / "receiver.js"
PUSH_BATCH = 8
"""The batched runs' `--batch`: small, so a scenario's records span several requests."""


def kit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "triage_conformance", "--work-dir", str(tmp_path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )


def test_the_python_client_passes_every_scenario(tmp_path: Path) -> None:
    out = kit(tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    for name in SCENARIOS:
        assert f"PASS  {name}" in report, report
    assert "lost 0" in report


def test_a_failing_client_fails_the_kit(tmp_path: Path) -> None:
    """A client that acks nothing (it exits at once) must not pass: the kit's checks bite."""
    out = kit(tmp_path, "--client", f"{sys.executable} -c pass", "--scenario", "wrong-token")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  wrong-token" in out.stdout


def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("`node` is not on PATH: the Node reference receiver needs Node.js 20")
    return path


@pytest.mark.parametrize("batch", [1, PUSH_BATCH], ids=["binary", "batch"])
@pytest.mark.parametrize("receiver", ["python", "node"])
def test_the_reference_receivers_pass_every_push_scenario(
    tmp_path: Path, receiver: str, batch: int
) -> None:
    if receiver == "python":
        command = shlex.join([sys.executable, "-m", "triage_conformance.python_receiver"])
    else:
        command = shlex.join([node(), str(NODE_RECEIVER)])
    out = kit(tmp_path, "--push-receiver", command, "--batch", str(batch))
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    for name in PUSH_SCENARIOS:
        assert f"PASS  {name}" in report, report


def test_a_receiver_that_answers_every_post_501_fails_the_kit(tmp_path: Path) -> None:
    """`http.server` listens but answers POST 501: retried to the attempt limit, the healthy
    records are dead-lettered and nothing is received. The push checks must bite."""
    server = f"exec {shlex.quote(sys.executable)} -m http.server --bind 127.0.0.1 "
    command = shlex.join(["sh", "-c", server + '"$TRIAGE_PUSH_PORT"'])
    out = kit(tmp_path, "--push-receiver", command, "--scenario", "push-poison")
    report = out.stdout + out.stderr
    assert out.returncode == 1, report
    assert "FAIL  push-poison" in out.stdout
    assert "was dead-lettered" in out.stdout
