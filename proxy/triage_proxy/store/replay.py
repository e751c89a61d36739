"""Replaying dead letters: the one routine, claim -> produce -> confirm -> mark.

Why a module of its own: `triage dlq replay` (a handful of items, one process) and the
Spark job (millions, one scan segment per task) must replay the same way, or a rerun of
one after the other would replay twice. Both hand chunks of scanned items to
`Replayer.replay_chunk`; what differs is only what surrounds it (the CLI's selection
and Ctrl-C between chunks; Spark's segments, counts and test faults).

One chunk, step by step:

    check    not pending -> skipped. Claimed (seen in the scan) by another run, or by
             this one -> in doubt: it may be in Kafka already. A stale claim of another
             run is taken over only with `take_over_stale` (the CLI always; Spark with
             --retry-in-doubt).
    claim    conditional UpdateItem per item (`query.DeadLetterTable.claim`), then load
             the payload (from S3 when it is there); an unreadable payload is released
             and counted failed.
    produce  every claimed item (original key, value, headers + provenance headers), to
             its source partition or through the partitioner of `to_topic`.
    settle   always, also when a step above raised midway (the error is re-raised after):
             flush, then purge what is still queued, and classify each claimed item:

        delivery report                          claim     outcome
        ---------------------------------------  --------  -------------------------------
        delivered                                marked    replayed (`replayed_to` =
                                                           "<topic>/<partition>/<offset>")
        certainly not sent: never handed to the  released  failed (pending again: a rerun
        producer, or `never_written` says so               replays it)
        (purged in queue, unknown topic or
        partition, too large, not authorized,
        invalid argument)
        any other error (timed out, purged in    kept      in doubt (it may be in Kafka)
        flight, an error librdkafka adds later),
        or no report at all

An item in doubt stays claimed until `lease_s` runs out, so no replay produces it again
meanwhile; the claim also tells an operator which run to look for in the target topic
(the `triage-replay-id` header). A delivered item whose claim another run took over
meanwhile is counted replayed and not marked (a warning says so). The windows left for a
second copy: a process killed between a confirmed delivery and its mark, and a stale
claim taken over (`take_over_stale`) whose first copy did arrive. The `triage-replay-of`
header lets a consumer drop such a duplicate.

Which delivery errors prove nothing was written is librdkafka's rule, kept at the Kafka
edge (`triage_proxy.kafka.producer.never_written`): the store imports no Kafka, so the
callers hand it in as `never_written`, next to the producer it reads the reports of.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from triage_proxy.store.items import (
    CLAIM_ATTR,
    CLAIM_UNTIL_ATTR,
    STATUS_PENDING,
    DeadLetterKey,
    format_iso_ms,
    item_key,
)
from triage_proxy.store.query import DeadLetterTable
from triage_proxy.structs import DeadLetter

logger = logging.getLogger(__name__)

REPLAY_OF_HEADER = "triage-replay-of"
"""Provenance header: "<topic>/<partition>/<offset>" of the dead letter replayed."""
REPLAY_REASON_HEADER = "triage-replay-reason"
"""Provenance header: the reason the message was dead-lettered (UTF-8)."""
REPLAY_ID_HEADER = "triage-replay-id"
"""Provenance header: the id of the replay run that produced this copy."""
DEFAULT_CLAIM_LEASE_S = 900.0
"""How long a replay's claim keeps other replays off an item it has not marked yet."""
DEFAULT_REPLAY_CHUNK = 500
"""Items claimed, produced and confirmed together by `replay`."""
DEFAULT_FLUSH_TIMEOUT_S = 30.0
"""How long `replay` waits for the broker to confirm one chunk."""
PURGED_FLUSH_S = 5.0
"""After a flush timed out and the queue was purged: how long to wait for the reports."""

T = TypeVar("T")


# --- the policy (pure) ------------------------------------------------------------------


