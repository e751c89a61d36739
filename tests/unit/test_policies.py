"""Retry policy: worked examples, validation, and hypothesis properties."""

from __future__ import annotations

import itertools
import math
from typing import TypedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triage_protocol.constants import UINT32_MAX
from triage_proxy.config.bounds import MAX_DURATION_S
from triage_proxy.config.sections import RetrySettings
from triage_proxy.pipeline.policies import (
    SPAN_DOUBLINGS,
    Judgement,
    Outcome,
    after_failure,
    backoff,
    blamed_on_vanish,
    checkpoint_due,
    early_commit_worth,
    held_burst,
    judged_on_vanish,
    redelivery_delay,
    retry_delay,
)


def reference_delay(attempt: int, s: RetrySettings) -> float:
    """The formula written out the obvious way (fine for attempts that cannot overflow)."""
    return min(s.max_backoff_s, s.initial_backoff_s * s.multiplier ** (attempt - 1))


def test_default_schedule() -> None:
    s = RetrySettings()  # 1 s, doubling, capped at 60 s
    got = [retry_delay(attempt, s) for attempt in range(1, 10)]
    assert got == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_fractional_multiplier() -> None:
    s = RetrySettings(initial_backoff_s=0.1, max_backoff_s=10.0, multiplier=1.5)
    assert retry_delay(1, s) == 0.1
    assert retry_delay(2, s) == pytest.approx(0.15)
    assert retry_delay(3, s) == pytest.approx(0.225)
    assert retry_delay(50, s) == 10.0


def test_multiplier_one_is_constant() -> None:
    s = RetrySettings(initial_backoff_s=2.5, max_backoff_s=60.0, multiplier=1.0)
    assert {retry_delay(a, s) for a in (1, 2, 10, 10**30)} == {2.5}


def test_initial_above_cap_is_capped() -> None:
    s = RetrySettings(initial_backoff_s=90.0, max_backoff_s=60.0, multiplier=2.0)
    assert retry_delay(1, s) == 60.0
    assert retry_delay(5, s) == 60.0


@pytest.mark.parametrize("attempt", [10**4, 10**18, 10**400])
def test_huge_attempts_do_not_overflow(attempt: int) -> None:
    assert retry_delay(attempt, RetrySettings()) == 60.0


def test_multiplier_barely_above_one() -> None:
    # ln(60) / ln(1.0000001) is about 4.1e7 steps to the cap.
    barely = RetrySettings(initial_backoff_s=1.0, max_backoff_s=60.0, multiplier=1.0000001)
    assert retry_delay(10**4, barely) == pytest.approx(1.0000001**9999)
    assert retry_delay(4 * 10**7, barely) < 60.0
    for attempt in (5 * 10**7, 10**18, 10**400):
        assert retry_delay(attempt, barely) == 60.0


def test_extreme_cap_to_initial_ratio_does_not_overflow() -> None:
    s = RetrySettings(initial_backoff_s=1e-300, max_backoff_s=1e300, multiplier=10.0)
    assert retry_delay(1, s) == 1e-300
    assert retry_delay(301, s) == pytest.approx(1.0)
    assert retry_delay(601, s) == pytest.approx(1e300)
    assert retry_delay(10**9, s) == 1e300


@pytest.mark.parametrize("attempt", [0, -1])
def test_attempt_must_be_positive(attempt: int) -> None:
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(attempt, RetrySettings())


@pytest.mark.parametrize(
    "s",
    [
        RetrySettings(initial_backoff_s=0.0),
        RetrySettings(initial_backoff_s=-1.0),
        RetrySettings(max_backoff_s=math.inf),
        RetrySettings(initial_backoff_s=math.nan),
        RetrySettings(multiplier=0.5),
        RetrySettings(multiplier=math.nan),
        RetrySettings(multiplier=math.inf),
    ],
)
def test_nonsense_settings_raise(s: RetrySettings) -> None:
    with pytest.raises(ValueError, match="must be"):
        retry_delay(3, s)


