"""Pages of one deployment's dead letters: bounded reads that resume from a cursor.

Why a module of its own: a console (and `triage dlq list`) must show the first page of
a table of any size at once, hold no more than a page in memory, and go on from where
it stopped; `query.DeadLetterTable.scan` reads a whole selection. So `page(table,
filters, cursor, limit)` makes a bounded number of DynamoDB calls (`CALLS_PER_PAGE`)
and returns at most `limit` items and an opaque cursor to the rest. `reason_counts`
counts by reason the same way, with a cap. The selection is `query.matches`, the one
definition every tool shares, checked on every item returned.

How a filter is read (`plan`), best first:

    mode    when                                    reads                     order
    ------  --------------------------------------  ------------------------  ---------------
    key     --topic and --partition (+ --offset)    Query on the partition    offset, oldest
                                                    key (status filtered by   first
                                                    DynamoDB)
    index   the `by-state` index is ready           Query on the index, one   newest first,
            (`DeadLetterTable.indexed`)             status after the other    per status
                                                    (pending, replayed,       (pending first)
                                                    discarded); since/until
                                                    on its sort key
    scan    otherwise (a table not migrated yet:    Scan, filtered by         table order
            `triage dlq migrate`)                   DynamoDB and here

Bounded cost: when DynamoDB itself applies the whole filter (index or key mode with no
reason, topic or partition beyond the key), one call reads `limit` items. Otherwise each
call evaluates `EVALUATE_PER_CALL` items, and after `CALLS_PER_PAGE` calls the page ends
with what matched (possibly nothing) and a cursor: a filter that matches nothing costs
a bounded time per page, never a full scan at once.

The cursor is URL-safe base64 of JSON: the mode, a digest of the group and filters, the
status being read (index mode) and DynamoDB's LastEvaluatedKey (or the key of the last
item returned, when a page ends inside a call's answer). `decode_cursor` checks all of
it, so a cursor of another listing, another deployment, or garbage raises
`InvalidCursor` (a `BadInput`: exit code 2 in the CLI) instead of reading elsewhere.
Index reads are eventually consistent (DynamoDB offers no other on a global index):
an item marked a moment ago may still be listed under its old status, which is why
every item is checked with `matches` and every status change is conditional.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from triage_proxy.errors import BadInput
from triage_proxy.store.items import (
    AT_ATTR,
    GROUP_ATTR,
    KIND_DEAD_LETTER,
    STATE_ATTR,
    STATE_INDEX,
    STATUSES,
    dead_letter_source,
    format_iso_ms,
    parse_iso_ms,
    parse_source,
    state_key,
)
from triage_proxy.store.query import (
    LIST_ATTRIBUTES,
    DeadLetterTable,
    Filters,
    filter_clauses,
    matches,
)

DEFAULT_PAGE_SIZE = 50
"""Items per page when the caller does not say."""
MAX_PAGE_SIZE = 1000
"""Most items one page may hold."""
CALLS_PER_PAGE = 5
"""Most DynamoDB calls one page makes (a selective filter returns a short page and a
cursor rather than reading on)."""
EVALUATE_PER_CALL = 200
"""Items one call evaluates when this module checks part of the filter itself (so a
page evaluates at most CALLS_PER_PAGE x EVALUATE_PER_CALL = 1,000 items)."""
DEFAULT_COUNT_CAP = 5_000
"""Items `reason_counts` evaluates at most; beyond that it says "more than"."""
COUNT_ATTRIBUTES = ("reason",)
"""What counting reads of each item (plus what `matches` needs)."""
CURSOR_VERSION = 1

Mode = Literal["key", "index", "scan"]

_MATCH_ATTRIBUTES = (
    "source",
    "offset",
    GROUP_ATTR,
    "topic",
    "partition",
    "status",
    "reason",
    AT_ATTR,
)
_NUMBER = re.compile(r"^-?\d{1,20}$")


class InvalidCursor(BadInput):
    """A cursor that this listing did not hand out (another filter, another deployment,
    another table layout, or not a cursor at all)."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"invalid cursor: {why}; start again from the first page (without a cursor)"
        )
        self.why = why


