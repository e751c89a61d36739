"""A consumer instance for the fault suite, run as its own process so it can really die.

Why a separate process: the suite must prove nothing is lost when instances are
`kill -9`ed or crash mid-handler, which only a real process exit shows (a stopped
asyncio task or thread would still let the client send its settlements).

Each message value is `<behaviour>:<index>` (see `tests/fault/scenario.py`); the
handler does what the behaviour says, given the delivery attempt:

    ok             ack
    nack           raise: dead-lettered at once
    retry          raise triage_client.Retry on attempt 1, ack later
    slow           sleep --slow-s (past the ack deadline) on attempt 1, ack later
    crash          os._exit(1) on every attempt: the crash-type poison pill

Every invocation appends one line to --log *before* acting, so a crash or a kill still
leaves it, and a second `done` line right before an ack is returned:

    <offset> <attempt> <index> <plan> <unix time>      plan: ack nack retry slow crash
    <offset> <attempt> <index> done <unix time>        the handler completed (acks)

The lines are written with one os.write on an O_APPEND descriptor: no user-space
buffer to lose, and the page cache outlives a SIGKILL. SIGTERM stops gracefully.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from tests.consumer_process import instance_arguments, run_consumer
from triage_client import Message, Retry

MAX_BACKOFF_S = 1.0
"""Reconnect quickly after a proxy restart (the client's default cap is 5 s)."""


class Nacked(Exception):
    """The handler's refusal of a `nack` message: dead-letter it."""


def plan_for(behaviour: str, attempt: int) -> str:
    """What this invocation does (pure, so the suite's verifier can use the same rule)."""
    if behaviour == "nack":
        return "nack"
    if behaviour == "crash":
        return "crash"
    if behaviour == "retry":
        return "retry" if attempt <= 1 else "ack"
    if behaviour == "slow":
        return "slow" if attempt <= 1 else "ack"
    return "ack"


def main() -> None:
    parser = instance_arguments(default_id="fault")
    parser.add_argument("--log", required=True, help="file to append one line per invocation")
    parser.add_argument("--slow-s", type=float, default=3.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(offset: int, attempt: int, index: bytes, what: str) -> None:
        os.write(fd, b"%d %d %s %s %.6f\n" % (offset, attempt, index, what.encode(), time.time()))

    async def handle(message: Message) -> None:
        behaviour, _, index = (message.value or b"").partition(b":")
        plan = plan_for(behaviour.decode(), message.attempt)
        record(message.offset, message.attempt, index or b"-", plan)
        if plan == "crash":
            os._exit(1)
        if plan == "nack":
            raise Nacked("fault-suite nack")
        if plan == "retry":
            raise Retry("fault-suite retry")
        if plan == "slow":
            await asyncio.sleep(args.slow_s)
        record(message.offset, message.attempt, index or b"-", "done")

    try:
        run_consumer(args, handle, max_backoff=MAX_BACKOFF_S)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