SECONDS = st.floats(min_value=1e-3, max_value=1e4)
SETTINGS = st.builds(
    RetrySettings,
    initial_backoff_s=SECONDS,
    max_backoff_s=SECONDS,
    multiplier=st.one_of(st.just(1.0), st.floats(min_value=1.0, max_value=10.0)),
)
ATTEMPTS = st.integers(min_value=1, max_value=200)


@given(s=SETTINGS, attempt=ATTEMPTS)
def test_matches_the_formula(s: RetrySettings, attempt: int) -> None:
    assert math.isclose(retry_delay(attempt, s), reference_delay(attempt, s), rel_tol=1e-9)


@given(s=SETTINGS, attempt=st.one_of(ATTEMPTS, st.integers(min_value=1, max_value=10**30)))
def test_monotone_and_never_above_cap(s: RetrySettings, attempt: int) -> None:
    now = retry_delay(attempt, s)
    after = retry_delay(attempt + 1, s)
    assert 0 < now <= after <= s.max_backoff_s


@given(s=SETTINGS)
def test_first_is_initial_or_cap(s: RetrySettings) -> None:
    assert retry_delay(1, s) == min(s.initial_backoff_s, s.max_backoff_s)


@given(s=SETTINGS)
def test_eventually_reaches_cap_exactly(s: RetrySettings) -> None:
    # Only where the formula itself passes the cap within 10**6 attempts (a multiplier
    # of 1 + 2e-16 takes far longer, and then the cap must not be reached early either).
    steps_to_cap = (
        0
        if s.initial_backoff_s >= s.max_backoff_s
        else math.inf
        if s.multiplier == 1
        else math.log(s.max_backoff_s / s.initial_backoff_s) / math.log(s.multiplier)
    )
    if steps_to_cap < 10**6 - 2:
        assert retry_delay(10**6, s) == s.max_backoff_s
    else:
        assert retry_delay(10**6, s) <= s.max_backoff_s


# -- after_failure ------------------------------------------------------------------------


def test_after_failure_examples() -> None:
    assert after_failure(1, 5) is Outcome.REDELIVER
    assert after_failure(4, 5) is Outcome.REDELIVER
    assert after_failure(5, 5) is Outcome.DEAD_LETTER
    assert after_failure(6, 5) is Outcome.DEAD_LETTER
    assert after_failure(1, 1) is Outcome.DEAD_LETTER


