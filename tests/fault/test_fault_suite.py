"""The fault suite, shortened for CI: real processes killed, nothing lost.

Why a CI test beside the full suite: the full suite takes minutes and is run by hand, but
"nothing is lost when a process dies" is the product's core promise, so every CI run
repeats it on a small scale. Same code path (`run_suite`), same real kills: 3 proxy
SIGKILLs with restarts, 3 instance SIGKILLs, crash pills that os._exit their instance,
and 3 s SIGSTOPs of moto and the broker, with the settled-above encoding on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fault.fault_suite import run_suite
from tests.fault.report import render
from tests.fault.scenario import Options

# One xdist worker runs the CPU-heavy tests one after another (--dist loadgroup), while
# the others go on with the rest; the cpu_heavy lock guards any other --dist mode.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("cpu-heavy")]

CI_BUDGET_S = 150


@pytest.mark.usefixtures("cpu_heavy")  # its CI budget assumes the CPU to itself
def test_kill_9_and_outages_lose_nothing(tmp_path: Path) -> None:
    options = Options(
        messages=3000,
        proxy_kills=3,
        consumer_kills=3,
        outage_s=3.0,
        instances=3,
        seed=7,
        encode_settled=True,
        timeout_s=60.0,
        work_dir=tmp_path,
    )
    started = time.monotonic()
    report = run_suite(options)
    elapsed = time.monotonic() - started
    summary = render([report])
    print(summary)  # the duplicates per kill, with -s

    assert not report.unfinished, summary
    assert report.lost == [], summary
    assert report.proxy_kills == 3, summary
    assert report.consumer_kills == 3, summary
    assert sorted(report.outages) == ["aws-outage", "broker-outage"], summary
    assert report.crash_pills >= 1
    assert report.crash_pills_ok == report.crash_pills, report.crash_detail
    assert report.collateral == [], summary  # crashes blame only the crasher
    assert report.instance_crashes >= options.max_attempts, summary
    assert not report.not_exact, summary
    assert not report.unexpected_proxy_exits, summary  # a crash (SIGABRT once), not a fault
    assert not report.mismatched, report.mismatched[:5]
    assert report.acked + report.dead_lettered >= options.messages, summary
    assert elapsed < CI_BUDGET_S, summary
