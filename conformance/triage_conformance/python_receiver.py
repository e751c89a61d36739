"""A push receiver under the conformance contract (RECEIVER CONTRACT in `triage_conformance`),
written as a Python service would be: aiohttp, and the `cloudevents` SDK to parse what
arrives.

`python -m triage_conformance.python_receiver` listens on 127.0.0.1:$TRIAGE_PUSH_PORT and
answers POST / in $TRIAGE_PUSH_MODE (`binary`: one CloudEvent per request; `batch`: a JSON
array answered with `batchItemFailures`), doing what each record's `x-triage-action`
header says and printing one JSON line per record received. SIGTERM stops it (exit 0).

Why here, not in the proxy: it is test tooling that prints payloads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from cloudevents.v1.http import from_http, from_json

from triage_conformance import ACTION_HEADER

Headers = tuple[tuple[str, bytes | None], ...]
RETRY_HEADER = "triage-action"
NACK_STATUS = 400


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def recover(attrs: Mapping[str, Any], data: Any) -> tuple[bytes | None, bytes | None, Headers]:
    """Key, value and headers, byte-exact, from an event's attributes and data (the
    mapping in `triage_proxy.push.cloudevents`)."""
    key = base64.b64decode(attrs["triagekey"]) if "triagekey" in attrs else None
    rows = json.loads(base64.b64decode(attrs["triageheaders"])) if "triageheaders" in attrs else []
    headers = tuple((str(n), None if v is None else base64.b64decode(v)) for n, v in rows)
    if attrs.get("triagetombstone") == "true":
        return key, None, headers
    # The SDK hands an empty body over as None; with no tombstone it is an empty value.
    return key, bytes(data or b""), headers


def action_of(headers: Headers) -> str:
    for name, value in headers:
        if name == ACTION_HEADER and value is not None:
            return value.decode("utf-8", "replace")
    return "ack"


class Receiver:
    """The actions and the `received` lines, for either mode."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        """Ids already seen: `retry` asks once per id (a receiver cannot know attempts)."""

    def receive(self, attrs: Mapping[str, Any], data: Any) -> tuple[str, bytes | None]:
        """Print the `received` line; return the record's action and value."""
        key, value, headers = recover(attrs, data)
        line = {
            "event": "received",
            "id": attrs["id"],
            "key": _b64(key),
            "value": _b64(value),
            "headers": [[name, _b64(v)] for name, v in headers],
        }
        sys.stdout.write(json.dumps(line, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        return action_of(headers), value

    def first_time(self, event_id: str) -> bool:
        fresh = event_id not in self.seen
        self.seen.add(event_id)
        return fresh

    async def binary(self, request: web.Request) -> web.Response:
        body = await request.read()
        event = from_http(dict(request.headers), body, data_unmarshaller=lambda b: b)
        attrs = event.get_attributes()
        action, value = self.receive(attrs, event.get_data())
        await _sleep(action)
        if action == "fail":
            return web.Response(status=NACK_STATUS, body=value or b"")
        if action == "retry" and self.first_time(str(attrs["id"])):
            return web.Response(status=200, headers={RETRY_HEADER: "retry"})
        return web.Response(status=204)

    async def batch(self, request: web.Request) -> web.Response:
        failures: list[dict[str, str]] = []
        sleeps = []
        for raw in json.loads(await request.read()):
            event = from_json(json.dumps(raw), data_unmarshaller=lambda b: b)
            attrs = event.get_attributes()
            event_id = str(attrs["id"])
            action, value = self.receive(attrs, event.get_data())
            sleeps.append(_sleep(action))
            if action == "fail":
                reason = (value or b"").decode("utf-8", "replace")
                failures.append(
                    {"itemIdentifier": event_id, "action": "deadletter", "reason": reason}
                )
            elif action == "retry" and self.first_time(event_id):
                failures.append({"itemIdentifier": event_id, "action": "retry"})
        await asyncio.gather(*sleeps)  # the records of a batch are handled side by side
        return web.json_response({"batchItemFailures": failures})


async def _sleep(action: str) -> None:
    if action.startswith("sleep:"):
        await asyncio.sleep(int(action.split(":", 1)[1]) / 1000)


def main() -> int:
    port = int(os.environ["TRIAGE_PUSH_PORT"])
    mode = os.environ.get("TRIAGE_PUSH_MODE", "binary")
    if mode not in ("binary", "batch"):
        print(f"TRIAGE_PUSH_MODE must be binary or batch, got {mode!r}", file=sys.stderr)
        return 2
    receiver = Receiver()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/", receiver.batch if mode == "batch" else receiver.binary)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