@pytest.mark.parametrize(("attempt", "max_attempts"), [(0, 5), (-3, 5), (1, 0), (2, -1)])
def test_after_failure_rejects_nonsense(attempt: int, max_attempts: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        after_failure(attempt, max_attempts)


@given(max_attempts=st.integers(1, 10**6), attempt=st.integers(1, 10**6))
def test_after_failure_boundary(max_attempts: int, attempt: int) -> None:
    expected = Outcome.REDELIVER if attempt < max_attempts else Outcome.DEAD_LETTER
    assert after_failure(attempt, max_attempts) is expected


@given(max_attempts=st.integers(1, 1000))
def test_exactly_max_attempts_deliveries_before_dead_letter(max_attempts: int) -> None:
    # Walk one message through its failures: it is delivered max_attempts times in all.
    deliveries = 1
    while after_failure(deliveries, max_attempts) is Outcome.REDELIVER:
        deliveries += 1
    assert deliveries == max_attempts


# -- backoff (the one formula behind retry_delay, dead-letter writes, fetch and lease retries)


def test_backoff_doubles_from_initial_up_to_the_cap() -> None:
    got = [backoff(n, initial=0.1, cap=1.0) for n in range(1, 7)]
    assert got == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_backoff_takes_any_number_of_failures() -> None:
    # 2.0 ** (failures - 1) on its own overflows a float past ~1025 failures.
    assert backoff(10**6, initial=0.1, cap=2.5) == 2.5


@pytest.mark.parametrize("failures", [0, -1])
def test_backoff_counts_failures_from_one(failures: int) -> None:
    with pytest.raises(ValueError, match="failures"):
        backoff(failures, initial=0.1, cap=1.0)


# -- redelivery_delay (after a vanished instance or a lapsed lease) ------------------------


def gaps_before_dead_letter(max_attempts: int, span_s: float) -> list[float]:
    """The wait after each failure that is followed by another delivery."""
    return [redelivery_delay(f, max_attempts, span_s) for f in range(1, max_attempts)]


def test_redelivery_schedule_of_the_defaults() -> None:
    # max_attempts 5, span 60 s: 0, g, 2g, 4g with 7g = 60 s.
    g = 60 / 7
    assert gaps_before_dead_letter(5, 60.0) == pytest.approx([0, g, 2 * g, 4 * g])
    assert math.fsum(gaps_before_dead_letter(5, 60.0)) >= 60.0


def test_redelivery_small_limits() -> None:
    assert gaps_before_dead_letter(1, 60.0) == []  # dead-lettered at the first failure
    assert gaps_before_dead_letter(2, 60.0) == [60.0]  # the single gap is the span
    assert gaps_before_dead_letter(3, 60.0) == [0.0, 60.0]
    assert gaps_before_dead_letter(4, 6.0) == pytest.approx([0.0, 2.0, 4.0])


def test_redelivery_span_zero_means_no_gaps() -> None:
    assert set(gaps_before_dead_letter(7, 0.0)) == {0.0}
    assert gaps_before_dead_letter(2, 0.0) == [0.0]


def test_redelivery_with_many_attempts_keeps_the_gaps_at_the_end() -> None:
    # Beyond SPAN_DOUBLINGS + 2 attempts the early gaps are zero and the last
    # SPAN_DOUBLINGS carry the span (their first would be below 1e-17 s anyway).
    max_attempts = SPAN_DOUBLINGS + 40
    gaps = gaps_before_dead_letter(max_attempts, 60.0)
    zeros = max_attempts - 1 - SPAN_DOUBLINGS  # the first one and the 38 before the tail
    assert gaps[:zeros] == [0.0] * zeros
    assert len(gaps[zeros:]) == SPAN_DOUBLINGS
    assert all(g > 0 for g in gaps[zeros:])
    assert gaps[-1] == pytest.approx(30.0)
    assert math.fsum(gaps) >= 60.0


@pytest.mark.parametrize(
    ("failures", "max_attempts", "span_s", "match"),
    [
        (0, 5, 60.0, "failures"),
        (5, 5, 60.0, "failures"),  # nothing follows the last failure
        (1, 1, 60.0, "failures"),
        (1, 0, 60.0, "max_attempts"),
        (1, 5, -1.0, "span"),
        (1, 5, math.nan, "span"),
        (1, 5, math.inf, "span"),
    ],
)
def test_redelivery_rejects_nonsense(
    failures: int, max_attempts: int, span_s: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        redelivery_delay(failures, max_attempts, span_s)


SPANS = st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=MAX_DURATION_S))


@pytest.mark.parametrize("span_s", [0.001, 1.0, 6.0, 60.0, 3600.0, MAX_DURATION_S])
def test_gaps_add_up_to_at_least_the_span_for_every_limit_up_to_300(span_s: float) -> None:
    # Exhaustive over max_attempts 2..300 (past SPAN_DOUBLINGS + 2, where the early gaps
    # turn zero): reaching the limit takes the span, and never much more.
    for max_attempts in range(2, 301):
        gaps = gaps_before_dead_letter(max_attempts, span_s)
        total = math.fsum(gaps)
        assert total >= span_s, max_attempts
        assert total <= span_s * (1 + 1e-12), max_attempts
        assert gaps[0] == (span_s if max_attempts == 2 else 0.0)
        assert gaps == sorted(gaps)


@given(max_attempts=st.integers(2, UINT32_MAX), span_s=SPANS)
def test_gaps_add_up_to_at_least_the_span_for_any_limit(max_attempts: int, span_s: float) -> None:
    # Every gap before the last SPAN_DOUBLINGS is zero (checked at the edge and at the
    # start), so summing the last ones sums them all.
    tail_from = max(1, max_attempts - 1 - SPAN_DOUBLINGS)
    tail = [redelivery_delay(f, max_attempts, span_s) for f in range(tail_from, max_attempts)]
    if tail_from > 1:
        assert redelivery_delay(tail_from - 1, max_attempts, span_s) == 0.0
        assert redelivery_delay(1, max_attempts, span_s) == 0.0
    assert math.fsum(tail) >= span_s
    assert tail == sorted(tail)
    assert all(0 <= g <= span_s for g in tail)


