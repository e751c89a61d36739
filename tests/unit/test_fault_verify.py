"""The fault verifier's charging of redeliveries to proxy kills (tests/fault/verify.py).

Why: the restart-bound test asserts each kill's redeliveries are at most the window, so a
redelivery charged to the wrong kill, or one offset charged to one kill twice, fails it
with the product right (123 against 64 once, at load 9), and one not charged hides a
real excess.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import cast

from tests.fault.processes import Incarnation
from tests.fault.report import Report, checks
from tests.fault.scenario import Options
from tests.fault.verify import Invocation, kill_redelivering, offset_causes

KILLS = [10.0, 20.0]
RESTARTS = [(10.05, 11.0), (20.01, 21.0)]
"""Per kill: its replacement started, then listened."""


def invocations(*times: float) -> list[Invocation]:
    inc = Incarnation(0, 0, Path("unused.log"), cast(subprocess.Popen[bytes], None), 0.0)
    return [Invocation(7, 1, 7, "ack", t, inc) for t in times]


def charged(*times: float, restarts: list[tuple[float, float]] | None = RESTARTS) -> list[int]:
    return offset_causes(invocations(*times), KILLS, [], restarts)[1]


def test_a_record_delivered_before_a_kill_and_after_its_restart_is_that_kills() -> None:
    assert charged(9.0, 12.0) == [0]
    assert charged(9.0, 12.0, restarts=None) == [0]
    # Still in the instance's queue at the kill: the killed proxy delivered it.
    assert charged(10.3, 12.0) == [0]


def test_the_replacements_delivery_within_the_slack_is_the_next_kills() -> None:
    """Delivered by the replacement 0.6 s after kill 0 (its standby took over as the
    lease lapsed), redelivered after kill 1: kill 1's, not kill 0's."""
    assert charged(9.0, 10.6, 22.0, restarts=[(10.05, 10.5), (20.01, 21.0)]) == [0, 1]


def test_a_kill_is_charged_once_per_offset() -> None:
    """Without restart times the slack stays ambiguous; still one charge per kill."""
    causes, kills = offset_causes(invocations(9.0, 10.6, 12.0), KILLS, [], None)
    assert kills == [0]
    assert causes == ["proxy kill", "other"]
    # ... and a later kill still gets its own.
    assert charged(9.0, 10.6, 22.0, restarts=None) == [0, 1]


def test_the_killed_proxys_own_redelivery_is_not_the_kills() -> None:
    """Its lease lapsed before the kill; the instance invoked the redelivery after the kill,
    before the replacement existed: the kill's is only the replacement's redelivery."""
    causes, kills = offset_causes(invocations(8.0, 10.02, 12.0), KILLS, [], RESTARTS)
    assert causes == ["other", "proxy kill"]
    assert kills == [0]


def test_every_kill_between_two_deliveries_can_be_charged_only_once_each() -> None:
    assert kill_redelivering(KILLS, 9.0, 25.0, RESTARTS) == 0
    assert kill_redelivering(KILLS, 9.0, 25.0, RESTARTS, charged=[0]) == 1
    assert kill_redelivering(KILLS, 9.0, 25.0, RESTARTS, charged=[0, 1]) is None
    assert kill_redelivering(KILLS, 12.0, 15.0, RESTARTS) is None


def test_a_proxy_that_exited_on_its_own_fails_the_run_but_a_lost_lease_does_not() -> None:
    def failed(report: Report) -> list[str]:
        return [name for name, passed, correctness in checks([report]) if not passed]

    clean = Report(Options(encode_settled=False), Path("/nowhere"))
    clean.lease_losses.append("pid 2 exited with 3")
    assert failed(clean) == []
    crashed = Report(Options(encode_settled=False), Path("/nowhere"))
    crashed.unexpected_proxy_exits.append("pid 1 exited with -6")
    assert [name for name in failed(crashed) if "exited on its own" in name] == [
        "[encode off] the proxy never exited on its own, but for a lease lost in the "
        "DynamoDB outage (1)"
    ]
    assert all(c for name, _, c in checks([crashed]) if "exited on its own" in name)
