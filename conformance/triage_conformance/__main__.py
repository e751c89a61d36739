"""`python -m triage_conformance`: run the scenarios against a client command, report
pass or fail per scenario, exit 1 on any failure (see the package docstring)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

from triage_conformance.checks import Outcome
from triage_conformance.scenarios import SCENARIOS, describe, run_scenario
from triage_conformance.stack import Stack

PYTHON_CLIENT = f"{sys.executable} -m triage_conformance.python_client"


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the stack's stop()


def run(
    names: list[str], client: str, peer: str, work_dir: Path, partitions: int = 1
) -> list[Outcome]:
    """Run `names` in order on one stack; a failed scenario's stack is replaced, so what
    it left unsettled cannot fail the next one. Every process is stopped by PID."""
    outcomes: list[Outcome] = []
    stack: Stack | None = None
    try:
        for number, name in enumerate(names):
            if stack is None:
                stack = Stack(work_dir / f"stack-{number}", partitions)
                stack.start()
            outcome = run_scenario(name, stack, client, peer, work_dir / "clients")
            outcomes.append(outcome)
            print(render(outcome), flush=True)
            if not outcome.passed:
                stack.stop()
                stack = None
    finally:
        if stack is not None:
            stack.stop()
    return outcomes


def render(outcome: Outcome) -> str:
    verdict = "PASS" if outcome.passed else "FAIL"
    line = (
        f"{verdict}  {outcome.name:<13} produced {outcome.produced:>4}  acked {outcome.acked:>4}"
        f"  dead-lettered {outcome.dead_lettered:>3}  lost {outcome.lost}"
        f"  ({outcome.seconds:.1f} s)"
    )
    return "\n".join([line, *(f"      - {p}" for p in outcome.problems)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triage_conformance", description=__doc__)
    parser.add_argument("--client", default=PYTHON_CLIENT, help="the client command under test")
    parser.add_argument("--peer", default=None, help="second instance for side-by-side")
    parser.add_argument(
        "--scenario", action="append", choices=sorted(SCENARIOS), help="repeatable; default all"
    )
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=None, help="logs (kept)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name in SCENARIOS:
            print(f"{name:<13} {describe(name)}")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_exit)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="triage-conformance-"))
    names = args.scenario or list(SCENARIOS)
    print(f"conformance: client {args.client!r}, logs in {work_dir}", flush=True)
    started = time.monotonic()
    outcomes = run(names, args.client, args.peer or args.client, work_dir, args.partitions)
    failed = [o.name for o in outcomes if not o.passed]
    print(
        f"{len(outcomes) - len(failed)}/{len(outcomes)} scenarios passed in "
        f"{time.monotonic() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
