"""ruff and mypy are part of the test suite, so CI keeps the code clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_check() -> None:
    out = run(str(BIN / "ruff"), "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = run(str(BIN / "ruff"), "format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict() -> None:
    out = run(str(BIN / "mypy"))
    assert out.returncode == 0, out.stdout + out.stderr
