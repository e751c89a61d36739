"""The push scenarios: each starts the receiver command on the stack's push port,
produces its records, waits for the commit and judges (`checks.check_push`).

The stack delivers through one `[[push]]` target (binary mode, or batches of `--batch`);
no client runs. As with the client scenarios, each ends with everything it produced
settled, and the runner starts a fresh stack after a failed one. Between scenarios no
receiver listens, which costs nothing: with no record pending the proxy sends nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from triage_conformance.checks import Outcome, check_push
from triage_conformance.receiver import ReceiverProcess
from triage_conformance.scenarios import (
    COMMIT_TIMEOUT_S,
    EXIT_TIMEOUT_S,
    START_TIMEOUT_S,
    byte_exact_messages,
    run_judged,
)
from triage_conformance.stack import Message, Produced, Stack

RESTART_GAP_S = 1.0
"""How long a killed receiver stays down: long enough for the proxy to meet a refused
connection (an outage, which must use no attempt), short enough that its pause is brief."""


@dataclass
class PushContext:
    """What a push scenario is given."""

    stack: Stack
    receiver: str
    """The receiver command under test."""
    log_dir: Path
    receivers: list[ReceiverProcess]
    """Every receiver started so far in this scenario (the runner kills what still runs)."""

    @property
    def batch(self) -> bool:
        return (self.stack.push_batch or 1) > 1

    @property
    def mode(self) -> str:
        return "batch" if self.batch else "binary"

    def spawn(self, name: str) -> ReceiverProcess:
        """Start the receiver and wait until it listens."""
        label = f"receiver-{name}-{len(self.receivers)}"
        receiver = ReceiverProcess(
            self.receiver,
            name=label,
            port=self.stack.push_port,
            mode=self.mode,
            log_path=self.log_dir / f"{label}.stderr.log",
        )
        self.receivers.append(receiver)
        receiver.wait_listening(START_TIMEOUT_S)
        return receiver

    def finish(self, outcome: Outcome, produced: list[Produced]) -> None:
        """Wait for the commit, stop the receivers, run the checks."""
        committed = self.stack.wait_committed(
            produced, COMMIT_TIMEOUT_S, lambda: any(r.wait(0) is None for r in self.receivers)
        )
        for receiver in self.receivers:
            receiver.stop(EXIT_TIMEOUT_S)
        check_push(
            outcome,
            produced,
            [e for r in self.receivers for e in r.snapshot()],
            self.stack.dead_letters(),
            committed=committed,
            bad_lines=[line for r in self.receivers for line in r.bad_lines],
            batch=self.batch,
        )


def push_poison(ctx: PushContext, outcome: Outcome) -> None:
    """A receiver that rejects a record (400, or `deadletter` in a batch) has it
    dead-lettered with its reason; the rest of the same requests are acked."""
    messages = [Message(b"fine %d" % i) for i in range(12)]
    for i in range(4):
        messages.insert(3 * i + 1, Message(f"poison pill {i}: ünïcödé €".encode(), "fail"))
    messages.append(Message(b"\xff\xfe not UTF-8 \x00", "fail"))
    ctx.spawn("poison")
    produced = ctx.stack.produce(messages)
    ctx.finish(outcome, produced)


def push_retry(ctx: PushContext, outcome: Outcome) -> None:
    """A receiver that asks for a retry (`triage-action: retry`, or `retry` in a batch)
    gets the record again and acks it; nothing is dead-lettered."""
    messages = [Message(b"retry %d" % i, "retry") for i in range(6)]
    messages += [Message(b"plain %d" % i) for i in range(6)]
    ctx.spawn("retry")
    produced = ctx.stack.produce(messages)
    ctx.finish(outcome, produced)


def push_bytes(ctx: PushContext, outcome: Outcome) -> None:
    """`byte_exact_messages`: the receiver recovers every byte from the CloudEvent, and a
    rejected one is dead-lettered byte-exact."""
    messages = byte_exact_messages()
    ctx.spawn("bytes")
    produced = ctx.stack.produce(messages)
    ctx.finish(outcome, produced)


def push_restart(ctx: PushContext, outcome: Outcome) -> None:
    """The receiver is killed -9 with requests in flight and started again on the same
    port: what it held is delivered again, nothing is lost, nothing healthy is
    dead-lettered (a reset makes suspects, a refused connection uses no attempt)."""
    # Each record keeps the receiver busy 1 s: the kill lands while requests are in flight
    # even when the kit sees the fourth record late (at 200 ms a loaded machine once saw
    # the first receiver finish all 24 before the kill).
    messages = [Message(b"job %d" % i, "sleep:1000") for i in range(24)]
    first = ctx.spawn("restart")
    produced = ctx.stack.produce(messages)
    if not first.wait_for("received", 4, START_TIMEOUT_S):
        outcome.fail("the receiver received fewer than 4 records")
    first.kill()
    time.sleep(RESTART_GAP_S)
    second = ctx.spawn("restart")
    ctx.finish(outcome, produced)
    if not second.snapshot():
        outcome.fail("the restarted receiver received nothing (was the first killed mid-run?)")


PushScenario = Callable[[PushContext, Outcome], None]
PUSH_SCENARIOS: dict[str, PushScenario] = {
    "push-poison": push_poison,
    "push-retry": push_retry,
    "push-bytes": push_bytes,
    "push-restart": push_restart,
}
"""Name -> push scenario, in the order a full run takes them."""


def describe_push(name: str) -> str:
    doc = PUSH_SCENARIOS[name].__doc__ or ""
    return " ".join(doc.split())


def run_push_scenario(name: str, stack: Stack, receiver: str, log_dir: Path) -> Outcome:
    """Run one push scenario; every receiver it started is stopped (killed if need be)."""

    def start(scenario_dir: Path) -> tuple[Callable[[Outcome], None], Sequence[ReceiverProcess]]:
        ctx = PushContext(stack, receiver, scenario_dir, [])
        return (lambda outcome: PUSH_SCENARIOS[name](ctx, outcome)), ctx.receivers

    return run_judged(name, log_dir, start)