@dataclass(frozen=True)
class Page:
    """One page of dead letters."""

    items: list[dict[str, Any]]
    """The items (low-level, `LIST_ATTRIBUTES` unless asked otherwise), in the mode's order."""
    next_cursor: str | None
    """Where the next page starts; None when this was the last one."""
    mode: Mode
    """How the filter was read (see the module docstring)."""
    examined: int
    """Items DynamoDB evaluated for this page."""
    calls: int
    """DynamoDB calls this page made."""


@dataclass(frozen=True)
class ReasonCounts:
    """Dead letters by reason, over at most a capped number of items."""

    by_reason: list[tuple[str, int]]
    """(reason, count), most frequent first, then by reason."""
    counted: int
    """Items counted (the sum of the counts)."""
    complete: bool
    """False when the cap stopped counting: there are more than `counted` items."""


@dataclass(frozen=True)
class Plan:
    """How `page` reads a filter."""

    mode: Mode
    states: tuple[str | None, ...]
    """The statuses read one after the other (index mode); (None,) otherwise."""
    server_filtered: bool
    """Whether DynamoDB applies the whole filter (then a call reads `limit` items)."""
    newest_first: bool = True
    """Index mode: newest first (False: oldest first)."""


def plan(table: DeadLetterTable, filters: Filters, *, newest_first: bool = True) -> Plan:
    """How `filters` is read on `table` (asks DynamoDB whether the index is ready)."""
    if filters.topic is not None and filters.partition is not None:
        exact = filters.reason is None and filters.since_ms is None and filters.until_ms is None
        return Plan("key", (None,), exact and filters.status is None, newest_first)
    if table.indexed():
        states = (filters.status,) if filters.status is not None else STATUSES
        exact = filters.reason is None and filters.topic is None and filters.partition is None
        return Plan("index", states, exact, newest_first)
    return Plan("scan", (None,), False, newest_first)


def page(
    table: DeadLetterTable,
    filters: Filters,
    cursor: str | None = None,
    limit: int = DEFAULT_PAGE_SIZE,
    *,
    attributes: Sequence[str] = LIST_ATTRIBUTES,
    calls: int = CALLS_PER_PAGE,
    newest_first: bool = True,
) -> Page:
    """Up to `limit` dead letters of `table`'s deployment that `filters` selects, from
    `cursor` on (None: the first page), in at most `calls` DynamoDB calls.

    `newest_first=False` reads the index oldest first (bulk replay does, so a partition's
    dead letters go back in about the order they died); other modes are unaffected.

    Raises InvalidCursor for a cursor this listing did not hand out, ValueError for a
    limit outside 1..MAX_PAGE_SIZE, TableNotFound or DeadLetterUnavailable.
    """
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"a page holds 1..{MAX_PAGE_SIZE} items, not {limit}")
    how = plan(table, filters, newest_first=newest_first)
    state, start = (0, None) if cursor is None else decode_cursor(cursor, table, filters, how)
    per_call = limit if how.server_filtered else max(limit, EVALUATE_PER_CALL)
    found: list[dict[str, Any]] = []
    examined = made = 0
    while made < calls and state < len(how.states):
        operation, kwargs = _request(table, filters, how, how.states[state], per_call, attributes)
        if start is not None:
            kwargs["ExclusiveStartKey"] = start
        answer = table.fetch(operation, kwargs)
        made += 1
        got = answer.get("Items", [])
        examined += int(answer.get("ScannedCount", len(got)))
        last = answer.get("LastEvaluatedKey") or None
        for n, item in enumerate(got):
            if not matches(item, filters, group=table.group):
                continue
            found.append(item)
            if len(found) == limit:
                if n == len(got) - 1 and last is None:
                    state, start = state + 1, None
                else:
                    start = _key_of(item, how.mode)
                return _page(table, filters, how, found, state, start, examined, made)
        start = last
        if start is None:
            state += 1
    return _page(table, filters, how, found, state, start, examined, made)


