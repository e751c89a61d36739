"""The console's one door to the dead-letter table.

Everything the console reads or changes in the table goes through `DeadLetters`, and it
uses only the routines `triage dlq` uses: `store.query` (`DeadLetterTable`, `Filters`,
`matches`) to select, read and discard one item, `store.replay.replay` (claims, in-doubt
rules, exit states) to replay one, and `store.bulk` (`count_pending`, `replay_matching`,
`discard_matching`) for everything a filter selects. Nothing here decides which items a
filter selects, how a replay is made safe or what counts as skipped; this module only
pages, counts and summarises for the pages.

Changes (replay, discard) are made one at a time per console process (a lock, handed to
the bulk routines as their `hold`): one item, one chunk of a bulk replay (read afresh,
claimed, produced and settled), or one item of a bulk discard. So two browsers acting on
the same items through one console take turns: the second sees the first's claims and
marks and produces nothing twice, and a single-item action waits for at most one chunk
of a running bulk job, not for all of it. Between processes (a console and
`triage dlq`, the Spark job, another console) the claims keep them apart, because
DynamoDB makes each conditional write atomic. (moto server does not: two claims of one
item sent at the same instant both succeeded for 39 of 300 items, measured with two
threads; so a test of two consoles at once against moto could see a double.)

Memory: a page (`page`), a chunk of bulk work (`store.bulk.BULK_CHUNK` items) or one item
(`payload`) at a time; counting (`count`, `reasons`) keeps numbers, not items. A running
bulk job keeps the key of each item it tried (the routines' result, as `triage dlq`
keeps it); the page sees counts and the first FAILURES_SHOWN failures.

Reading goes through `store.pages` and `store.bulk`, as `triage dlq` reads: a page of
the list is one `pages.page` (the by-state index when the table has it, a Query on one
partition, a bounded scan on a table not indexed yet) with its opaque, checked cursor;
counts by reason stop at the store's cap and say so; bulk work walks `pages.select`
oldest first and reads each chunk again in full with consistent reads before replaying.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from triage_cli.render import hex_dump, item_summary, render_bytes, safe_text

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings
    from triage_proxy.store.bulk import DiscardResult
    from triage_proxy.store.items import DeadLetterKey
    from triage_proxy.store.query import DeadLetterTable, Filters
    from triage_proxy.store.replay import ReplayResult

PAGE_SIZE = 50
"""Dead letters per page of the list."""
MAX_PAGE_SIZE = 200
HEX_LIMIT = 64 * 1024
"""Bytes of a key, value or header the hex view shows (the rest is counted)."""
TEXT_LIMIT = 1024 * 1024
"""Characters of the text view."""
MOST_REASONS = 20
"""Reasons the counts list by name (the rest are summed as "other")."""
FAILURES_SHOWN = 20
"""Failed or in-doubt items a bulk job names (all are counted)."""
BROKER_TIMEOUT_S = 10.0


def parse_key(text: str) -> DeadLetterKey:
    """ "topic/partition/offset" (how the pages name a dead letter); ValueError if not."""
    topic, sep, rest = text.rpartition("/")
    topic, sep2, partition = topic.rpartition("/")
    if not sep or not sep2 or not topic:
        raise ValueError(f"not a dead letter id: {text!r} (want topic/partition/offset)")
    return topic, _natural(partition, "partition"), _natural(rest, "offset")


def _natural(text: str, what: str) -> int:
    if not text.isdigit() or len(text) > 19:
        raise ValueError(f"{what} must be a whole number >= 0, got {text!r}")
    return int(text)


def key_text(key: DeadLetterKey) -> str:
    return "/".join(map(str, key))


@dataclass(frozen=True)
class Page:
    """One page of the list."""

    items: list[dict[str, Any]]
    """Summaries (`render.item_summary` plus `id`), in the table's order."""
    next: str | None
    """The cursor of the next page (pass it as `after`), or None after the last."""


@dataclass
class BulkResult:
    """What a bulk replay or discard did, as counts (and the first few failures)."""

    action: str
    selected: int = 0
    """Pending items matching when the job started (what the confirmation said)."""
    done: int = 0
    """Items tried so far."""
    replayed: int = 0
    discarded: int = 0
    skipped: int = 0
    failed: int = 0
    in_doubt: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)
    """The first FAILURES_SHOWN failed or in-doubt items: `id`, `outcome`, `why`."""
    replay_id: str | None = None
    interrupted: bool = False

    def tally(self, outcomes: ReplayResult | DiscardResult) -> None:
        """Take the counts (and the first failures) of a bulk routine's result so far."""
        from triage_proxy.store.bulk import DiscardResult

        self.skipped = len(outcomes.skipped)
        self.interrupted = outcomes.interrupted
        if isinstance(outcomes, DiscardResult):
            self.discarded = len(outcomes.discarded)
            self.done = self.discarded + self.skipped
            return
        self.replayed = len(outcomes.replayed)
        self.failed = len(outcomes.failed)
        self.in_doubt = len(outcomes.in_doubt)
        self.done = self.replayed + self.skipped + self.failed + self.in_doubt
        noted = itertools.chain(
            (("failed", key, why) for key, why in outcomes.failed),
            (("in doubt", key, why) for key, why in outcomes.in_doubt),
        )
        self.failures = [
            {"id": key_text(key), "outcome": outcome, "why": why}
            for outcome, key, why in itertools.islice(noted, FAILURES_SHOWN)
        ]