class Outcome(enum.Enum):
    """What a replay did with one selected item."""

    REPLAYED = "replayed"
    """Produced and confirmed by the broker (and marked, unless another run took it over)."""
    SKIPPED = "skipped"
    """Not produced: no longer pending, or claimed by another run in the meantime."""
    FAILED = "failed"
    """Not produced, or certainly not delivered; left pending (claim released) for a rerun."""
    IN_DOUBT = "in_doubt"
    """Claimed and maybe delivered; the claim is kept, so no replay produces it again
    until it goes stale."""


def before_claim(
    item: Mapping[str, Any], *, replay_id: str, now_ms: int, take_over_stale: bool
) -> tuple[Outcome, str] | None:
    """None when a replay should try to claim `item` (a scanned item); else why not."""
    status = item["status"]["S"]
    if status != STATUS_PENDING:
        return Outcome.SKIPPED, f"status is {status}"
    claimant = item.get(CLAIM_ATTR, {}).get("S")
    if claimant is None:
        return None
    until = int(item.get(CLAIM_UNTIL_ATTR, {}).get("N", "0"))
    if take_over_stale and claimant != replay_id and until < now_ms:
        return None
    return (
        Outcome.IN_DOUBT,
        f"claimed by replay {claimant} until {format_iso_ms(until)}: it may be in Kafka already",
    )


# --- replay headers ---------------------------------------------------------------------


def new_replay_id() -> str:
    """A fresh id for one replay run (goes into items and headers)."""
    return uuid.uuid4().hex


def provenance_headers(dl: DeadLetter, replay_id: str) -> list[tuple[str, bytes]]:
    """The headers a replayed copy carries in addition to the original ones."""
    record = dl.record
    return [
        (REPLAY_OF_HEADER, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        (REPLAY_REASON_HEADER, dl.reason.encode("utf-8", "surrogateescape")),
        (REPLAY_ID_HEADER, replay_id.encode()),
    ]


def replay_headers(dl: DeadLetter, replay_id: str) -> list[tuple[str, bytes | None]]:
    """Original headers (order, duplicates and nulls kept), then the provenance headers."""
    return [*dl.record.headers, *provenance_headers(dl, replay_id)]


# --- the routine ------------------------------------------------------------------------


NeverWritten = Callable[[Any], bool]
"""Whether a delivery report's error proves the message was never written
(`triage_proxy.kafka.producer.never_written`)."""


WireHeaders = list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None]
"""The headers confluent_kafka's Producer.produce takes (its stub's HeadersType)."""


class Producer(Protocol):
    """The part of confluent_kafka.Producer that replay uses (keyword-only here: the real
    one takes more, in another order)."""

    def produce(
        self,
        topic: str,
        *,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int = -1,
        on_delivery: Callable[..., Any] | None = None,
        headers: WireHeaders | None = None,
    ) -> None: ...

    def poll(self, timeout: float) -> int: ...

    def flush(self, timeout: float) -> int: ...

    def purge(
        self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True
    ) -> None: ...


@dataclass
class ReplayResult:
    """What replaying did, item by item (see `Outcome`)."""

    replayed: list[DeadLetterKey] = field(default_factory=list)
    """Produced, confirmed by the broker and marked `replayed`."""
    skipped: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Not produced: no longer pending, or claimed by another run in the meantime."""
    failed: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Not delivered, pending again for a rerun (see `why`)."""
    in_doubt: list[tuple[DeadLetterKey, str]] = field(default_factory=list)
    """Maybe delivered; still claimed (see `why`)."""
    interrupted: bool = False
    """True when `stop` ended the run before every selected item was tried."""

    def add(self, outcome: Outcome, key: DeadLetterKey, why: str = "") -> None:
        if outcome is Outcome.REPLAYED:
            self.replayed.append(key)
        else:
            getattr(self, outcome.value).append((key, why))

    def merge(self, other: ReplayResult) -> None:
        self.replayed.extend(other.replayed)
        self.skipped.extend(other.skipped)
        self.failed.extend(other.failed)
        self.in_doubt.extend(other.in_doubt)
        self.interrupted = self.interrupted or other.interrupted


