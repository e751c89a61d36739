"""What a scenario's run must show, from the proxy's side and the client's JSON lines.

The proxy's side is the truth about settlement: the committed offset and the dead-letter
table. The JSON lines say what the handlers saw (byte-exact key, value, headers) and
how each ended. Lost is what the contract forbids above all: a produced message that is
neither acked (a `settled` line with outcome ack) nor in the dead-letter table.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from triage_conformance.client import Event
from triage_conformance.stack import MAX_ATTEMPTS, Produced
from triage_proxy.structs import DeadLetter, Headers

RETRY_ATTEMPTS = 3
"""The `retry` action raises Retry while attempt < 3: three starts, then an ack."""
PUSH_RETRY_RECEIPTS = 2
"""A receiver answers `retry` the first time it sees an id, then acks: two receipts."""
PUSH_NACK_STATUS = 400
"""What a receiver answers a `fail` record in binary mode (a default nack status)."""
BATCH_EMPTY_REASON = "batch item failure (deadletter)"
"""The reason the proxy records for a batch failure given with an empty reason."""
SHORTEST_KEPT_REASON = 200
"""A long nack reason may be cut, by the client (the Python and TypeScript clients keep 4,000
characters, ending in "...") or the proxy (4,000); at least this much of the message must be
in it."""


@dataclass
class Outcome:
    """One scenario's verdict and its figures."""

    name: str
    produced: int = 0
    acked: int = 0
    dead_lettered: int = 0
    lost: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.problems

    def fail(self, problem: str) -> None:
        self.problems.append(problem)


def text_of(value: bytes | None) -> str:
    """A `fail` message's error text: its value as UTF-8 with replacement."""
    return (value or b"").decode("utf-8", "replace")


def reason_matches(reason: str, text: str) -> bool:
    """`reason` is `Name: text` (the text possibly cut when long)."""
    name, sep, rest = reason.partition(": ")
    if not sep or not name:
        return False
    return text_kept(rest, text)


def text_kept(kept: str, text: str) -> bool:
    """`kept` is `text`, or its start when long (cut, maybe with an ellipsis)."""
    if kept == text:
        return True
    kept = kept.removesuffix("...").removesuffix("\u2026")
    return text.startswith(kept) and len(kept) >= SHORTEST_KEPT_REASON


def byte_exact(message: Produced, key: bytes | None, value: bytes | None, headers: Headers) -> bool:
    """What a handler, a receiver or a dead letter holds is the record as produced."""
    return (key, value, tuple(headers)) == (message.key, message.value, message.headers)


def check_settled(
    outcome: Outcome,
    by_key: dict[tuple[int, int], Produced],
    acked: set[tuple[int, int]],
    dead: dict[tuple[int, int], DeadLetter],
) -> dict[tuple[int, int], DeadLetter]:
    """The rule every run shares: each produced record is acked or dead-lettered (lost
    = 0), and each dead letter is the record byte-exact. Returns this run's dead letters."""
    ours = {k: dl for k, dl in dead.items() if k in by_key}
    outcome.produced = len(by_key)
    outcome.acked = len(acked)
    outcome.dead_lettered = len(ours)
    lost = [k for k in by_key if k not in acked and k not in ours]
    outcome.lost = len(lost)
    if lost:
        outcome.fail(f"lost {len(lost)}: neither acked nor dead-lettered, e.g. {lost[:5]}")
    for where, letter in ours.items():
        record = letter.record
        if not byte_exact(by_key[where], record.key, record.value, record.headers):
            outcome.fail(f"{where}: the dead letter is not byte-exact")
    return ours


