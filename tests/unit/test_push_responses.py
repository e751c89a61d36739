"""The table of what an endpoint's answer means (push/responses.py)."""

from __future__ import annotations

import pytest

from triage_proxy.push.responses import (
    Outcome,
    Verdict,
    batch_failures,
    classify,
    retry_after_s,
)

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("status", "headers", "verdict"),
    [
        (200, {}, Verdict.ACK),
        (204, {}, Verdict.ACK),
        (200, {"triage-action": "retry"}, Verdict.RETRY),
        (400, {}, Verdict.NACK),
        (422, {}, Verdict.NACK),
        (500, {"triage-action": "Retry"}, Verdict.RETRY),
        (429, {}, Verdict.OVERLOAD),
        (503, {}, Verdict.OVERLOAD),
        (500, {}, Verdict.RETRY),
        (502, {}, Verdict.RETRY),
        (301, {}, Verdict.REFUSED),
        (401, {}, Verdict.REFUSED),
        (404, {}, Verdict.REFUSED),
        (409, {}, Verdict.RETRY),
        (413, {}, Verdict.RETRY),
    ],
)
def test_the_table(status: int, headers: dict[str, str], verdict: Verdict) -> None:
    assert classify(status, headers, b"body", now_wall=NOW).verdict is verdict


def test_attempts_are_used_only_by_nack_and_retry() -> None:
    assert {v for v in Verdict if v.uses_attempt} == {Verdict.NACK, Verdict.RETRY}


def test_a_nack_reason_names_the_status_and_the_body_cut_to_4000() -> None:
    out = classify(422, {}, b"x" * 10_000)
    assert out.reason == "HTTP 422: " + "x" * 4000
    assert classify(400, {}, b"\xff bad").reason == "HTTP 400: \ufffd bad"


def test_a_target_chooses_its_nack_statuses() -> None:
    assert classify(409, {}, b"", nack_statuses={409}).verdict is Verdict.NACK
    assert classify(400, {}, b"", nack_statuses={409}).verdict is Verdict.RETRY


def test_retry_after_in_seconds_or_as_a_date_capped() -> None:
    assert retry_after_s("7", NOW) == 7.0
    assert retry_after_s("Tue, 14 Nov 2023 22:13:30 GMT", NOW) == pytest.approx(10.0)
    assert retry_after_s("999999", NOW) == 300.0
    assert retry_after_s("soon", NOW) is None
    assert retry_after_s(None, NOW) is None
    assert classify(503, {"retry-after": "2"}, b"", now_wall=NOW).retry_after_s == 2.0


IDS = {"t/0/1", "t/0/2", "t/0/3"}


def test_an_empty_body_or_no_failures_acks_the_batch() -> None:
    assert batch_failures(b"", IDS) == {}
    assert batch_failures(b"  \n", IDS) == {}
    assert batch_failures(b"{}", IDS) == {}
    assert batch_failures(b'{"batchItemFailures": []}', IDS) == {}


def test_named_failures_retry_by_default_or_dead_letter() -> None:
    body = (
        b'{"batchItemFailures": [{"itemIdentifier": "t/0/1"},'
        b' {"itemIdentifier": "t/0/3", "action": "deadletter", "reason": "bad sku"}]}'
    )
    assert batch_failures(body, IDS) == {
        "t/0/1": Outcome(Verdict.RETRY, "batch item failure (retry)"),
        "t/0/3": Outcome(Verdict.NACK, "bad sku"),
    }


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"batchItemFailures": {}}',
        b'{"batchItemFailures": ["t/0/1"]}',
        b'{"batchItemFailures": [{"itemIdentifier": "t/9/9"}]}',
        b'{"batchItemFailures": [{"itemIdentifier": "t/0/1", "action": "drop"}]}',
        b'{"batchItemFailures": [{"itemIdentifier": 5}]}',
        b"[" * 100_000,
    ],
)
def test_a_body_that_cannot_be_believed_fails_the_whole_batch(body: bytes) -> None:
    assert batch_failures(body, IDS) is None