class _State(enum.Enum):
    CLAIMED = "claimed"
    """Claimed (or maybe claimed: the call failed) and not handed to the producer."""
    UNREADABLE = "unreadable"
    """Claimed, but its payload cannot be read (e.g. the S3 object is gone): released."""
    LOST = "lost"
    """The claim was refused: not pending any more, or another replay holds it."""
    SENT = "sent"
    """Handed to the producer, no delivery report yet."""
    DELIVERED = "delivered"
    NOT_SENT = "not-sent"
    """The delivery report says it certainly never reached the broker."""
    MAYBE = "maybe"
    """The delivery failed in a way that may still have written it."""


@dataclass(slots=True)
class _Copy:
    """One item on its way through a chunk."""

    item: Mapping[str, Any]
    key: DeadLetterKey
    state: _State = _State.CLAIMED
    dl: DeadLetter | None = None
    """Loaded once claimed (from S3 when the payload is there)."""
    replayed_to: str = ""
    why: str = ""

    def on_delivery(self, never_written: NeverWritten, err: Any, msg: Any) -> None:
        """The producer's delivery report (on the thread that polls or flushes)."""
        if err is None:
            self.state = _State.DELIVERED
            self.replayed_to = f"{msg.topic()}/{msg.partition()}/{msg.offset()}"
            return
        self.why = str(err)
        self.state = _State.NOT_SENT if never_written(err) else _State.MAYBE


class _NotTried:
    """The outcome of a call skipped because an earlier one in its batch raised."""


_NOT_TRIED = _NotTried()


