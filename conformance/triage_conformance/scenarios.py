"""The scenarios: each produces its messages, drives the client command, and judges.

Every scenario ends with every message it produced settled (the committed offset past
them), so the next one starts on a quiet partition; the runner starts a fresh stack
after a failed one. Sizes are small on purpose (the suite runs in CI on a busy 2-core
machine) but each still shows its point: a lease kept past the deadline by Extend, a
drain that releases what never started, a kill that loses nothing.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from triage_conformance.checks import Outcome, check_run, starts_by_offset
from triage_conformance.client import ChildProcess, ClientProcess, Event
from triage_conformance.stack import ACK_DEADLINE_S, Message, Produced, Stack

COMMIT_TIMEOUT_S = 60.0
"""Longest wait for the commit to pass a scenario's messages (a busy machine is slow)."""
EXIT_TIMEOUT_S = 20.0
"""Longest wait for a client to exit after SIGTERM, or after a refused token."""
START_TIMEOUT_S = 30.0
"""Longest wait for a client's first handler starts (process start, connect)."""


@dataclass
class Context:
    """What a scenario is given."""

    stack: Stack
    client: str
    """The client command under test."""
    peer: str
    """The command of the second instance in `side-by-side` (default: the client)."""
    log_dir: Path
    clients: list[ClientProcess]
    """Every client started so far in this scenario (the runner kills what still runs)."""

    def spawn(
        self, name: str, *, concurrency: int = 4, token: str | None = None, peer: bool = False
    ) -> ClientProcess:
        consumer_id = f"conformance-{name}-{len(self.clients)}"
        client = ClientProcess(
            self.peer if peer else self.client,
            endpoint=self.stack.endpoint,
            token=self.stack.token if token is None else token,
            consumer_id=consumer_id,
            concurrency=concurrency,
            log_path=self.log_dir / f"{consumer_id}.stderr.log",
        )
        self.clients.append(client)
        return client

    def events(self) -> list[Event]:
        return [e for c in self.clients for e in c.snapshot()]

    def bad_lines(self) -> list[str]:
        return [line for c in self.clients for line in c.bad_lines]

    def finish(self, outcome: Outcome, produced: list[Produced]) -> None:
        """Wait for the commit, stop the clients (SIGTERM must exit 0), run the checks."""
        committed = self.stack.wait_committed(
            produced,
            COMMIT_TIMEOUT_S,
            lambda: any(c.wait(0) is None for c in self.clients),
        )
        for client in self.clients:
            if client.wait(0) is not None:
                continue  # ended earlier: the scenario judged that
            code = client.stop(EXIT_TIMEOUT_S)
            if code != 0:
                outcome.fail(f"{client.consumer_id} exited {code} on SIGTERM, expected 0")
        check_run(
            outcome,
            produced,
            self.events(),
            self.stack.dead_letters(),
            committed=committed,
            bad_lines=self.bad_lines(),
        )


def poison(ctx: Context, outcome: Outcome) -> None:
    """A handler that fails nacks: the message is dead-lettered with `Name: message`."""
    messages = [Message(b"fine %d" % i) for i in range(12)]
    for i in range(4):
        messages.insert(3 * i + 1, Message(f"poison pill {i}: ünïcödé €".encode(), "fail"))
    messages.append(Message(b"\xff\xfe not UTF-8 \x00", "fail"))
    produced = ctx.stack.produce(messages)
    ctx.spawn("poison")
    ctx.finish(outcome, produced)


def retry(ctx: Context, outcome: Outcome) -> None:
    """A handler that asks for Retry is redelivered (attempt 1, 2, 3), then acks."""
    messages = [Message(b"retry %d" % i, "retry") for i in range(6)]
    messages += [Message(b"plain %d" % i) for i in range(6)]
    produced = ctx.stack.produce(messages)
    ctx.spawn("retry")
    ctx.finish(outcome, produced)