def blob(data: bytes | None) -> dict[str, Any]:
    """A key, value or header for the detail page: every view the page can switch to.

    `auto` is the view `triage dlq show` would pick (json, text or hex); `text` has
    control and format characters escaped (`render.safe_text`); `json` is pretty-printed
    JSON (None when it is not JSON); `hex` an xxd-style dump of the first HEX_LIMIT
    bytes."""
    if data is None:
        return {"null": True, "size": 0, "auto": "text", "text": "(null)", "json": None,
                "hex": "", "utf8": True, "truncated": False}  # fmt: skip
    kind = render_bytes(data, hex_limit=HEX_LIMIT).kind
    try:
        decoded = data.decode("utf-8")
        utf8 = True
    except UnicodeDecodeError:
        decoded = data.decode("utf-8", "replace")
        utf8 = False
    pretty: str | None = None
    if utf8:
        try:
            pretty = safe_text(json.dumps(json.loads(decoded), indent=2, ensure_ascii=False))
        except (ValueError, RecursionError):
            pretty = None
    auto = {"json": "json", "text": "text", "empty": "text"}.get(kind, "hex")
    if auto == "text" and pretty is not None:
        auto = "json"
    return {
        "null": False,
        "size": len(data),
        "auto": auto,
        "text": safe_text(decoded[:TEXT_LIMIT]),
        "json": pretty,
        "hex": hex_dump(data[:HEX_LIMIT]),
        "utf8": utf8,
        "truncated": len(data) > HEX_LIMIT,
    }