@given(max_attempts=st.integers(3, UINT32_MAX), span_s=SPANS)
def test_the_first_redelivery_is_immediate(max_attempts: int, span_s: float) -> None:
    assert redelivery_delay(1, max_attempts, span_s) == 0.0


@given(max_attempts=st.integers(4, SPAN_DOUBLINGS + 2), span_s=SPANS)
def test_gaps_double_after_the_first_non_zero_one(max_attempts: int, span_s: float) -> None:
    gaps = gaps_before_dead_letter(max_attempts, span_s)[1:]
    for before, after in itertools.pairwise(gaps):
        assert after == 2 * before


# --- checkpoint_due ---------------------------------------------------------------------


class Due(TypedDict):
    """checkpoint_due's settings, passed as keywords."""

    interval_s: float
    held_offsets: int


def test_a_checkpoint_waits_out_the_interval_while_the_commit_moves() -> None:
    due: Due = {"interval_s": 1.0, "held_offsets": 100}
    assert not checkpoint_due(0.2, held=False, unsaved=10_000, **due)
    assert checkpoint_due(1.0, held=False, unsaved=0, **due)


def test_a_held_commit_writes_the_checkpoint_once_enough_settled_above_it() -> None:
    due: Due = {"interval_s": 1.0, "held_offsets": 100}
    assert not checkpoint_due(0.2, held=True, unsaved=99, **due)  # a trickle waits
    assert checkpoint_due(0.2, held=True, unsaved=100, **due)
    assert checkpoint_due(0.0, held=True, unsaved=5_000, **due)


# --- held_burst --------------------------------------------------------------------------


def test_a_burst_above_a_held_offset_commits_before_the_tick() -> None:
    def burst(newly_settled: int) -> bool:
        return held_burst(held=True, newly_settled=newly_settled, recording=True, held_offsets=48)

    assert not burst(47)  # a trickle waits
    assert burst(48)
    assert burst(10_000)


def test_a_moving_offset_waits_for_the_tick_however_much_settled() -> None:
    # Kafka's commit records the head at the tick; the item only saves writes then.
    assert not held_burst(held=False, newly_settled=10_000, recording=True, held_offsets=48)


def test_no_burst_write_after_a_failed_write() -> None:
    # Not recording: the latest write failed (a frozen table waits out the interval).
    assert not held_burst(held=True, newly_settled=10_000, recording=False, held_offsets=48)


@given(
    waiting=st.integers(0, 5000),
    previous=st.integers(0, 5000),
    least=st.integers(1, 2048),
)
def test_early_commit_worth_a_burst_or_the_tail_of_one(
    waiting: int, previous: int, least: int
) -> None:
    worth = early_commit_worth(waiting=waiting, previous_advance=previous, least=least)
    if waiting >= least:
        assert worth  # a burst waits
    elif waiting == 0:
        assert not worth  # nothing to commit
    else:
        assert worth == (previous >= least)  # a tail after a burst, not a trickle


# --- blame when an instance vanishes -------------------------------------------------------


def _process_blame(streams: list[list[tuple[bool, bool]]], *, isolating: bool) -> list[list[bool]]:
    """One consumer process's streams at its crash, each stream's proxy deciding alone:
    per stream, its held deliveries as (suspect, started)."""
    return [
        blamed_on_vanish(
            [suspect for suspect, _ in held],
            [began for _, began in held] if isolating else None,
        )
        for held in streams
    ]