def slow(ctx: Context, outcome: Outcome) -> None:
    """Handlers running 1.5 ack deadlines, with as many queued behind them: Extend keeps
    every lease (running and queued), so each is delivered exactly once."""
    sleep_ms = int(ACK_DEADLINE_S * 1500)
    messages = []
    for i in range(4):
        messages += [Message(b"slow %d" % i, f"sleep:{sleep_ms}"), Message(b"quick %d" % i)]
    produced = ctx.stack.produce(messages)
    ctx.spawn("slow", concurrency=2)
    ctx.finish(outcome, produced)
    for where, starts in starts_by_offset(ctx.events()).items():
        if len(starts) > 1:
            outcome.fail(
                f"{where} delivered {len(starts)} times (attempts "
                f"{[s.attempt for s in starts]}): its lease was not extended"
            )


def sigterm(ctx: Context, outcome: Outcome) -> None:
    """SIGTERM while handlers run: the client releases what it has not started, lets the
    running ones finish and settle, and exits 0; nothing counts as a failed attempt."""
    produced = ctx.stack.produce([Message(b"work %d" % i, "sleep:1000") for i in range(16)])
    first = ctx.spawn("sigterm", concurrency=4)
    if not first.wait_for("start", 4, START_TIMEOUT_S):
        outcome.fail("the client started fewer than 4 handlers")
    first.signal(signal.SIGTERM)
    code = first.wait(EXIT_TIMEOUT_S)
    if code != 0:
        outcome.fail(f"the client exited {code} after SIGTERM, expected 0 within the drain")
    started = {(e.partition, e.offset) for e in first.snapshot() if e.kind == "start"}
    settled = {(e.partition, e.offset) for e in first.snapshot() if e.kind == "settled"}
    if started - settled:
        outcome.fail(f"handlers running at SIGTERM did not settle: {sorted(started - settled)}")
    ctx.spawn("sigterm", concurrency=4)
    ctx.finish(outcome, produced)
    again = [e for e in ctx.events() if e.kind == "start" and e.attempt > 1]
    if again:
        outcome.fail(
            f"{len(again)} redelivered with a raised attempt (e.g. {again[0].offset}): "
            "the drain did not settle or release them"
        )


def sigkill(ctx: Context, outcome: Outcome) -> None:
    """SIGKILL mid-work and a restart: what the dead process held is redelivered, nothing
    is lost."""
    produced = ctx.stack.produce([Message(b"job %d" % i, "sleep:500") for i in range(16)])
    first = ctx.spawn("sigkill", concurrency=4)
    if not first.wait_for("start", 4, START_TIMEOUT_S):
        outcome.fail("the client started fewer than 4 handlers")
    first.kill()
    ctx.spawn("sigkill", concurrency=4)
    ctx.finish(outcome, produced)
    # Started twice, not attempt > 1: a crash with several deliveries in hand blames none
    # of them (they come back without using an attempt).
    starts = Counter((e.partition, e.offset) for e in ctx.events() if e.kind == "start")
    if not any(n > 1 for n in starts.values()):
        outcome.fail("nothing was redelivered after the kill (was it killed mid-work?)")


def wrong_token(ctx: Context, outcome: Outcome) -> None:
    """A refused token: the client exits non-zero, saying so; the proxy still serves."""
    bad = ctx.spawn("wrong-token", token="wrong-" + ctx.stack.token)
    code = bad.wait(EXIT_TIMEOUT_S)
    if code is None:
        bad.kill()
        outcome.fail(f"the client still ran {EXIT_TIMEOUT_S:g} s after its token was refused")
    elif code == 0:
        outcome.fail("the client exited 0 with a wrong token")
    if "auth" not in bad.stderr_text().lower():
        outcome.fail("the client's stderr does not mention authentication")
    if not ctx.stack.proxies_alive():
        outcome.fail("a proxy died")
    ctx.clients.remove(bad)
    produced = ctx.stack.produce([Message(b"after %d" % i) for i in range(4)])
    ctx.spawn("right-token")
    ctx.finish(outcome, produced)


def large(ctx: Context, outcome: Outcome) -> None:
    """1 MB records arrive whole, and one that fails is dead-lettered whole."""
    rng = random.Random(13)
    size = 1_000_000
    messages = [Message(rng.randbytes(size), key=b"large-%d" % i) for i in range(3)]
    messages.append(Message(b"large poison " + bytes(size - 13), "fail", key=b"large-fail"))
    produced = ctx.stack.produce(messages)
    ctx.spawn("large", concurrency=2)
    ctx.finish(outcome, produced)


