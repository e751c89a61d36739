"""`tests.perf.bench_deadletter` at a small size against this worker's moto server.

Why: the perf scripts are run by hand, so nothing else notices when one stops working,
and this one's check depends on what a new table holds before the first write (its index
marker, the warm-up's item). Each case below must store exactly the dead letters it
wrote (`measure` counts the table before and after, and raises otherwise) and report a
rate.
"""

from __future__ import annotations

import pytest

from tests.perf.bench_deadletter import dead_letters, measure, one_at_a_time, through_writer
from triage_cli.embedded import EmbeddedAWS

pytestmark = pytest.mark.integration

N = 60
"""More than two of the writer's batches of 25."""


def test_every_case_stores_exactly_what_it_wrote(aws: EmbeddedAWS, unique_name: str) -> None:
    dls = dead_letters(N)
    rates = [
        measure(aws, f"{unique_name}-single", N, lambda store, _: one_at_a_time(store, dls)),
        measure(aws, f"{unique_name}-serial", N, lambda store, s: through_writer(store, s, dls, 1)),
        measure(
            aws, f"{unique_name}-batched", N, lambda store, s: through_writer(store, s, dls, 4)
        ),
    ]
    assert all(rate > 0 for rate in rates), rates
