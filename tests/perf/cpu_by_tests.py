"""Which tests cost the test run its CPU: each test's own, and that of the processes it
started.

Why: `cpu_by_process` says which kinds of process use the run's CPU (proxies, moto
servers, JVMs), not which tests start them. This pytest plugin records, for every test,
the CPU its pytest process used while the test ran (`time.process_time`), the CPU of the
child processes reaped meanwhile (`RUSAGE_CHILDREN`: a child counts once it has been
waited for, with the CPU of its own reaped children), and the wall time; then the
command below adds them up by module or by test.

    .venv/bin/python -m pytest -p tests.perf.cpu_by_tests --cpu-by-tests DIR [pytest arguments]
    .venv/bin/python -m tests.perf.cpu_by_tests DIR [--by module|test] [--most 30]

(`python -m pytest`, not `.venv/bin/pytest`: the plugin is imported from the checkout,
before any conftest puts it on the path.) Each pytest process that ran tests (each xdist
worker) writes its own file into DIR.

The teardown that ends a module (its module fixtures: a JVM, a compiled package) or the
session (a worker's moto server) runs inside the last test's teardown; it is recorded
apart, as "MODULE (teardown)" and "(session teardown)", not charged to that test. A child
that is never waited for (a daemon that outlives its parent) is not counted. Linux and
macOS (getrusage).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.perf.cpumeter import reaped_children_cpu

SESSION_TEARDOWN = "(session teardown)"
MODULE_TEARDOWN = " (teardown)"
"""After a module's name: the row of the teardown that ends that module."""


@dataclass
class Row:
    """One test's (or teardown's) CPU seconds and wall seconds."""

    name: str
    own_s: float
    children_s: float
    wall_s: float

    @property
    def total_s(self) -> float:
        return self.own_s + self.children_s


class _Meter:
    """CPU and wall time since it was made."""

    def __init__(self) -> None:
        self.own, self.children = time.process_time(), reaped_children_cpu()
        self.wall = time.time()

    def row(self, name: str) -> Row:
        return Row(
            name,
            time.process_time() - self.own,
            reaped_children_cpu() - self.children,
            time.time() - self.wall,
        )


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def teardown_name(test: str, next_test: str | None) -> str | None:
    """What the teardown after test `test` (a node id) ends besides the test: the session,
    its module, or nothing (None: the next test shares the module's fixtures)."""
    if next_test is None:
        return SESSION_TEARDOWN
    if module_of(next_test) != module_of(test):
        return module_of(test) + MODULE_TEARDOWN
    return None


class Recorder:
    """The plugin: one row per test, and one per teardown that ends a module or the
    session; written to DIR at the session's end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rows: list[Row] = []
        self._teardown: Row | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, None, None]:
        meter = _Meter()
        self._teardown = None
        yield
        test = meter.row(item.nodeid)
        if (apart := self._teardown) is not None:
            test.own_s -= apart.own_s
            test.children_s -= apart.children_s
            test.wall_s -= apart.wall_s
            self.rows.append(apart)
        self.rows.append(test)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, None, None]:
        meter = _Meter()
        yield
        following = nextitem.nodeid if nextitem is not None else None
        if (name := teardown_name(item.nodeid, following)) is not None:
            self._teardown = meter.row(name)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.rows:  # xdist's controller runs no test
            return
        process = os.environ.get("PYTEST_XDIST_WORKER", "controller")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{process}-{os.getpid()}.json"
        path.write_text(json.dumps([vars(row) for row in self.rows]))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-by-tests",
        metavar="DIR",
        help="write each test's CPU, and its reaped child processes', to DIR "
        "(tests/perf/cpu_by_tests.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    folder = config.getoption("--cpu-by-tests")
    if folder:
        config.pluginmanager.register(Recorder(Path(folder)), "cpu-by-tests-recorder")


def read(folder: Path) -> list[Row]:
    rows = []
    for path in sorted(folder.glob("*.json")):
        rows += [Row(**row) for row in json.loads(path.read_text())]
    return rows


def is_teardown(name: str) -> bool:
    return name == SESSION_TEARDOWN or name.endswith(MODULE_TEARDOWN)


def group_of(name: str, by: str) -> str:
    """A row's group: its module ("module"; a teardown's row stays apart) or its test
    with the parameters left out ("test")."""
    if by == "module" and not is_teardown(name):
        return module_of(name)
    return name.split("[", 1)[0]


def totals(rows: Iterable[Row], by: str) -> list[Row]:
    """Rows added up by module (a teardown row stays apart) or by test (parameters
    together), costliest first."""
    summed: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        sums = summed[group_of(row.name, by)]
        sums[0] += row.own_s
        sums[1] += row.children_s
        sums[2] += row.wall_s
    out = [Row(key, *sums) for key, sums in summed.items()]
    return sorted(out, key=lambda row: -row.total_s)


def report(rows: list[Row], by: str, most: int) -> list[str]:
    own = sum(row.own_s for row in rows)
    children = sum(row.children_s for row in rows)
    lines = [
        f"{len(rows)} rows: {own + children:.1f} s of CPU, {own:.1f} s in the pytest "
        f"processes and {children:.1f} s in the processes they started",
        f"{'CPU s':>8} {'share':>6} {'own':>7} {'children':>8} {'wall s':>7}  {by}",
    ]
    whole = (own + children) or 1.0
    for row in totals(rows, by)[:most]:
        lines.append(
            f"{row.total_s:8.1f} {row.total_s / whole:6.1%} {row.own_s:7.1f} "
            f"{row.children_s:8.1f} {row.wall_s:7.1f}  {row.name}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the --cpu-by-tests DIR of a run")
    parser.add_argument("--by", choices=("module", "test"), default="module")
    parser.add_argument("--most", type=int, default=30)
    args = parser.parse_args(argv)
    rows = read(args.folder)
    if not rows:
        parser.error(f"no rows in {args.folder}: run pytest with --cpu-by-tests first")
    print("\n".join(report(rows, args.by, args.most)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