def pages(
    table: DeadLetterTable,
    filters: Filters,
    *,
    limit: int = MAX_PAGE_SIZE,
    attributes: Sequence[str] = LIST_ATTRIBUTES,
    newest_first: bool = True,
) -> Iterator[Page]:
    """Every page of `filters`, one at a time (the last one has no next_cursor)."""
    cursor: str | None = None
    while True:
        got = page(table, filters, cursor, limit, attributes=attributes, newest_first=newest_first)
        yield got
        if got.next_cursor is None:
            return
        cursor = got.next_cursor


def select(
    table: DeadLetterTable,
    filters: Filters,
    *,
    limit: int = MAX_PAGE_SIZE,
    attributes: Sequence[str] = LIST_ATTRIBUTES,
    newest_first: bool = True,
) -> Iterator[dict[str, Any]]:
    """Every item `filters` selects, read a page at a time (never more in memory)."""
    for got in pages(table, filters, limit=limit, attributes=attributes, newest_first=newest_first):
        yield from got.items


def reason_counts(
    table: DeadLetterTable, filters: Filters, *, cap: int = DEFAULT_COUNT_CAP
) -> ReasonCounts:
    """Dead letters that `filters` selects, counted by reason, over at most about `cap`
    evaluated items (reading only the reason and what selection needs).

    Why counted on demand and not kept as counters: counters would add a second write
    (and its failure cases) to every dead letter, claim and mark, and still need this
    pass to repair them; over the index the default view (pending) costs `cap` items at
    most, 5 calls for 5,000, and says "more than" beyond that.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    counts: Counter[str] = Counter()
    examined = 0
    cursor: str | None = None
    while True:
        got = page(table, filters, cursor, min(MAX_PAGE_SIZE, cap), attributes=COUNT_ATTRIBUTES)
        counts.update(item["reason"]["S"] for item in got.items)
        examined += got.examined
        cursor = got.next_cursor
        if cursor is None or examined >= cap:
            break
    ordered = sorted(counts.items(), key=lambda pair: (-pair[1], pair[0]))
    return ReasonCounts(ordered, sum(counts.values()), cursor is None)


# --- the cursor -------------------------------------------------------------------------


def encode_cursor(
    table: DeadLetterTable, filters: Filters, how: Plan, state: int, start: Mapping[str, Any] | None
) -> str:
    """The opaque cursor of (mode, filters, status being read, start key)."""
    body = {
        "v": CURSOR_VERSION,
        "m": how.mode,
        "f": _fingerprint(table.group, filters, how.newest_first),
        "s": state,
        "k": dict(start) if start is not None else None,
    }
    raw = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(
    cursor: str, table: DeadLetterTable, filters: Filters, how: Plan
) -> tuple[int, dict[str, Any] | None]:
    """(status position, start key) of a cursor `encode_cursor` made for this table view,
    filters and mode; InvalidCursor otherwise."""
    if not isinstance(cursor, str) or not cursor or len(cursor) > 4096:
        raise InvalidCursor("empty or too long")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        body = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidCursor("not a cursor this listing handed out") from None
    if not isinstance(body, dict) or body.get("v") != CURSOR_VERSION:
        raise InvalidCursor("not a cursor this listing handed out")
    if body.get("f") != _fingerprint(table.group, filters, how.newest_first):
        raise InvalidCursor("it belongs to another filter or deployment")
    if body.get("m") != how.mode:
        raise InvalidCursor(
            f"it was made for a {body.get('m')!r} read and this one is {how.mode!r} "
            "(the table was indexed meanwhile)"
        )
    state = body.get("s")
    if not isinstance(state, int) or isinstance(state, bool) or not 0 <= state < len(how.states):
        raise InvalidCursor("its position is out of range")
    start = body.get("k")
    if start is None:
        return state, None
    _check_key(start, table, filters, how, how.states[state])
    return state, dict(start)


def _check_key(
    start: Any, table: DeadLetterTable, filters: Filters, how: Plan, status: str | None
) -> None:
    names = {"source", "offset"} | ({STATE_ATTR, AT_ATTR} if how.mode == "index" else set())
    if not isinstance(start, dict) or set(start) != names:
        raise InvalidCursor("its start key is not a key of this read")
    for name, value in start.items():
        kind = "N" if name == "offset" else "S"
        if not (
            isinstance(value, dict)
            and set(value) == {kind}
            and isinstance(value[kind], str)
            and (kind == "S" or _NUMBER.match(value[kind]))
        ):
            raise InvalidCursor(f"its start key has a malformed {name!r}")
    if int(start["offset"]["N"]) < 0:
        raise InvalidCursor("its start key is not a dead letter")
    source = start["source"]["S"]
    if how.mode == "key":
        assert filters.topic is not None
        assert filters.partition is not None
        if source != dead_letter_source(filters.topic, filters.partition, table.group):
            raise InvalidCursor("its start key is in another partition")
        return
    try:
        _, _, kind, group = parse_source(source)
    except ValueError:
        raise InvalidCursor("its start key is not a dead letter") from None
    if kind != KIND_DEAD_LETTER or group != table.group:
        raise InvalidCursor("its start key is another deployment's")
    if how.mode == "index":
        assert status is not None
        if start[STATE_ATTR]["S"] != state_key(status, table.group):
            raise InvalidCursor("its start key is under another status")
        try:
            parse_iso_ms(start[AT_ATTR]["S"])
        except ValueError:
            raise InvalidCursor("its start key has a malformed time") from None


def _fingerprint(group: str, filters: Filters, newest_first: bool) -> str:
    fields = [group, newest_first, *(getattr(filters, f.name) for f in dataclasses.fields(filters))]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


# --- the calls --------------------------------------------------------------------------


def _page(
    table: DeadLetterTable,
    filters: Filters,
    how: Plan,
    found: list[dict[str, Any]],
    state: int,
    start: Mapping[str, Any] | None,
    examined: int,
    made: int,
) -> Page:
    more = state < len(how.states)
    cursor = encode_cursor(table, filters, how, state, start) if more else None
    return Page(found, cursor, how.mode, examined, made)


def _key_of(item: Mapping[str, Any], mode: Mode) -> dict[str, Any]:
    """The key DynamoDB would resume after `item` with (its LastEvaluatedKey)."""
    names = ("source", "offset", STATE_ATTR, AT_ATTR) if mode == "index" else ("source", "offset")
    return {name: item[name] for name in names}


def _request(
    table: DeadLetterTable,
    filters: Filters,
    how: Plan,
    status: str | None,
    per_call: int,
    attributes: Sequence[str],
) -> tuple[str, dict[str, Any]]:
    wanted = (*attributes, *_MATCH_ATTRIBUTES, STATE_ATTR)
    if how.mode != "index":
        request = table.request(filters, attributes=wanted, page_size=per_call)
        assert request is not None  # no scan segments here
        return request
    assert status is not None
    names: dict[str, str] = {"#v": STATE_ATTR}
    values: dict[str, Any] = {":v": {"S": state_key(status, table.group)}}
    condition = "#v = :v"
    since, until = filters.since_ms, filters.until_ms
    if since is not None or until is not None:
        names["#at"] = AT_ATTR
    if since is not None and until is not None:
        values[":since"] = {"S": format_iso_ms(since)}
        values[":until"] = {"S": format_iso_ms(until - 1)}  # until is exclusive
        condition += " AND #at BETWEEN :since AND :until"
    elif since is not None:
        values[":since"] = {"S": format_iso_ms(since)}
        condition += " AND #at >= :since"
    elif until is not None:
        values[":until"] = {"S": format_iso_ms(until)}
        condition += " AND #at < :until"
    clauses = filter_clauses(filters, ("topic", "partition"), names, values)
    aliases = {f"#a{i}": name for i, name in enumerate(dict.fromkeys(wanted))}
    names.update(aliases)
    kwargs: dict[str, Any] = {
        "TableName": table.table,
        "IndexName": STATE_INDEX,
        "KeyConditionExpression": condition,
        "ScanIndexForward": not how.newest_first,
        "Limit": per_call,
        "ProjectionExpression": ", ".join(aliases),
        "ExpressionAttributeNames": names,
        "ExpressionAttributeValues": values,
    }
    if clauses:
        kwargs["FilterExpression"] = " AND ".join(clauses)
    return "Query", kwargs