def test_a_pill_among_16_in_flight_neighbours_across_one_processes_streams_is_blamed_alone() -> (
    None
):
    """A process streams 4 partitions: 16 deliveries in flight on partition 0 with the pill,
    the isolated delivery it started, among them; partition 1 holds one lone healthy
    delivery; partition 2 a healthy suspect waiting for the process's turn beside 3 others;
    partition 3 a lone suspect waiting too. When the pill crashes the process, only the
    pill is blamed. The older per-stream rule blames three healthy records besides it."""
    pill = (True, True)
    healthy = (False, False)
    waiting_suspect = (True, False)
    streams = [
        [healthy] * 7 + [pill] + [healthy] * 8,
        [healthy],
        [waiting_suspect, healthy, healthy, healthy],
        [waiting_suspect],
    ]
    assert sum(map(len, streams)) == 22
    blamed = _process_blame(streams, isolating=True)
    assert [(i, j) for i, b in enumerate(blamed) for j, x in enumerate(b) if x] == [(0, 7)]
    old = _process_blame(streams, isolating=False)
    assert [(i, j) for i, b in enumerate(old) for j, x in enumerate(b) if x] == [
        (0, 7),
        (1, 0),
        (2, 0),
        (3, 0),
    ]


def test_a_first_crash_before_the_pill_is_isolated_blames_only_the_started_suspect() -> None:
    """A pill on its first delivery is one of 16 in flight (not a suspect yet): it is not
    blamed; neither is a lone delivery on another stream; only a suspect the process had
    started (the coincidence the gate cannot rule out) is."""
    streams = [[(False, False)] * 16, [(False, False)], [(True, True)]]
    assert _process_blame(streams, isolating=True) == [[False] * 16, [False], [True]]
    assert _process_blame([[(False, False)] * 16, [(False, False)]], isolating=True) == [
        [False] * 16,
        [False],
    ]


def test_the_older_rule_without_started() -> None:
    assert blamed_on_vanish([False]) == [True]
    assert blamed_on_vanish([True]) == [True]
    assert blamed_on_vanish([False, False]) == [False, False]
    assert blamed_on_vanish([False, True, False]) == [False, True, False]
    # Reported started, but no suspect: nothing to blame (a client reports suspects only).
    assert blamed_on_vanish([False], [True]) == [False]


@given(
    st.lists(
        st.lists(st.booleans(), min_size=1, max_size=20),  # per stream: which are suspects
        min_size=1,
        max_size=8,
    ),
    st.data(),
)
def test_a_process_with_one_started_isolated_delivery_loses_at_most_one_attempt(
    suspects: list[list[bool]], data: st.DataObject
) -> None:
    """Whatever each stream holds, with at most one started delivery in the process (the
    client's gate), at most one delivery is blamed, and it is that started suspect."""
    cells = [(i, j) for i, stream in enumerate(suspects) for j in range(len(stream))]
    chosen = data.draw(st.none() | st.sampled_from(cells))
    blamed = [
        blamed_on_vanish(stream, [(i, j) == chosen for j in range(len(stream))])
        for i, stream in enumerate(suspects)
    ]
    hits = [(i, j) for i, b in enumerate(blamed) for j, x in enumerate(b) if x]
    assert len(hits) <= 1
    if hits:
        assert hits == [chosen]
        assert chosen is not None  # a hit is a chosen cell
        assert suspects[chosen[0]][chosen[1]]


# --- acquittals: what a crash blamed on one record makes of its neighbours ------------------

NONE = (0, -1)
B, S, A = Judgement.BLAMED, Judgement.SUSPECT, Judgement.ACQUITTED


def test_the_neighbours_of_a_blamed_started_isolated_suspect_are_acquitted() -> None:
    """The pill at offset 7, the isolated suspect the process started, crashes it with 15
    neighbours in flight: it alone is blamed, and they go back as ordinary deliveries (a
    suspect among them stays one)."""
    offsets = list(range(16))
    suspects = [o in (7, 9) for o in offsets]
    verdicts = judged_on_vanish(offsets, suspects, [NONE] * 16, [o == 7 for o in offsets])
    assert verdicts == [A] * 7 + [B, A, S] + [A] * 6


