"""An HTTP push target: records POSTed as CloudEvents, one per request (binary mode) or a
batch per request (`application/cloudevents-batch+json`).

The answer is read through responses.py's table. What a receiver can do to the proxy is
bounded: a request ends at the target's timeout; at most `max_response_bytes` of a body
are read (the connection is dropped after that, whatever its length); redirects are not
followed; a malformed answer is a failed request, never a traceback. Each target has its
own connection pool, so a receiver that hangs holds only its own target's slots.

Authentication and integrity, both optional: `Authorization: Bearer <token>` from a
secret reference, and `triage-signature` (signing.py) over the timestamp and the body.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from triage_proxy.push.client import ConnectError, ConnectionLost, HttpClient, ResponseError
from triage_proxy.push.cloudevents import (
    BATCH_CONTENT_TYPE,
    EventShape,
    batch_body,
    batch_event,
    binary_headers,
    event_id,
)
from triage_proxy.push.responses import (
    Outcome,
    Verdict,
    batch_failures,
    classify,
)
from triage_proxy.push.signing import SIGNATURE_HEADER, sign
from triage_proxy.push.target import Call, PushTarget, TargetShape
from triage_proxy.structs import Record

__all__ = ["HttpEndpoint", "HttpTarget"]

logger = logging.getLogger(__name__)

USER_AGENT = "triage-push/1"


@dataclass(frozen=True)
class HttpEndpoint:
    """Where and how an HTTP target's requests go."""

    url: str
    """The http(s) URL every request is POSTed to."""
    event: EventShape
    """The CloudEvents attributes every record shares."""
    nack_statuses: frozenset[int]
    """Statuses that dead-letter a record at once."""
    max_response_bytes: int
    """Most bytes of a response body read."""
    authorization: str | None = field(default=None, repr=False)
    """The Authorization header value, when the target has a token (never in a repr)."""
    signing_secret: bytes | None = field(default=None, repr=False)
    """The HMAC key of `triage-signature`, when the target signs (never in a repr)."""
    ssl_context: ssl.SSLContext | None = None
    """TLS settings for an https URL (CA bundle, client certificate); None: the default."""


class HttpTarget(PushTarget):
    """One HTTP push target in this process."""

    def __init__(
        self,
        shape: TargetShape,
        endpoint: HttpEndpoint,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(shape, monotonic=monotonic)
        self.endpoint = endpoint
        self._wall = wall
        self._client: HttpClient | None = None
        self._batched = shape.batch > 1

    def _connect(self) -> None:
        """Open the connection pool (one per target: a hung receiver holds only its own)."""
        self._client = HttpClient(
            self.endpoint.url,
            max_body=self.endpoint.max_response_bytes,
            ssl_context=self.endpoint.ssl_context,
            user_agent=USER_AGENT,
        )

    async def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()

    batch_overhead = 1
    """A batch body is `[` + the events joined by commas + `]`: with each event counted
    with a comma (`prepare`), one byte more than their sum."""

    def prepare(self, record: Record) -> tuple[object, int]:
        if not self._batched:
            return record, record.size
        event = batch_event(record, self.endpoint.event)
        return event, len(event) + 1  # and its comma

    async def call(self, records: list[Record], payloads: list[object]) -> Call:
        self._check_sending()
        assert self._client is not None  # connected at start
        endpoint = self.endpoint
        if self._batched:
            body = batch_body(cast("list[bytes]", payloads))
            headers = {"content-type": BATCH_CONTENT_TYPE}
        else:
            record = records[0]
            body = record.value or b""
            headers = binary_headers(record, endpoint.event)
        if endpoint.authorization is not None:
            headers["authorization"] = endpoint.authorization
        if endpoint.signing_secret is not None:
            headers[SIGNATURE_HEADER] = sign(endpoint.signing_secret, body, int(self._wall()))
        n = len(records)
        try:
            response = await self._client.post(headers, body, self.shape.timeout_s)
        except TimeoutError:
            reason = f"no answer within {self.shape.timeout_s:g} s"
            # One record: it took too long. A batch: any one of its records may hang the
            # receiver, and charging all of them would dead-letter its batch-mates with it.
            verdict = Verdict.RETRY if n == 1 else Verdict.SUSPECT
            return Call(
                [Outcome(verdict, reason)] * n, dropped=True, kind="timeout", answered=False
            )
        except ConnectError as exc:
            return Call(
                [Outcome(Verdict.OUTAGE, str(exc))] * n,
                dropped=False,
                kind="refused",
                answered=False,
            )
        except OSError as exc:
            reason = f"request failed: {exc}"[:500]
            # A malformed answer is the receiver's answer: an attempt. A connection that
            # ended before its answer is a receiver gone during the request (a crash):
            # the blame rule decides (Verdict.SUSPECT).
            broken = isinstance(exc, ResponseError) and not isinstance(exc, ConnectionLost)
            verdict = Verdict.RETRY if broken else Verdict.SUSPECT
            return Call([Outcome(verdict, reason)] * n, dropped=False, kind="reset", answered=False)
        status = response.status
        kind = f"{status // 100}xx"
        outcome = classify(
            status,
            response.headers,
            response.body,
            nack_statuses=endpoint.nack_statuses,
            now_wall=self._wall(),
        )
        dropped = outcome.verdict is Verdict.OVERLOAD
        if not self._batched or outcome.verdict is not Verdict.ACK:
            return Call([outcome] * n, dropped=dropped, kind=kind)
        ids = [event_id(r) for r in records]
        failures = batch_failures(response.body, set(ids)) if response.complete else None
        if failures is None:
            reason = (
                f"HTTP {status}: the batch response is not a batchItemFailures document "
                f"(or over {endpoint.max_response_bytes} bytes)"
            )
            return Call([Outcome(Verdict.RETRY, reason)] * n, dropped=False, kind=kind)
        return Call([failures.get(i, outcome) for i in ids], dropped=False, kind=kind)
