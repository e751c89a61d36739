"""The client's credit and slot split (credits.py): pure, so checked exhaustively."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from triage_client.credits import (
    IDLE_CREDITS,
    STREAM_CAPS_MAX,
    Split,
    StreamLoad,
    credit_share,
    grown,
    grown_cap,
    hungry,
    split,
)


def load(credits: int, peak: int, held: int = 0, *, adjustable: bool = True) -> StreamLoad:
    return StreamLoad(credits, peak, max(credits, held), adjustable)


def test_a_lone_stream_has_the_whole_budget_and_every_slot() -> None:
    assert split(4, 8, [load(3, 0)]) == Split((8,), (4,))
    assert split(4, 8, [load(3, 3, adjustable=False)]) == Split((3,), (4,))


def test_idle_streams_shrink_to_a_small_prefetch_and_the_rest_stays_free() -> None:
    decision = split(32, 64, [load(16, 0) for _ in range(4)])
    assert decision.credits == (IDLE_CREDITS,) * 4
    assert decision.slots == (32,) * 4, "nobody is hungry: nobody is capped"


def test_a_stream_that_used_some_keeps_its_peak_plus_one() -> None:
    assert split(4, 16, [load(8, 5), load(8, 0)]).credits == (6, IDLE_CREDITS)


def test_a_backlog_beside_idle_partitions_gets_everything_they_leave() -> None:
    # Start: the even split (16 each); partition 0 filled its 16, the others held nothing.
    first = split(32, 64, [load(16, 16), load(16, 0), load(16, 0), load(16, 0)])
    # The idle ones are lowered now; what they could still hold this period is not free yet.
    assert first.credits == (16, 2, 2, 2)
    assert first.slots == (32, 32, 32, 32), "one hungry stream: not capped"
    lowered = [StreamLoad(2, 0, 16, True)] * 3
    assert split(32, 64, [load(16, 16), *lowered]).credits == (16, 2, 2, 2)
    # One period later the lowering has taken effect: the backlog gets the rest.
    settled = [load(2, 0)] * 3
    assert split(32, 64, [load(16, 16), *settled]).credits == (58, 2, 2, 2)


def test_two_backlogs_share_credits_and_slots_evenly() -> None:
    decision = split(4, 8, [load(6, 6), load(2, 2)])
    # The first keeps 6 this period (it may hold them); the second gets what is free.
    assert decision.credits == (4, 2)
    assert decision.slots == (2, 2)
    assert split(4, 8, [load(4, 4, held=6), load(2, 2)]).credits == (4, 2)
    assert split(4, 8, [load(4, 4), load(2, 2)]).credits == (4, 4)


def test_hungry_means_the_stream_filled_its_credits() -> None:
    assert hungry(load(4, 4))
    assert hungry(load(4, 5))
    assert not hungry(load(4, 3))
    assert not hungry(StreamLoad(0, 0, 0, False)), "not connected"


def test_a_stream_without_grants_keeps_its_hello_credits_and_still_gets_a_slot_cap() -> None:
    decision = split(4, 8, [load(4, 4, adjustable=False), load(4, 4)])
    assert decision.credits == (4, 4)
    assert decision.slots == (2, 2)


def test_slot_caps_split_concurrency_over_hungry_streams_only() -> None:
    decision = split(5, 10, [load(2, 2), load(2, 0), load(2, 2), load(2, 2)])
    assert decision.slots == (2, 5, 2, 1)


loads = st.lists(
    st.builds(
        lambda credits, peak, extra, adjustable, connected: (
            StreamLoad(credits, peak, credits + extra, adjustable)
            if connected
            else StreamLoad(0, 0, 0, False)
        ),
        st.integers(1, 40),
        st.integers(0, 60),
        st.integers(0, 20),
        st.booleans(),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=400)
@given(concurrency=st.integers(1, 32), prefetch=st.integers(0, 32), streams=loads)
def test_credits_held_or_in_force_never_grow_past_the_budget(
    concurrency: int, prefetch: int, streams: list[StreamLoad]
) -> None:
    budget = concurrency + prefetch
    decision = split(concurrency, budget, streams)
    assert len(decision.credits) == len(decision.slots) == len(streams)
    for old, new, slots in zip(streams, decision.credits, decision.slots, strict=True):
        assert 1 <= slots <= concurrency
        if not old.adjustable:
            assert new == old.credits, "a stream without grants keeps its Hello's credits"
        else:
            assert new >= 1
    committed_before = sum(s.committed for s in streams)
    committed_after = sum(
        max(new, s.committed) for s, new in zip(streams, decision.credits, strict=True)
    )
    # Raises only out of what is free: within the budget whenever it was before (more
    # streams than budget exceed it by design: each keeps at least 1).
    if len(streams) > 1:
        assert committed_after <= max(budget, committed_before)
    hungry_caps = [c for s, c in zip(streams, decision.slots, strict=True) if hungry(s)]
    if len(hungry_caps) > 1:
        assert sum(hungry_caps) == max(concurrency, len(hungry_caps)), "at least 1 each"
        assert max(hungry_caps) - min(hungry_caps) <= 1


@given(
    concurrency=st.integers(1, 16),
    prefetch=st.integers(0, 16),
    demand=st.lists(st.booleans(), min_size=2, max_size=6),
    periods=st.integers(3, 6),
)
def test_backlogs_converge_to_an_even_share_and_idle_streams_to_the_prefetch(
    concurrency: int, prefetch: int, demand: list[bool], periods: int
) -> None:
    """Repeated rebalances where a stream with a backlog always fills its credits and an
    idle one holds nothing: the backlogs end with even shares of what idle ones leave."""
    budget = concurrency + prefetch
    n = len(demand)
    credits = [credit_share(budget, n, i) for i in range(n)]
    lowered = list(credits)
    for _ in range(periods):
        streams = [
            StreamLoad(c, c if busy else 0, max(c, low), True)
            for c, busy, low in zip(credits, demand, lowered, strict=True)
        ]
        new = list(split(concurrency, budget, streams).credits)
        lowered = [max(c, n_) if n_ < c else n_ for c, n_ in zip(credits, new, strict=True)]
        credits = new
    # A last period in which lowerings took effect.
    streams = [
        StreamLoad(c, c if busy else 0, c, True) for c, busy in zip(credits, demand, strict=True)
    ]
    credits = list(split(concurrency, budget, streams).credits)
    idle = [c for c, busy in zip(credits, demand, strict=True) if not busy]
    busy = [c for c, b in zip(credits, demand, strict=True) if b]
    if budget >= n * IDLE_CREDITS:
        assert all(c == IDLE_CREDITS for c in idle)
    if busy and budget >= n * IDLE_CREDITS:
        assert max(busy) - min(busy) <= 1
        assert sum(busy) + sum(idle) == budget, "the backlogs use everything left"


def test_the_default_prefetch_goes_to_its_cap_when_slots_idled_beside_a_backlog() -> None:
    assert grown(16, 40, [load(16, 16)], idled=3) == 40
    assert grown(16, 40, [load(16, 9), load(16, 0)], idled=1) == 40, "a backlog on its way"
    assert grown(40, 40, [load(40, 40)], idled=5) == 40


def test_the_default_prefetch_stays_without_both_signs() -> None:
    assert grown(16, 40, [load(16, 16)], idled=0) == 16, "no slot ran dry"
    assert grown(16, 40, [load(16, 8), load(16, 0)], idled=4) == 16, "no backlog: a trickle"


@given(
    budget=st.integers(1, 300),
    extra=st.integers(0, 512),
    peaks=st.lists(st.integers(0, 600), min_size=1, max_size=4),
    idled=st.integers(0, 10),
)
def test_the_grown_budget_never_shrinks_nor_passes_its_cap(
    budget: int, extra: int, peaks: list[int], idled: int
) -> None:
    cap = budget + extra
    loads = [load(budget, peak) for peak in peaks]
    assert grown(budget, cap, loads, idled) in (budget, cap)


def test_the_prefetch_cap_is_one_stream_cap_per_backlogged_stream_up_to_the_most() -> None:
    idle, backlog = load(320, 0), load(320, 320)
    assert grown_cap(1280, 100_000, [idle] * 4) == 1280, "no backlog: one stream's cap"
    assert grown_cap(1280, 100_000, [backlog, idle, idle]) == 1280
    assert grown_cap(1280, 100_000, [backlog, backlog, backlog, idle]) == 3 * 1280
    assert grown_cap(1280, 100_000, [backlog] * 6) == 6 * 1280
    assert grown_cap(1280, 100_000, [backlog] * (STREAM_CAPS_MAX + 2)) == STREAM_CAPS_MAX * 1280
    assert grown_cap(1280, 3000, [backlog] * 4) == 3000, "never past the largest Grant"
    assert grown_cap(1280, 1000, [backlog] * 4) == 1280, "nor below one stream's cap"
    # Measured by what was held, not credits: half of them at once is a backlog on its way.
    assert grown_cap(40, 100_000, [load(16, 9), load(16, 8)]) == 40


def test_no_stream_is_given_more_than_one_streams_cap() -> None:
    # Four backlogs under a budget of four caps: a cap each, not more.
    assert split(256, 5120, [load(1280, 1280)] * 4, stream_cap=1280).credits == (1280,) * 4
    # Alone with a backlog: its cap, the rest stays free for the others' next backlog.
    alone = split(256, 5120, [load(1280, 1280)] + [load(2, 0)] * 3, stream_cap=1280)
    assert alone.credits == (1280, 2, 2, 2)
    assert split(256, 5120, [load(3, 0)], stream_cap=1280).credits == (1280,)
    # Without a cap (an explicit prefetch), a lone backlog takes what the others leave.
    assert split(256, 5120, [load(1280, 1280)] + [load(2, 0)] * 3).credits == (5114, 2, 2, 2)


@settings(max_examples=300)
@given(
    cap=st.integers(1, 64),
    budget=st.integers(1, 256),
    streams=loads,
)
def test_a_split_never_gives_a_stream_more_than_the_cap_nor_raises_past_the_budget(
    cap: int, budget: int, streams: list[StreamLoad]
) -> None:
    decision = split(8, budget, streams, stream_cap=cap)
    for old, new in zip(streams, decision.credits, strict=True):
        if old.adjustable and new > old.credits:
            assert new <= max(1, cap), "a raise stops at the stream cap"
    if len(streams) > 1:
        committed_before = sum(s.committed for s in streams)
        committed_after = sum(
            max(new, s.committed) for s, new in zip(streams, decision.credits, strict=True)
        )
        assert committed_after <= max(budget, committed_before)
