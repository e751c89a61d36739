"""The Python client under the conformance contract (CONTRACT in `triage_conformance`).

`python -m triage_conformance.python_client` consumes TRIAGE_ENDPOINT with the library's
`Consumer` and does what each message's `x-triage-action` header says, printing one JSON
line per handler start and one per settlement. SIGTERM is `Consumer.stop()` (drain, exit
0); a refused token exits 2 with the error on stderr.

Why here, not in the client library: it is test tooling that prints payloads, and the
library must never do that.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
from typing import Any

from triage_client import AuthenticationError, Consumer, Message, Retry, TriageClientError
from triage_conformance import ACTION_HEADER

RETRY_UNTIL_ATTEMPT = 3
"""`retry` raises Retry while the attempt is below this, then acks."""


class Failed(Exception):
    """The `fail` action: the nack reason is `Failed: <value as text>`."""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def emit(event: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed at once (the kit reads it live)."""
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def action_of(message: Message) -> str:
    for name, value in message.headers:
        if name == ACTION_HEADER and value is not None:
            return value.decode("utf-8", "replace")
    return "ack"


async def handle(message: Message) -> None:
    action = action_of(message)
    emit(
        {
            "event": "start",
            "partition": message.partition,
            "offset": message.offset,
            "attempt": message.attempt,
            "key": _b64(message.key),
            "value": _b64(message.value),
            "headers": [[name, _b64(value)] for name, value in message.headers],
        }
    )
    where = {"partition": message.partition, "offset": message.offset}
    if action == "hang":
        await asyncio.Event().wait()
    if action.startswith("sleep:"):
        await asyncio.sleep(int(action.split(":", 1)[1]) / 1000)
    if action == "fail":
        emit({"event": "settled", **where, "outcome": "nack"})
        raise Failed((message.value or b"").decode("utf-8", "replace"))
    if action == "retry" and message.attempt < RETRY_UNTIL_ATTEMPT:
        emit({"event": "settled", **where, "outcome": "retry"})
        raise Retry(f"attempt {message.attempt}")
    emit({"event": "settled", **where, "outcome": "ack"})


def main() -> int:
    consumer = Consumer(
        os.environ["TRIAGE_ENDPOINT"],
        os.environ["TRIAGE_TOKEN"],
        handle,
        concurrency=int(os.environ.get("TRIAGE_CONCURRENCY", "8")),
        consumer_id=os.environ.get("TRIAGE_CONSUMER_ID") or None,
        max_backoff=1.0,
    )
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    try:
        consumer.run()
    except AuthenticationError as exc:
        print(f"authentication failed: {exc}", file=sys.stderr)
        return 2
    except TriageClientError as exc:
        print(f"consumer failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
