"""ruff and mypy are part of the test suite, so CI keeps the code clean."""

from __future__ import annotations

import re
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


def test_the_architecture_layout_names_every_package_once() -> None:
    """The Layout table of docs/architecture.md has one row per package: every package
    folder appears once, and every path it names exists (a renamed or removed package
    fails here)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", layout, re.MULTILINE)
    assert len(rows) == len(set(rows)), "a path named twice"
    assert [row for row in rows if not (ROOT / row).exists()] == []
    packages = {
        init.parent.relative_to(ROOT).as_posix() + "/"
        for top in ("proxy/triage_proxy", "cli/triage_cli", "replay/triage_replay")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert sorted(packages - set(rows)) == []


def test_import_contracts() -> None:
    """The layering in pyproject.toml's [tool.importlinter]: the proxy's packages import
    only downward, and each dependency has one edge."""
    out = run(str(BIN / "lint-imports"), "--no-cache")
    assert out.returncode == 0, out.stdout + out.stderr