class DeadLetters:
    """One deployment's dead letters for the console (see the module docstring); sync,
    thread-safe (boto3 clients are): the server calls it from worker threads."""

    def __init__(self, settings: Settings, *, table: DeadLetterTable | None = None) -> None:
        from triage_proxy.store.query import DeadLetterTable

        self.settings = settings
        self._changing = threading.Lock()
        """Held while a chunk (or one item) is claimed, produced and marked, or discarded."""
        self.table = table or DeadLetterTable(settings.dead_letters, group=settings.kafka.group_id)

    def close(self) -> None:
        self.table.close()

    # --- selecting --------------------------------------------------------------------

    def filters(
        self,
        *,
        partition: str | None = None,
        reason: str | None = None,
        since: str | None = None,
        state: str | None = None,
        now_ms: int | None = None,
    ) -> Filters:
        """The selection the list's filter fields describe (empty fields select all); a
        partition narrows to the config's topic, so the list is a Query. ValueError with
        what is wrong."""
        from triage_proxy.store.query import Filters, parse_time

        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        part = None if not partition else _natural(partition.strip(), "partition")
        return Filters(
            topic=self.settings.kafka.topic if part is not None else None,
            partition=part,
            reason=reason or None,
            since_ms=parse_time(since, now_ms) if since else None,
            status=state or None,
        )

    def page(self, filters: Filters, *, after: str | None = None, size: int = PAGE_SIZE) -> Page:
        """The next `size` items at most that `filters` selects from the cursor `after`
        (None: the first page), read as `triage dlq list` reads them (`store.pages`: the
        by-state index when the table has it). A page may hold fewer items and still a
        cursor: each page costs a bounded number of DynamoDB calls. InvalidCursor for a
        cursor this listing did not hand out."""
        from triage_proxy.store.pages import page

        size = max(1, min(size, MAX_PAGE_SIZE))
        found = page(self.table, filters, after, size)
        return Page(items=[_summary(item) for item in found.items], next=found.next_cursor)

    def reasons(self, filters: Filters) -> dict[str, Any]:
        """How many items `filters` selects, by reason (the MOST_REASONS commonest), over
        at most `store.pages.DEFAULT_COUNT_CAP` items (`complete` is False beyond)."""
        from triage_proxy.store.pages import reason_counts

        counted = reason_counts(self.table, filters)
        top = counted.by_reason[:MOST_REASONS]
        return {
            "total": counted.counted,
            "complete": counted.complete,
            "reasons": [{"reason": safe_text(r), "raw": r, "count": n} for r, n in top],
            "other": counted.counted - sum(n for _, n in top),
        }

    def count(self, filters: Filters) -> int:
        """Pending items `filters` selects: what a bulk replay or discard would try."""
        from triage_proxy.store.bulk import count_pending

        return count_pending(self.table, filters).selected

    # --- one item ---------------------------------------------------------------------

    def detail(self, key: DeadLetterKey) -> dict[str, Any]:
        """The item's metadata (no payload); DeadLetterNotFound if there is none."""
        return _summary(self.table.get(key))

    def payload(self, key: DeadLetterKey) -> dict[str, Any]:
        """Key, value and headers, byte-exact (fetched from S3 when the payload is there),
        in every view (`blob`). ValueError when the S3 object is missing."""
        item = self.table.get(key)
        dl = self.table.load(item)
        record = dl.record
        return {
            "id": key_text(key),
            "key": blob(record.key),
            "value": blob(record.value),
            "headers": [{"name": safe_text(name), **blob(value)} for name, value in record.headers],
        }

    def replay_one(self, key: DeadLetterKey) -> dict[str, Any]:
        """Replay one item through `store.replay.replay`; an item that is not pending is
        left as it is (outcome "skipped", with its status)."""
        from triage_proxy.kafka.producer import never_written
        from triage_proxy.store.items import STATUS_PENDING
        from triage_proxy.store.replay import new_replay_id, replay

        with self._changing:
            item = self.table.get(key)
            status = item["status"]["S"]
            if status != STATUS_PENDING:
                return self._answer(key, "skipped", f"already {status}; nothing changed")
            producer = self._producer(key[0])
            result = replay(
                self.table,
                producer,
                [item],
                replay_id=new_replay_id(),
                never_written=never_written,
                chunk=1,
            )
        for outcome in ("skipped", "failed", "in_doubt"):
            for _, why in getattr(result, outcome):
                return self._answer(key, outcome, why)
        return self._answer(key, "replayed", "")

    def discard_one(self, key: DeadLetterKey) -> dict[str, Any]:
        """Discard one pending item (`DeadLetterTable.discard`, as `triage dlq discard`)."""
        from triage_proxy.store.items import STATUS_PENDING

        with self._changing:
            item = self.table.get(key)
            status = item["status"]["S"]
            if status != STATUS_PENDING:
                return self._answer(key, "skipped", f"already {status}; nothing changed")
            discarded = self.table.discard(key, item)
        if discarded:
            return self._answer(key, "discarded", "")
        return self._answer(key, "skipped", "no longer pending, or being replayed")

    def _answer(self, key: DeadLetterKey, outcome: str, why: str) -> dict[str, Any]:
        return {"outcome": outcome, "why": why, "item": self.detail(key)}

    # --- many -------------------------------------------------------------------------

    def bulk(
        self,
        action: str,
        filters: Filters,
        *,
        progress: Callable[[BulkResult], None] = lambda result: None,
        stop: threading.Event | None = None,
    ) -> BulkResult:
        """Replay or discard every pending item `filters` selects through the routines
        `triage dlq replay/discard` use (`store.bulk.replay_matching`, `discard_matching`),
        so claims, in-doubt rules and outcomes are theirs: an item no longer pending, or no
        longer in the table, is skipped. `progress` is called once with the count, then
        whenever the routine reports progress (after each chunk replayed, each item
        discarded), with the outcomes so far. Nothing is done when the count is 0."""
        from triage_proxy.kafka.producer import never_written
        from triage_proxy.store.bulk import DiscardResult, discard_matching, replay_matching
        from triage_proxy.store.replay import ReplayResult, new_replay_id

        if action not in ("replay", "discard"):
            raise ValueError(f"unknown action {action!r} (replay or discard)")
        result = BulkResult(action=action, selected=self.count(filters))
        progress(result)
        if not result.selected:
            return result
        run: Callable[..., object]
        outcomes: ReplayResult | DiscardResult
        if action == "discard":
            outcomes = DiscardResult()
            run = functools.partial(discard_matching, self.table, filters, result=outcomes)
        else:
            producer = self._producer(self.settings.kafka.topic)
            result.replay_id = new_replay_id()
            outcomes = ReplayResult()
            run = functools.partial(
                replay_matching,
                self.table,
                producer,
                filters,
                replay_id=result.replay_id,
                never_written=never_written,
                result=outcomes,
            )

        def step(done: int, total: int) -> None:
            result.tally(outcomes)
            progress(result)

        run(progress=step, stop=stop, expected=result.selected, hold=self._changing)
        result.tally(outcomes)
        return result

    def _producer(self, topic: str) -> Any:
        """The replay producer `triage dlq replay` uses, once the broker answered and
        `topic` exists (BrokerUnavailable, NotFoundError otherwise)."""
        from confluent_kafka import Producer

        from triage_cli.dlq.broker import producer_config
        from triage_proxy.errors import BrokerUnavailable, NotFoundError
        from triage_proxy.kafka.errors import kafka_errors

        producer = Producer(producer_config(self.settings))
        with kafka_errors(f"cannot reach Kafka at {self.settings.kafka.bootstrap_servers}"):
            metadata = producer.list_topics(timeout=BROKER_TIMEOUT_S)
        if topic not in metadata.topics:
            raise NotFoundError(f"topic {topic} does not exist")
        if metadata.topics[topic].error is not None:
            raise BrokerUnavailable(f"topic {topic}: {metadata.topics[topic].error}")
        return producer


def _summary(item: Mapping[str, Any]) -> dict[str, Any]:
    from triage_proxy.store.items import item_key

    out = item_summary(item)
    out["id"] = key_text(item_key(item))
    out["key"] = _short_key(item)
    return out


def _short_key(item: Mapping[str, Any]) -> str | None:
    from triage_cli.render import short_text

    if "key" not in item:
        return None
    return short_text(bytes(item["key"]["B"]), 40)