class Replayer:
    """Replays chunks of scanned items through one producer (see the module docstring).

    `never_written` reads `producer`'s failed delivery reports (which release a claim).
    `pool` runs the conditional writes of a chunk in parallel (Spark); without one they
    run one after the other (the CLI). `flush_timeout_s` bounds the wait for a chunk's
    delivery reports; `now_ms` is the wall clock that judges claims stale.
    """

    def __init__(
        self,
        table: DeadLetterTable,
        producer: Producer,
        replay_id: str,
        *,
        never_written: NeverWritten,
        to_topic: str | None = None,
        lease_s: float = DEFAULT_CLAIM_LEASE_S,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
        take_over_stale: bool = True,
        pool: Executor | None = None,
        now_ms: Callable[[], int] | None = None,
    ) -> None:
        self.table = table
        self.producer = producer
        self.replay_id = replay_id
        self._never_written = never_written
        self._to_topic = to_topic
        self._lease_s = lease_s
        self._flush_timeout_s = flush_timeout_s
        self._take_over_stale = take_over_stale
        self._pool = pool
        self._now_ms = now_ms or _wall_ms

    def check(self, item: Mapping[str, Any]) -> tuple[Outcome, str] | None:
        """`before_claim` with this replay's id, clock and stale-claim policy."""
        return before_claim(
            item,
            replay_id=self.replay_id,
            now_ms=self._now_ms(),
            take_over_stale=self._take_over_stale,
        )

    def replay_chunk(self, items: Sequence[Mapping[str, Any]], result: ReplayResult) -> None:
        """Replay `items` (scanned, low-level) and add what happened to each to `result`.

        Whatever raises midway (the table, S3 or the producer) is re-raised only after
        the chunk was settled: delivered items marked, unsent ones released.
        """
        copies: list[_Copy] = []
        for item in items:
            key = item_key(item)
            refused = self.check(item)
            if refused is None:
                copies.append(_Copy(item, key))
            else:
                result.add(refused[0], key, refused[1])
        claimed: list[_Copy] = []
        error: BaseException | None = None
        for copy, outcome in zip(copies, self._each(self._claim, copies, stop=True), strict=True):
            if isinstance(outcome, _NotTried):
                result.add(Outcome.FAILED, copy.key, "not claimed: the table stopped answering")
            elif isinstance(outcome, BaseException):
                error = error or outcome  # the claim may or may not have landed
                copy.state = _State.CLAIMED
                claimed.append(copy)
            elif copy.state is _State.LOST:
                result.add(Outcome.SKIPPED, copy.key, "not pending now, or another replay holds it")
            elif copy.state is _State.UNREADABLE:
                result.add(Outcome.FAILED, copy.key, f"payload unreadable: {copy.why}")
            else:
                claimed.append(copy)
        try:
            if error is not None:
                raise error
            self._produce(claimed)
        finally:
            self._settle(claimed, result)

    def _claim(self, copy: _Copy) -> None:
        if not self.table.claim(copy.key, self.replay_id, lease_s=self._lease_s):
            copy.state = _State.LOST
            return
        try:
            copy.dl = self.table.load(copy.item)
        except ValueError as exc:
            logger.warning("the payload of %s/%d/%d is unreadable; released", *copy.key)
            copy.why = str(exc)
            self.table.release(copy.key, self.replay_id)
            copy.state = _State.UNREADABLE

    def _produce(self, claimed: Sequence[_Copy]) -> None:
        producer = self.producer
        for copy in claimed:
            assert copy.dl is not None
            record = copy.dl.record
            topic = self._to_topic or record.topic
            kwargs: dict[str, Any] = {
                "key": record.key,
                "value": record.value,
                "headers": replay_headers(copy.dl, self.replay_id),
                "on_delivery": functools.partial(copy.on_delivery, self._never_written),
            }
            if topic == record.topic:  # back where it came from: same partition
                kwargs["partition"] = record.partition
            while True:
                try:
                    producer.produce(topic, **kwargs)
                    break
                except BufferError:  # the local queue is full: serve reports, try again
                    producer.poll(0.05)
            copy.state = _State.SENT
        producer.poll(0)

    def _settle(self, claimed: Sequence[_Copy], result: ReplayResult) -> None:
        """Mark what was delivered, release what was certainly not sent, keep the rest."""
        producer = self.producer
        if any(c.state is _State.SENT for c in claimed) and producer.flush(self._flush_timeout_s):
            producer.purge(in_queue=True, in_flight=False)  # still queued: never sent
            producer.flush(PURGED_FLUSH_S)
        delivered = [c for c in claimed if c.state is _State.DELIVERED]
        unsent = [c for c in claimed if c.state in (_State.CLAIMED, _State.NOT_SENT)]
        for copy in claimed:
            if copy.state is _State.SENT:
                result.add(Outcome.IN_DOUBT, copy.key, "delivery not confirmed; claim kept")
            elif copy.state is _State.MAYBE:
                result.add(Outcome.IN_DOUBT, copy.key, f"{copy.why}: may be delivered; claim kept")
        for copy, outcome in zip(delivered, self._each(self._mark, delivered), strict=True):
            if outcome is True:
                result.add(Outcome.REPLAYED, copy.key)
            elif outcome is False:
                logger.warning(
                    "%s/%d/%d was replayed but its claim was taken over; not marked", *copy.key
                )
                result.add(Outcome.REPLAYED, copy.key)
            else:  # in Kafka, still claimed: no replay produces it again before the lease
                result.add(
                    Outcome.IN_DOUBT,
                    copy.key,
                    f"delivered to {copy.replayed_to} but not marked: {outcome}",
                )
        for copy, outcome in zip(unsent, self._each(self._release, unsent), strict=True):
            if outcome is True:
                why = f"not delivered: {copy.why}" if copy.why else "not produced: stopped first"
                result.add(Outcome.FAILED, copy.key, why)
            elif outcome is False:  # the claim never landed, or another run took it over
                result.add(Outcome.SKIPPED, copy.key, "claim lost before it was released")
            else:
                result.add(Outcome.IN_DOUBT, copy.key, f"claim not released: {outcome}")

    def _mark(self, copy: _Copy) -> bool:
        return self.table.mark_replayed(copy.key, self.replay_id, copy.replayed_to, copy.item)

    def _release(self, copy: _Copy) -> bool:
        return self.table.release(copy.key, self.replay_id)

    def _each(self, fn: Callable[[T], Any], items: Sequence[T], *, stop: bool = False) -> list[Any]:
        """fn over items (on the pool if there is one); each outcome is its result or its
        exception. With `stop`, calls not yet started after one raised are not made
        (their outcome is _NOT_TRIED)."""
        outcomes: list[Any] = []
        failed = False
        if self._pool is None:
            for item in items:
                if failed and stop:
                    outcomes.append(_NOT_TRIED)
                    continue
                try:
                    outcomes.append(fn(item))
                except Exception as exc:  # noqa: BLE001 - an outcome, handled by the caller
                    outcomes.append(exc)
                    failed = True
            return outcomes
        futures = [self._pool.submit(fn, item) for item in items]
        for future in futures:
            if failed and stop and future.cancel():
                outcomes.append(_NOT_TRIED)
                continue
            raised = future.exception()
            outcomes.append(raised if raised is not None else future.result())
            failed = failed or raised is not None
        return outcomes


