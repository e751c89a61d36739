"""Acting on every pending dead letter a filter selects: count first, then replay or
discard, a page at a time, with progress.

Why a module of its own: `triage dlq replay/discard` and the web console both act on
"everything matching this filter", and must claim, mark and report exactly alike (one
routine, never two copies). The steps are:

    count_pending    how many pending items the filter selects now (and their topics):
                     what a confirmation states and what `triage dlq` checks the broker
                     for, read with keys only (`pages.select`)
    replay_matching  page by page (oldest first, `BULK_CHUNK` items): re-read the page's
                     items in full with consistent reads (`DeadLetterTable.get_many`: the
                     index is eventually consistent and holds no payloads), then the one
                     replay routine (`replay.replay`, chunk by chunk through
                     `Replayer.replay_chunk`: claim -> produce -> confirm -> mark, its
                     in-doubt rules unchanged)
    discard_matching page by page, a conditional discard per item (pending and not
                     claimed by a live replay, `DeadLetterTable.discard`)

`progress(done, total)` is called after each item or chunk: `done` items have an
outcome, `total` is what is known so far (the larger of the count handed in as
`expected` and the items selected so far); the last call has the final numbers. `stop`
(a threading.Event) is checked between pages for replay (the chunk in hand is settled
first) and between items for discard; the result then says `interrupted`. Items that
changed between the count and the action are counted where they end (skipped when no
longer pending, or no longer in the table), so a count is a promise of at most, never of
exactly.

Two optional arguments serve a caller that runs several actions at once (the console):
`hold` (e.g. a lock) is held while each chunk is read, claimed, produced and settled
(replay) or each item is discarded, and released in between, so the caller's other
changes wait at most that long; `result` is the result to add to (the one returned), so
`progress` can read the outcomes so far from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from triage_proxy.store.items import STATUS_PENDING, DeadLetterKey, item_key
from triage_proxy.store.pages import MAX_PAGE_SIZE, select
from triage_proxy.store.query import LIST_ATTRIBUTES, DeadLetterTable, Filters
from triage_proxy.store.replay import (
    DEFAULT_CLAIM_LEASE_S,
    DEFAULT_FLUSH_TIMEOUT_S,
    NeverWritten,
    Outcome,
    Producer,
    ReplayResult,
    replay,
)

Progress = Callable[[int, int], None]
"""progress(done, total known so far)."""

BULK_CHUNK = 100
"""Items re-read (BatchGetItem takes 100 keys) and replayed together."""
COUNT_ATTRIBUTES = ("topic",)
"""What counting reads (plus what selection needs)."""


def pending_filters(filters: Filters) -> Filters:
    """`filters` narrowed to what a bulk action acts on: pending items."""
    return dataclasses.replace(filters, status=STATUS_PENDING)


@dataclass(frozen=True)
class Count:
    """What a bulk action on a filter would act on now."""

    selected: int
    """Pending items the filter selects (at least this many when not `complete`)."""
    complete: bool
    """False when `cap` stopped counting."""
    topics: frozenset[str]
    """Source topics of the counted items."""


@dataclass
class DiscardResult:
    """What discarding did, item by item."""

    discarded: list[DeadLetterKey] = field(default_factory=list)
    skipped: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """No longer pending, or claimed by a live replay."""
    interrupted: bool = False
    """True when `stop` ended the run before every selected item was tried."""


def count_pending(table: DeadLetterTable, filters: Filters, *, cap: int | None = None) -> Count:
    """How many pending dead letters `filters` selects (stops at `cap` if given)."""
    selected = 0
    topics: set[str] = set()
    for item in select(table, pending_filters(filters), attributes=COUNT_ATTRIBUTES):
        if cap is not None and selected >= cap:
            return Count(selected, False, frozenset(topics))
        selected += 1
        topics.add(item["topic"]["S"])
    return Count(selected, True, frozenset(topics))


def discard_matching(
    table: DeadLetterTable,
    filters: Filters,
    *,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    expected: int | None = None,
    hold: contextlib.AbstractContextManager[Any] | None = None,
    result: DiscardResult | None = None,
) -> DiscardResult:
    """Discard every pending dead letter `filters` selects (see the module docstring)."""
    result = DiscardResult() if result is None else result
    done = 0
    for item in select(table, pending_filters(filters), limit=MAX_PAGE_SIZE):
        if stop is not None and stop.is_set():
            result.interrupted = True
            break
        key = item_key(item)
        with hold if hold is not None else contextlib.nullcontext():
            discarded = table.discard(key, item)
        if discarded:
            result.discarded.append(key)
        else:
            result.skipped.append((key, "no longer pending, or being replayed"))
        done += 1
        if progress is not None:
            progress(done, max(done, expected or 0))
    if progress is not None:
        progress(done, done if not result.interrupted else max(done, expected or 0))
    return result


def replay_matching(
    table: DeadLetterTable,
    producer: Producer,
    filters: Filters,
    *,
    replay_id: str,
    never_written: NeverWritten,
    to_topic: str | None = None,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    expected: int | None = None,
    chunk: int = BULK_CHUNK,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
    lease_s: float = DEFAULT_CLAIM_LEASE_S,
    hold: contextlib.AbstractContextManager[Any] | None = None,
    result: ReplayResult | None = None,
) -> ReplayResult:
    """Replay every pending dead letter `filters` selects, a chunk at a time, oldest
    first (with --topic and --partition: in offset order); stale claims of dead runs are
    taken over, as `replay.replay` does. Raises DeadLetterUnavailable if the table stops
    answering (the chunk in hand is settled first). `never_written` is
    `replay.Replayer`'s."""
    done = 0

    def settled(keys: list[DeadLetterKey]) -> None:
        nonlocal done
        done += len(keys)
        if progress is not None and len(keys) == chunk:  # the last, short one: below
            progress(done, max(done, expected or 0))

    listed = select(
        table,
        pending_filters(filters),
        limit=chunk,
        attributes=LIST_ATTRIBUTES,
        newest_first=False,
    )
    result = replay(
        table,
        producer,
        (item_key(item) for item in listed),
        replay_id=replay_id,
        never_written=never_written,
        to_topic=to_topic,
        flush_timeout_s=flush_timeout_s,
        lease_s=lease_s,
        chunk=chunk,
        read=functools.partial(_read_afresh, table),
        settled=settled,
        stop=stop,
        hold=hold,
        result=result,
    )
    if progress is not None:
        progress(done, done if not result.interrupted else max(done, expected or 0))
    return result


def _read_afresh(
    table: DeadLetterTable, keys: list[DeadLetterKey], result: ReplayResult
) -> list[dict[str, Any]]:
    """The items at `keys`, read afresh and in full, a partition's in offset order; the
    keys with no item any more are added to `result` as skipped."""
    keys = sorted(keys)
    items = table.get_many(keys)
    present = {item_key(item) for item in items}
    for key in keys:
        if key not in present:  # deleted meanwhile (TTL)
            result.add(Outcome.SKIPPED, key, "no longer in the table")
    return items