def test_a_crash_nothing_explains_makes_every_delivery_a_suspect() -> None:
    offsets = list(range(4))
    # An isolating process that started no suspect (a pill on its first delivery).
    assert judged_on_vanish(offsets, [False] * 4, [NONE] * 4, [False] * 4) == [S] * 4
    # An older client holding several, none a suspect.
    assert judged_on_vanish(offsets, [False] * 4, [NONE] * 4) == [S] * 4


def test_an_older_client_or_a_push_target_acquits_no_one() -> None:
    """Their one suspect ran beside the others: it is blamed, the others are suspects."""
    offsets, suspects = [0, 1, 2], [False, True, False]
    assert judged_on_vanish(offsets, suspects, [NONE] * 3) == [S, B, S]
    push = judged_on_vanish(offsets, suspects, [NONE] * 3, [True] * 3, isolating=False)
    assert push == [S, B, S]
    assert judged_on_vanish([5], [False], [NONE]) == [B]  # an older client's lone delivery


def test_an_acquittal_holds_for_one_more_crash_blamed_on_the_same_record_only() -> None:
    """A blamed pill goes out again at once and crashes the next process, which may hold
    the records acquitted at the first crash: they stay acquitted; a third crash, or one
    blamed on another record, makes them suspects."""
    blamed_on_7 = ([3, 7], [False, True], [False, True])
    offsets, suspects, started = blamed_on_7
    assert judged_on_vanish(offsets, suspects, [NONE, NONE], started) == [A, B]
    assert judged_on_vanish(offsets, suspects, [(1, 7), NONE], started) == [A, B]
    assert judged_on_vanish(offsets, suspects, [(2, 7), NONE], started) == [S, B]
    assert judged_on_vanish(offsets, suspects, [(1, 8), NONE], started) == [S, B]
    # Unexplained: a suspect, acquitted or not.
    assert judged_on_vanish([3, 4], [False, False], [(1, 7), NONE], [False, False]) == [S, S]


@given(st.lists(st.none() | st.integers(0, 3), min_size=1, max_size=12))
def test_a_pill_is_acquitted_at_most_twice_before_it_is_a_suspect(
    crashes: list[int | None],
) -> None:
    """A record on its first deliveries (the pill of the coincidence) held at any run of
    crashes, each blamed on a started isolated suspect at offset 0-3 or on no one (None):
    it is acquitted at most twice, then a suspect (whose rules never acquit it), so one
    pill costs healthy records at most 3 attempts and is isolated by its third crash."""
    pill = 99
    acquittal = NONE
    verdicts: list[Judgement] = []
    for culprit in crashes:
        if culprit is None:
            (verdict,) = judged_on_vanish([pill], [False], [acquittal], [False])
        else:
            verdict, blamed = judged_on_vanish(
                [pill, culprit], [False, True], [acquittal, NONE], [False, True]
            )
            assert blamed is B
        verdicts.append(verdict)
        if verdict is not A:
            break
        acquittal = (acquittal[0] + 1, culprit if culprit is not None else -1)
    assert verdicts.count(A) <= 2
    assert A not in verdicts[2:]
    assert B not in verdicts


@given(
    st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=20),
    st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 20)), min_size=20, max_size=20),
    st.booleans(),
    st.booleans(),
)
def test_verdicts_agree_with_blame_and_acquit_only_beside_one_isolated_culprit(
    held: list[tuple[bool, bool]],
    acquittals: list[tuple[int, int]],
    reported: bool,
    isolating: bool,
) -> None:
    offsets = list(range(len(held)))
    suspects = [suspect for suspect, _ in held]
    started = [began for _, began in held] if reported else None
    acq = acquittals[: len(held)]
    verdicts = judged_on_vanish(offsets, suspects, acq, started, isolating=isolating)
    blamed = blamed_on_vanish(suspects, started)
    assert [v is B for v in verdicts] == blamed  # the attempts are blamed_on_vanish's
    if A in verdicts:
        assert reported
        assert isolating
        assert blamed.count(True) == 1
    for v, suspect, (times, _) in zip(verdicts, suspects, acq, strict=True):
        if v is A:
            assert not suspect
            assert times <= 1