def byte_exact_messages() -> list[Message]:
    """Null, empty and binary keys and values, every byte value, binary, null and duplicate
    header names, a key a URL or header would have to escape; one poison ("fail"). Pulled
    (`byte_exact`) and pushed (`push_bytes`) alike, so both paths answer for the same bytes."""
    every = bytes(range(256))
    headers = (("bin", every), ("null", None), ("dup", b"1"), ("dup", b"2"), ("ünï", b"\x00"))
    return [
        Message(None, key=None),
        Message(b"", key=b""),
        Message(every, key=b"\x00\xff\xfe", headers=headers),
        Message(None, key=every, headers=(("only-null", None),)),
        Message(b"\xc3\x28 bad UTF-8 \x00 nul", "fail", key=None, headers=headers),
        Message(every, key=None),
        Message(None, key=b""),
        Message(b"", key=every),
        Message(b"\x00", key='ü "%\n<'.encode()),
    ]


def byte_exact(ctx: Context, outcome: Outcome) -> None:
    """`byte_exact_messages` reach the handler and the dead letter byte-exact, also as
    records without any header (a proxy sends those packed to a client that asks)."""
    produced = ctx.stack.produce(byte_exact_messages())
    ctx.spawn("bytes")
    ctx.finish(outcome, produced)


def side_by_side(ctx: Context, outcome: Outcome) -> None:
    """Two instances on one deployment share the work; each message is handled once."""
    first = ctx.spawn("side-a", concurrency=4)
    second = ctx.spawn("side-b", concurrency=4, peer=True)
    time.sleep(3.0)  # both connected before the work arrives
    produced = ctx.stack.produce([Message(b"shared %d" % i, "sleep:50") for i in range(120)])
    ctx.finish(outcome, produced)
    for client in (first, second):
        if not any(e.kind == "start" for e in client.snapshot()):
            outcome.fail(f"{client.consumer_id} handled nothing")
    twice = [w for w, s in starts_by_offset(ctx.events()).items() if len(s) > 1]
    if twice:
        outcome.fail(f"{len(twice)} messages handled twice without a fault, e.g. {twice[:3]}")


Scenario = Callable[[Context, Outcome], None]
SCENARIOS: dict[str, Scenario] = {
    "poison": poison,
    "retry": retry,
    "slow": slow,
    "sigterm": sigterm,
    "sigkill": sigkill,
    "wrong-token": wrong_token,
    "large": large,
    "bytes": byte_exact,
    "side-by-side": side_by_side,
}
"""Name -> scenario, in the order a full run takes them."""


def describe(name: str) -> str:
    doc = SCENARIOS[name].__doc__ or ""
    return " ".join(doc.split())


def run_scenario(name: str, stack: Stack, client: str, peer: str, log_dir: Path) -> Outcome:
    """Run one scenario; every client it started is stopped (killed if need be) after."""

    def start(scenario_dir: Path) -> tuple[Callable[[Outcome], None], Sequence[ChildProcess]]:
        ctx = Context(stack, client, peer, scenario_dir, [])
        return (lambda outcome: SCENARIOS[name](ctx, outcome)), ctx.clients

    return run_judged(name, log_dir, start)


def run_judged(
    name: str,
    log_dir: Path,
    start: Callable[[Path], tuple[Callable[[Outcome], None], Sequence[ChildProcess]]],
) -> Outcome:
    """Run one scenario of either kind (clients or push receivers): `start` makes its body
    and the list its child processes join; a crash is the scenario's failure, and every
    process is killed after it."""
    outcome = Outcome(name)
    scenario_dir = log_dir / name
    scenario_dir.mkdir(parents=True, exist_ok=True)
    body, processes = start(scenario_dir)
    started = time.monotonic()
    try:
        body(outcome)
    except Exception as exc:  # noqa: BLE001 - a scenario's crash is its failure, reported
        outcome.fail(f"the scenario crashed: {exc!r}")
    finally:
        for process in processes:
            process.kill()
    outcome.seconds = time.monotonic() - started
    if os.environ.get("TRIAGE_CONFORMANCE_DEBUG"):
        for process in processes:
            print(f"--- {process.name} stderr ---\n{process.stderr_text()[-2000:]}")
    return outcome
