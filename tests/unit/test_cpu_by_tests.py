"""The per-test CPU recorder (tests/perf/cpu_by_tests.py): its sums, and a real pytest
run whose tests and fixture teardowns start processes that use a known CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.perf.cpu_by_tests import SESSION_TEARDOWN, Row, read, report, teardown_name, totals

ROOT = Path(__file__).resolve().parents[2]

BURN = (
    "import subprocess, sys\n"
    "def burn(seconds):\n"
    "    code = 'import time\\nt = time.process_time()\\n'"
    " f'while time.process_time() - t < {seconds}: pass'\n"
    "    subprocess.run([sys.executable, '-c', code], check=True)\n"
)


def test_a_teardown_is_named_by_what_it_ends() -> None:
    assert teardown_name("a.py::t1", "a.py::t2") is None
    assert teardown_name("a.py::t2", "b.py::t1") == "a.py (teardown)"
    assert teardown_name("b.py::t1", None) == SESSION_TEARDOWN


def test_totals_add_up_by_module_or_by_test_costliest_first() -> None:
    rows = [
        Row("a.py::t[1]", 0.5, 1.0, 2.0),
        Row("a.py::t[2]", 0.5, 0.0, 1.0),
        Row("a.py (teardown)", 0.0, 3.0, 0.5),
        Row("b.py::u", 0.1, 0.1, 0.2),
    ]
    by_module = totals(rows, "module")
    assert [(r.name, r.total_s) for r in by_module] == [
        ("a.py (teardown)", 3.0),
        ("a.py", 2.0),
        ("b.py", 0.2),
    ]
    assert [r.name for r in totals(rows, "test")][:2] == ["a.py (teardown)", "a.py::t"]
    lines = report(rows, "module", 2)
    assert lines[0].startswith("4 rows: 5.2 s of CPU, 1.1 s in the pytest processes")
    assert len(lines) == 4
    assert lines[-1].endswith("a.py")


def test_a_real_run_charges_each_child_to_its_test_and_teardowns_apart(tmp_path: Path) -> None:
    (tmp_path / "burn.py").write_text(BURN)
    (tmp_path / "test_a.py").write_text(
        "import pytest\nfrom burn import burn\n\n"
        "@pytest.fixture(scope='module')\n"
        "def costly_teardown():\n    yield\n    burn(0.4)\n\n"
        "def test_starts_a_child(costly_teardown):\n    burn(0.4)\n\n"
        "def test_starts_nothing(costly_teardown):\n    pass\n"
    )
    (tmp_path / "test_b.py").write_text("def test_last():\n    pass\n")
    out = tmp_path / "cpu"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-p", "tests.perf.cpu_by_tests", "--cpu-by-tests", str(out)),
            *("--rootdir", str(tmp_path), str(tmp_path)),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {row.name: row for row in read(out)}
    assert set(rows) == {
        "test_a.py::test_starts_a_child",
        "test_a.py::test_starts_nothing",
        "test_a.py (teardown)",
        "test_b.py::test_last",
        SESSION_TEARDOWN,
    }
    assert rows["test_a.py::test_starts_a_child"].children_s >= 0.35
    assert rows["test_a.py (teardown)"].children_s >= 0.35
    assert rows["test_a.py::test_starts_nothing"].children_s < 0.1
    assert rows["test_b.py::test_last"].children_s < 0.1
