"""`python -m triage_conformance`: run the scenarios against a client command (or the push
scenarios against a receiver command), report pass or fail per scenario, exit 1 on any
failure (see the package docstring)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from triage_conformance.checks import Outcome
from triage_conformance.push_scenarios import PUSH_SCENARIOS, describe_push, run_push_scenario
from triage_conformance.scenarios import SCENARIOS, describe, run_scenario
from triage_conformance.stack import Stack

PYTHON_CLIENT = f"{sys.executable} -m triage_conformance.python_client"


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the stack's stop()


def run(
    names: list[str], client: str, peer: str, work_dir: Path, partitions: int = 1
) -> list[Outcome]:
    """Run the client scenarios `names` in order on one stack."""
    return _run(
        names,
        lambda number: Stack(work_dir / f"stack-{number}", partitions),
        lambda name, stack: run_scenario(name, stack, client, peer, work_dir / "clients"),
    )


def run_push(
    names: list[str], receiver: str, batch: int, work_dir: Path, partitions: int = 1
) -> list[Outcome]:
    """Run the push scenarios `names` in order on one stack that delivers in batches of
    `batch` (1: binary mode) to the receiver command."""
    return _run(
        names,
        lambda number: Stack(work_dir / f"stack-{number}", partitions, push_batch=batch),
        lambda name, stack: run_push_scenario(name, stack, receiver, work_dir / "receivers"),
    )


def _run(
    names: list[str],
    new_stack: Callable[[int], Stack],
    play: Callable[[str, Stack], Outcome],
) -> list[Outcome]:
    """Run `names` in order on one stack; a failed scenario's stack is replaced, so what
    it left unsettled cannot fail the next one. Every process is stopped by PID."""
    outcomes: list[Outcome] = []
    stack: Stack | None = None
    try:
        for number, name in enumerate(names):
            if stack is None:
                stack = new_stack(number)
                stack.start()
            outcome = play(name, stack)
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
    under_test = parser.add_mutually_exclusive_group()
    under_test.add_argument("--client", default=None, help="the client command under test")
    under_test.add_argument(
        "--push-receiver", default=None, help="the push receiver command under test"
    )
    parser.add_argument("--peer", default=None, help="second instance for side-by-side")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="push: records per request (1: CloudEvents binary mode, more: JSON batches)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted([*SCENARIOS, *PUSH_SCENARIOS]),
        help="repeatable; default all (of the client's or the receiver's)",
    )
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=None, help="logs (kept)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name in SCENARIOS:
            print(f"{name:<13} {describe(name)}")
        for name in PUSH_SCENARIOS:
            print(f"{name:<13} (--push-receiver) {describe_push(name)}")
        return 0
    push = args.push_receiver is not None
    known = PUSH_SCENARIOS if push else SCENARIOS
    names = args.scenario or list(known)
    wrong = [n for n in names if n not in known]
    if wrong:
        parser.error(
            f"{', '.join(wrong)}: "
            + (
                "a client scenario (not with --push-receiver)"
                if push
                else "a push scenario (needs --push-receiver)"
            )
        )
    if args.batch < 1:
        parser.error("--batch must be 1 or more")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_exit)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="triage-conformance-"))
    started = time.monotonic()
    if push:
        mode = "binary mode" if args.batch == 1 else f"batches of {args.batch}"
        print(
            f"conformance: push receiver {args.push_receiver!r} ({mode}), logs in {work_dir}",
            flush=True,
        )
        outcomes = run_push(names, args.push_receiver, args.batch, work_dir, args.partitions)
    else:
        client = args.client or PYTHON_CLIENT
        print(f"conformance: client {client!r}, logs in {work_dir}", flush=True)
        outcomes = run(names, client, args.peer or client, work_dir, args.partitions)
    failed = [o.name for o in outcomes if not o.passed]
    print(
        f"{len(outcomes) - len(failed)}/{len(outcomes)} scenarios passed in "
        f"{time.monotonic() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
