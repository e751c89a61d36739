"""What an endpoint's answer means for the records it was sent: a pure table.

    answer                                   verdict    attempt   then
    2xx                                      ACK        -         settled
    2xx with `triage-action: retry`          RETRY      used      redelivered after backoff
    a status in `nack_statuses` (400, 422)   NACK       used      dead letter now, reason
                                                                  "HTTP <status>: <body>"
    any other answer with
      `triage-action: retry`                 RETRY      used      redelivered after backoff
    429, 503                                 OVERLOAD   none      given back; the limit is
                                                                  lowered; the target waits
                                                                  Retry-After (without it:
                                                                  backs off once the limit
                                                                  is at its floor)
    other 5xx; a timeout (one record)        RETRY      used      redelivered after backoff
    a reset (the connection closed before    SUSPECT    blame     as for a vanished client
      the answer ended); a timeout of a                           (blamed_on_vanish): a
      batch (several records)                                     suspect uses an attempt,
                                                                  the rest go back as
                                                                  suspects without one
    3xx, 401, 403, 404, 405, 407, 421        REFUSED    none      given back; the target
                                                                  pauses with backoff and
                                                                  says why (a misconfigured
                                                                  URL or credential)
    other 4xx                                RETRY      used      redelivered after backoff
    connection refused, DNS failure          OUTAGE     none      given back; the target
                                                                  pauses with backoff
    a registered gRPC consumer vanished      SUSPECT    blame     the same
      during the call (UNAVAILABLE on a
      connection that was up)

Why REFUSED uses no attempt: a wrong path or an expired credential says nothing about the
record, and dead-lettering every healthy record because a URL was mistyped is the failure
users fear most. An endpoint that is down (OUTAGE) is the same: a receiver down for ten
minutes dead-letters nothing.

A batch's 2xx body may name the records that failed (`batch_failures`), like a Lambda
partial batch response:

    {"batchItemFailures": [{"itemIdentifier": "<ce id>", "action": "retry" | "deadletter",
                            "reason": "..."}]}

An empty 2xx body (or no failures) acks the whole batch. "action" defaults to "retry".
A body that does not parse, or names an id that was not in the batch, retries the whole
batch (an attempt each): a receiver that answers garbage is not believed.
"""

from __future__ import annotations

import email.utils
import enum
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from triage_protocol.constants import MAX_REASON_CHARS
from triage_proxy.config import push as push_config

__all__ = [
    "DEFAULT_NACK_STATUSES",
    "REFUSED_STATUSES",
    "Outcome",
    "Verdict",
    "batch_failures",
    "classify",
    "retry_after_s",
]

DEFAULT_NACK_STATUSES = frozenset(push_config.DEFAULT_NACK_STATUSES)
"""Statuses that dead-letter the record at once, unless a target names its own (the
`[[push]]` setting's default)."""
REFUSED_STATUSES = frozenset({401, 403, 404, 405, 407, 421})
"""4xx answers that are about the endpoint's configuration, not the record."""
OVERLOAD_STATUSES = frozenset({429, 503})
ACTION_HEADER = "triage-action"
MAX_RETRY_AFTER_S = 300.0
"""A Retry-After longer than this is capped: one confused endpoint must not park a
target for a day."""


class Verdict(enum.Enum):
    """What happens to the records of one answer."""

    ACK = "ack"
    NACK = "nack"
    RETRY = "retry"
    OVERLOAD = "overload"
    REFUSED = "refused"
    OUTAGE = "outage"
    SUSPECT = "suspect"
    """The request failed, and nothing says which of its records caused it: the endpoint
    went away during it (a receiver that crashed, a reset connection), or a batch got no
    answer in time (one record of it may hang the receiver). Judged as a client that
    vanished (the dispatcher's `suspect`): a suspect uses an attempt, the others go back
    as suspects without one, so a crash-type pill (or a record that hangs its batch) is
    dead-lettered and the records beside it lose nothing."""

    @property
    def uses_attempt(self) -> bool:
        """Whether the records lose one of their delivery attempts (SUSPECT: the blame
        rule decides)."""
        return self in (Verdict.NACK, Verdict.RETRY)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A verdict with its detail."""

    verdict: Verdict
    """What happens to the records."""
    reason: str = ""
    """The dead letter's reason (NACK) or why the target waits (others)."""
    retry_after_s: float | None = None
    """How long the endpoint asked to be left alone (OVERLOAD), if it said."""


ACKED = Outcome(Verdict.ACK)


def http_reason(status: int, body: bytes) -> str:
    """`HTTP <status>: <body>`, the body's first MAX_REASON_CHARS characters as text."""
    text = body[: MAX_REASON_CHARS * 4].decode("utf-8", errors="replace")
    return f"HTTP {status}: {text[:MAX_REASON_CHARS]}"


def retry_after_s(value: str | None, now_wall: float) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds or an HTTP date), capped at
    MAX_RETRY_AFTER_S; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return min(max(0.0, when.timestamp() - now_wall), MAX_RETRY_AFTER_S)


def classify(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    nack_statuses: Collection[int] = DEFAULT_NACK_STATUSES,
    now_wall: float = 0.0,
) -> Outcome:
    """The verdict of an HTTP answer (`headers` with lower-case names)."""
    asks_retry = headers.get(ACTION_HEADER, "").strip().lower() == "retry"
    if 200 <= status < 300:
        if asks_retry:
            return Outcome(Verdict.RETRY, f"HTTP {status} with triage-action: retry")
        return ACKED
    if status in nack_statuses:
        return Outcome(Verdict.NACK, http_reason(status, body))
    if asks_retry:
        return Outcome(Verdict.RETRY, http_reason(status, body))
    if status in OVERLOAD_STATUSES:
        return Outcome(
            Verdict.OVERLOAD,
            f"HTTP {status}",
            retry_after_s(headers.get("retry-after"), now_wall),
        )
    if 300 <= status < 400 or status in REFUSED_STATUSES:
        return Outcome(Verdict.REFUSED, http_reason(status, body))
    return Outcome(Verdict.RETRY, http_reason(status, body))


def batch_failures(body: bytes, ids: Collection[str]) -> dict[str, Outcome] | None:
    """The records a batch's 2xx body says failed, by event id; {} when all succeeded;
    None when the body cannot be believed (see the module docstring)."""
    if not body.strip():
        return {}
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    failures = parsed.get("batchItemFailures", [])
    if not isinstance(failures, list):
        return None
    out: dict[str, Outcome] = {}
    for item in failures:
        if not isinstance(item, dict):
            return None
        ident = item.get("itemIdentifier")
        if not isinstance(ident, str) or ident not in ids:
            return None
        action = item.get("action", "retry")
        reason = item.get("reason", "")
        if not isinstance(reason, str) or action not in ("retry", "deadletter"):
            return None
        reason = reason[:MAX_REASON_CHARS] or f"batch item failure ({action})"
        verdict = Verdict.NACK if action == "deadletter" else Verdict.RETRY
        out[ident] = Outcome(verdict, reason)
    return out