def _as_scanned(chunk: list[Any], result: ReplayResult) -> list[Any]:
    """`replay`'s default `read`: the items are scanned items already."""
    return chunk


def replay(
    table: DeadLetterTable,
    producer: Producer,
    items: Iterable[T],
    *,
    replay_id: str,
    never_written: NeverWritten,
    to_topic: str | None = None,
    chunk: int = DEFAULT_REPLAY_CHUNK,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
    lease_s: float = DEFAULT_CLAIM_LEASE_S,
    stop: threading.Event | None = None,
    read: Callable[[list[T], ReplayResult], Sequence[Mapping[str, Any]]] = _as_scanned,
    settled: Callable[[list[T]], None] | None = None,
    hold: contextlib.AbstractContextManager[Any] | None = None,
    result: ReplayResult | None = None,
) -> ReplayResult:
    """Replay `items` (e.g. from `table.scan(..., consistent=True)`) chunk by chunk, one
    chunk at a time in this thread (`triage dlq replay` through `bulk.replay_matching`,
    the console); stale claims of dead runs are taken over. `stop` is checked between
    chunks. Raises DeadLetterUnavailable if the table stops answering (the chunk in hand
    is settled first). `never_written` is `Replayer`'s.

    `read(chunk, result)` turns a chunk of `items` into the scanned items to replay (by
    default they are those): `bulk.replay_matching` hands keys and reads them afresh,
    adding to `result` what it no longer finds. `settled(chunk)` is called after each
    chunk is settled.

    `hold` (e.g. a lock) is held while each chunk is read, claimed, produced and settled,
    and released between chunks (the console serializes its own changes with it).
    `result` is the result to add to (returned; a new one by default): a caller that
    reports progress from `settled` reads the outcomes so far from it.
    """
    replayer = Replayer(
        table,
        producer,
        replay_id,
        never_written=never_written,
        to_topic=to_topic,
        lease_s=lease_s,
        flush_timeout_s=flush_timeout_s,
        now_ms=table.now_ms,
    )
    result = ReplayResult() if result is None else result
    iterator = iter(items)
    while True:
        if stop is not None and stop.is_set():
            result.interrupted = next(iterator, None) is not None
            return result
        batch = list(itertools.islice(iterator, chunk))
        if not batch:
            return result
        with hold if hold is not None else contextlib.nullcontext():
            replayer.replay_chunk(read(batch, result), result)
        if settled is not None:
            settled(batch)


def _wall_ms() -> int:
    return int(time.time() * 1000)