def check_run(
    outcome: Outcome,
    produced: list[Produced],
    events: list[Event],
    dead: dict[tuple[int, int], DeadLetter],
    *,
    committed: bool,
    bad_lines: list[str],
) -> None:
    """The checks every client scenario makes: lost = 0, byte-exact, each action's result."""
    by_key = {(p.partition, p.offset): p for p in produced}
    if not committed:
        outcome.fail("the committed offset did not reach the end of what was produced")
    for line in bad_lines[:3]:
        outcome.fail(f"a stdout line is not a contract event: {line!r}")
    starts: dict[tuple[int, int], list[Event]] = defaultdict(list)
    acked: set[tuple[int, int]] = set()
    for event in events:
        where = (event.partition, event.offset)
        message = by_key.get(where)
        if message is None:
            outcome.fail(f"an event for {where}, which this scenario did not produce")
            continue
        if event.kind == "start":
            starts[where].append(event)
            if not byte_exact(message, event.blob("key"), event.blob("value"), event.headers()):
                outcome.fail(f"{where}: key, value or headers not byte-exact")
        elif event.kind == "settled" and event.outcome == "ack":
            acked.add(where)
    ours = check_settled(outcome, by_key, acked, dead)
    for where, message in sorted(by_key.items()):
        action = message.action
        dl = ours.get(where)
        if action == "fail":
            if dl is None:
                outcome.fail(f"{where} (fail) was not dead-lettered")
            elif not reason_matches(dl.reason, text_of(message.value)):
                outcome.fail(f"{where} (fail): reason {dl.reason[:80]!r} is not `Name: message`")
            if where in acked:
                outcome.fail(f"{where} (fail) was acked")
            continue
        if dl is not None:
            outcome.fail(f"{where} ({action}) was dead-lettered: {dl.reason[:120]!r}")
        if action == "retry":
            attempts = sorted(e.attempt for e in starts[where])
            if attempts[:RETRY_ATTEMPTS] != list(range(1, RETRY_ATTEMPTS + 1)):
                outcome.fail(f"{where} (retry): attempts {attempts}, expected 1, 2, 3")
        if any(e.attempt > MAX_ATTEMPTS for e in starts[where]):
            outcome.fail(f"{where}: delivered past max_attempts")


def push_reason_matches(reason: str, value: bytes | None, *, batch: bool) -> bool:
    """A `fail` record's dead-letter reason: in binary mode the proxy's `HTTP 400: <body>`
    (the body is the value), in a batch the receiver's `reason` (the value as text)."""
    text = text_of(value)
    if batch:
        return reason == BATCH_EMPTY_REASON if not text else text_kept(reason, text)
    prefix = f"HTTP {PUSH_NACK_STATUS}: "
    return reason.startswith(prefix) and text_kept(reason.removeprefix(prefix), text)


def check_push(
    outcome: Outcome,
    produced: list[Produced],
    events: list[Event],
    dead: dict[tuple[int, int], DeadLetter],
    *,
    committed: bool,
    bad_lines: list[str],
    batch: bool,
) -> None:
    """The checks every push scenario makes. What the receiver answered follows from its
    contract (a `received` line comes before the answer), so a record is acked once the
    receiver saw it as often as its action needs: `retry` twice, `fail` never, others once."""
    by_key = {(p.partition, p.offset): p for p in produced}
    if not committed:
        outcome.fail("the committed offset did not reach the end of what was produced")
    for line in bad_lines[:3]:
        outcome.fail(f"a stdout line is not a contract event: {line!r}")
    receipts: dict[tuple[int, int], int] = defaultdict(int)
    for event in events:
        where = (event.partition, event.offset)
        message = by_key.get(where)
        if message is None:
            outcome.fail(f"a receipt of {where}, which this scenario did not produce")
            continue
        if event.kind != "received":
            outcome.fail(f"{where}: event {event.kind!r}, a receiver prints only `received`")
            continue
        receipts[where] += 1
        if not byte_exact(message, event.blob("key"), event.blob("value"), event.headers()):
            outcome.fail(f"{where}: key, value or headers not byte-exact as received")
    needed = {"fail": None, "retry": PUSH_RETRY_RECEIPTS}
    acked = {
        where
        for where, message in by_key.items()
        if (need := needed.get(message.action, 1)) is not None and receipts[where] >= need
    }
    ours = check_settled(outcome, by_key, acked, dead)
    for where, message in sorted(by_key.items()):
        action = message.action
        dl = ours.get(where)
        if action == "fail":
            if dl is None:
                outcome.fail(f"{where} (fail) was not dead-lettered")
            elif not push_reason_matches(dl.reason, message.value, batch=batch):
                outcome.fail(f"{where} (fail): reason {dl.reason[:80]!r} does not carry the value")
            continue
        if dl is not None:
            outcome.fail(f"{where} ({action}) was dead-lettered: {dl.reason[:120]!r}")
        if action == "retry" and receipts[where] < PUSH_RETRY_RECEIPTS:
            outcome.fail(
                f"{where} (retry): received {receipts[where]} time(s), expected a redelivery "
                "after the retry answer"
            )


def starts_by_offset(events: list[Event]) -> dict[tuple[int, int], list[Event]]:
    out: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for event in events:
        if event.kind == "start":
            out[event.partition, event.offset].append(event)
    return out
