"""Fleet mode: which partitions this process serves, decided by Kafka's consumer-group
protocol.

Why the group protocol: the proxies of a deployment already commit with one group id;
joining that group as members lets Kafka's group coordinator split the topic's
partitions among the live processes and move them when one joins or leaves, and
`kafka-consumer-groups --describe` (AdminClient `describe_consumer_groups`) shows the
split. No hand-made scheme, no election of our own.

`Assignment` is a member that never consumes: a confluent-kafka Consumer subscribes to
the topic with `kafka.group_id` and the EAGER `roundrobin` strategy, takes each
assignment with assign() + pause() (so no record is ever fetched here) and is polled by
one thread of its own to keep the session and to run the rebalance callbacks. Eager,
because on Tansu 0.6 `cooperative-sticky` never assigned revoked partitions, and because
the callbacks below are the eager protocol's: on_assign hands over the whole assignment
and takes it with assign(), and a revoke takes every partition. Under a cooperative
strategy librdkafka refuses assign() in the callback (changes must then be made with
incremental_assign()). So the strategy is the proxy's own: `[kafka.client]` cannot set
`partition.assignment.strategy` (the loader refuses it, `RESERVED_CLIENT_PROPERTIES` in
config/validation.py); of the group's properties it may set `session.timeout.ms`.

The callbacks only record what happened; the proxy reads `target()` (app.py `_follow`):

    assigned   the partitions the coordinator gave this member, now
    revoked    eager: every partition is revoked at every rebalance, and most come back
               in the next assignment a few seconds later. So a revoked partition keeps
               being served until that assignment says where it goes (`serving_target`,
               a pure policy); only the ones assigned elsewhere then drain, commit and
               release their lease. If no assignment follows within REASSIGN_GRACE_S,
               every revoked partition drains.
    lost       the session is gone (the coordinator unreachable for the session timeout,
               or this member was fenced): every partition drains now, and the lease
               lapses if the drain cannot even reach DynamoDB; the process never serves
               a partition it may no longer own.

The fence stays the partition's DynamoDB lease (ownership.py): a newly assigned
partition starts serving only once its previous holder released the lease (or it
lapsed), so two processes never deliver one partition at once, even around a
rebalance or a member that lost its session but not its network.

Commits. A group with live members refuses offset commits from a client that is not a
member of its current generation (Kafka and Tansu 0.6 both answer UNKNOWN_MEMBER_ID),
so in fleet mode the pipelines commit through this member (`MemberCommits`): the commit
runs on the membership's own thread, between two polls. Their fetch consumers use
assign() with the same group id only to read the committed offsets.

confluent-kafka exceptions become BrokerUnavailable (or ConfigError for a topic the
broker does not have) here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from confluent_kafka import Consumer, TopicPartition

from triage_proxy.config.sections import KafkaSettings
from triage_proxy.errors import BrokerUnavailable, ConfigError
from triage_proxy.kafka.client import PartitionLog, count_partitions
from triage_proxy.kafka.errors import admin_answer, describe, kafka_errors, kafka_warnings
from triage_proxy.kafka.groups import admin_client
from triage_proxy.kafka.jobs import ThreadJobs
from triage_proxy.structs import Record

logger = logging.getLogger(__name__)
T = TypeVar("T")

STRATEGY = "roundrobin"
"""Eager (see the module docstring); `range` works too."""
SESSION_TIMEOUT_MS = 6000
"""How long the coordinator waits for a silent member (a SIGKILLed process) before it
moves its partitions: short, so a dead process's partitions move within ~10 s. The
broker's group.min.session.timeout.ms is 6 s by default."""
HEARTBEAT_MS = 1000
POLL_S = 0.01
"""Longest a commit waits for the membership thread between two polls, and again for its
answer (on_commit runs in a poll): a member's commit takes up to twice this plus the
broker's round trip. 10 ms: 100 idle polls a second cost the process ~0.2% of a core,
and at 50 ms a fleet's commits trailed its last ack by ~130 ms against 50 pinned."""
COORDINATOR_TIMEOUT_S = 10.0
"""How long the start waits for the group coordinator to answer."""
CALL_TIMEOUT_S = 10.0
"""Longest a commit or a metadata read through the membership may take."""
REASSIGN_GRACE_S = 15.0
"""How long revoked partitions are still served while the next assignment is awaited."""


def serving_target(
    assigned: frozenset[int], revoked_at: float | None, now: float, grace_s: float
) -> frozenset[int]:
    """The partitions to serve now (pure): what is assigned; after a revoke, still those
    until `grace_s` passed without a new assignment, then none."""
    if revoked_at is not None and now - revoked_at >= grace_s:
        return frozenset()
    return assigned


class Membership(Protocol):
    """What the proxy needs from its group membership (a twin in unit tests)."""

    joined: bool
    """An assignment was received since start (even an empty one)."""
    member: bool
    """It holds the coordinator's current assignment: set by each assignment, cleared
    when the session is lost until the next one (what a fleet process's /readyz needs:
    an empty assignment is a member with nothing to do, a lost session is not)."""
    changed: asyncio.Event
    """Set whenever `target()` may have changed; the reader clears it."""

    def target(self) -> frozenset[int]:
        """The partitions this process should serve now."""
        ...

    def next_decision_in(self) -> float | None:
        """Seconds until `target()` changes by itself (a revoke's grace), or None."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def partition_count(self) -> int:
        """The topic's partition count from the broker (Topology)."""
        ...

    def commit(self, partition: int, offset: int, metadata: str | None) -> None:
        """Commit as a member of the group (sync; called from a pipeline's commit thread)."""
        ...


class Assignment:
    """A member of the deployment's consumer group that never consumes (see above)."""

    def __init__(
        self,
        settings: KafkaSettings,
        member: str,
        *,
        grace_s: float = REASSIGN_GRACE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._member = member
        """This process's id, sent as the client id (describe shows it)."""
        self._grace_s = grace_s
        self._monotonic = monotonic
        self.joined = False
        self.member = False
        self.changed = asyncio.Event()
        self.assigned: frozenset[int] = frozenset()
        """What the coordinator gave this member last (emptied when the session is lost)."""
        self.rebalances = 0
        """Assignments received so far."""
        self._revoked_at: float | None = None
        self._consumer: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._jobs = ThreadJobs()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commits: dict[tuple[int, int], list[concurrent.futures.Future[None]]] = {}
        """Commits sent and not answered yet, by (partition, offset): on_commit answers
        them (on the membership thread, like every use of this dict)."""

    # --- what the proxy reads ------------------------------------------------------------

    def target(self) -> frozenset[int]:
        return serving_target(self.assigned, self._revoked_at, self._monotonic(), self._grace_s)

    def next_decision_in(self) -> float | None:
        if self._revoked_at is None:
            return None
        return max(0.0, self._revoked_at + self._grace_s - self._monotonic()) + 0.01

    # --- lifecycle -------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        own: dict[str, Any] = {
            "group.id": self._settings.group_id,
            "client.id": f"triage-proxy-{self._member}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "partition.assignment.strategy": STRATEGY,
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": HEARTBEAT_MS,
            "error_cb": _on_error,
            "on_commit": self._on_commit,
            "logger": logger,
        }
        # [kafka.client] may set the session timeout (a longer one rides out a slow
        # network, a kill moves partitions later) and the heartbeat that goes with it, and
        # name the client: its client.id prefixes the member id, which tells the fleet's
        # processes apart in the group. The rest is ours, the strategy above all: the
        # callbacks follow the eager protocol (see the module docstring).
        client = self._settings.librdkafka_config()
        for name in ("session.timeout.ms", "heartbeat.interval.ms"):
            if name in client:
                own[name] = client.pop(name)
        if "client.id" in client:
            own["client.id"] = f"{client.pop('client.id')}-{self._member}"
        return {**client, **own}

    async def start(self) -> None:
        """Check the group coordinator answers (BrokerUnavailable: the process exits 3 with
        the reason) and that the topic exists (ConfigError), then join the group."""
        if self._thread is not None:
            from triage_proxy.errors import StateError

            raise StateError("membership already started")
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(check_group, self._settings)
        with kafka_errors(f"joining group {self._settings.group_id!r}"):
            consumer = Consumer(self._config())
            try:
                consumer.subscribe(
                    [self._settings.topic],
                    on_assign=self._on_assign,
                    on_revoke=self._on_revoke,
                    on_lost=self._on_lost,
                )
            except BaseException:
                consumer.close()  # its threads and broker connections, not left to the GC
                raise
        self._consumer = consumer
        self._thread = threading.Thread(target=self._poll, name="membership", daemon=True)
        self._thread.start()
        logger.info(
            "joining group %r of topic %s as %s (%s)",
            self._settings.group_id,
            self._settings.topic,
            self._member,
            STRATEGY,
        )

    async def stop(self) -> None:
        """Leave the group (the coordinator moves the partitions at once); safe twice."""
        thread = self._thread
        if thread is None or self._stopping.is_set():
            return
        self._stopping.set()
        await asyncio.to_thread(thread.join)
        logger.info("left group %r", self._settings.group_id)

    # --- the membership thread -------------------------------------------------------------

    def _poll(self) -> None:
        consumer = self._consumer
        while not self._stopping.is_set():
            message = None
            with kafka_warnings("group membership", log=logger):
                message = consumer.poll(POLL_S)
            if message is not None and message.error() is not None:
                logger.warning("group membership: %s", describe(message.error()))
            self._jobs.run()
        self._jobs.run()
        with kafka_warnings("leaving the group", log=logger):
            consumer.close()  # leaves the group
        for waiters in self._commits.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(BrokerUnavailable("the group membership has stopped"))
        self._commits.clear()
        self._jobs.refuse("the group membership has stopped")  # what came after the close

    def _call(self, job: Callable[[], T]) -> T:
        """Run `job` on the membership thread (the consumer's only thread) and wait."""
        if self._thread is None or self._stopping.is_set():
            raise BrokerUnavailable("the group membership is not running")
        future = self._jobs.submit(job)
        try:
            return future.result(CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BrokerUnavailable("the group membership did not answer in time") from None

    def _post(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(fn)

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        consumer.assign(partitions)
        consumer.pause(partitions)  # membership only: no record is ever fetched here
        got = frozenset(tp.partition for tp in partitions)
        self._post(lambda: self._assigned(got))

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._post(self._revoked)

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._post(self._lost)

    # --- on the event loop ----------------------------------------------------------------

    def _assigned(self, partitions: frozenset[int]) -> None:
        self.assigned = partitions
        self._revoked_at = None
        self.joined = self.member = True
        self.rebalances += 1
        self.changed.set()
        logger.info("group assigned partitions %s here", sorted(partitions))

    def _revoked(self) -> None:
        if self._revoked_at is None:
            self._revoked_at = self._monotonic()
        self.changed.set()
        logger.info("group rebalancing: serving on until the next assignment")

    def _lost(self) -> None:
        self.assigned = frozenset()
        self.member = False
        self._revoked_at = None
        self.changed.set()
        logger.warning("group session lost: every partition drains now")

    # --- calls through the member -----------------------------------------------------------

    async def partition_count(self) -> int:
        topic = self._settings.topic

        def ask() -> int:
            return count_partitions(self._consumer, topic, timeout=1.0)

        return await asyncio.to_thread(self._call, ask)

    def commit(self, partition: int, offset: int, metadata: str | None) -> None:
        """Commit as a member, asynchronously on the membership thread, and wait for the
        answer (on_commit) up to CALL_TIMEOUT_S.

        Why asynchronously: a synchronous commit blocks the membership thread until the
        coordinator answers, and that thread must keep polling: a session that times out
        (the coordinator unreachable) is reported by the `on_lost` callback, which only a
        poll runs. With commits blocking it, a process cut off from its coordinator went
        on serving its partitions for as long as the commits kept failing."""
        topic = self._settings.topic
        tp = TopicPartition(topic, partition, offset)
        if metadata is not None:  # confluent-kafka refuses metadata=None
            tp = TopicPartition(topic, partition, offset, metadata=metadata)
        answer: concurrent.futures.Future[None] = concurrent.futures.Future()

        def send() -> None:
            for key, waiters in list(self._commits.items()):  # forget the ones given up on
                if all(w.done() for w in waiters):
                    del self._commits[key]
            with kafka_errors(f"commit of offset {offset} failed"):
                self._consumer.commit(offsets=[tp], asynchronous=True)
            self._commits.setdefault((partition, offset), []).append(answer)

        self._call(send)
        try:
            answer.result(CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            answer.cancel()
            raise BrokerUnavailable(
                f"commit of offset {offset}: the group coordinator did not answer in time"
            ) from None

    def _on_commit(self, err: Any, partitions: list[TopicPartition] | None) -> None:
        """librdkafka's answer to commits (on the membership thread, from a poll)."""
        for tp in partitions or []:
            waiters = self._commits.pop((tp.partition, tp.offset), [])
            error = err or tp.error
            for waiter in waiters:
                if waiter.done():
                    continue
                if error is not None:
                    waiter.set_exception(
                        BrokerUnavailable(f"commit of offset {tp.offset} failed: {describe(error)}")
                    )
                else:
                    waiter.set_result(None)


def _on_error(err: Any) -> None:
    logger.warning("kafka (group membership): %s", describe(err))


def check_group(settings: KafkaSettings) -> None:
    """Raise BrokerUnavailable unless the group coordinator answers, ConfigError unless
    the topic exists (what a fleet process checks before it joins)."""
    admin = admin_client(settings)
    group = settings.group_id
    what = f"cannot reach the group coordinator of group {group!r} ({settings.bootstrap_servers})"
    with kafka_errors(what):
        futures = admin.describe_consumer_groups([group], request_timeout=COORDINATOR_TIMEOUT_S)
    admin_answer(futures[group], what, COORDINATOR_TIMEOUT_S + 1)
    topic_partitions(settings, admin)


def topic_partitions(settings: KafkaSettings, admin: Any = None) -> int:
    """The topic's partition count: `kafka.partitions` when set, else the broker's
    metadata (BrokerUnavailable: no answer; ConfigError: no such topic)."""
    if settings.partitions is not None:
        return settings.partitions
    admin = admin_client(settings, admin)
    topic = settings.topic
    with kafka_errors(f"reading the metadata of {topic} ({settings.bootstrap_servers})"):
        meta = admin.list_topics(topic, timeout=COORDINATOR_TIMEOUT_S)
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise ConfigError("kafka.topic", f"the broker has no topic {topic!r}")
    return len(found.partitions)


class MemberCommits:
    """A partition's log whose commits go through the group member (see the module
    docstring); everything else is the wrapped log's."""

    def __init__(self, log: PartitionLog, membership: Membership, partition: int) -> None:
        self._log = log
        self._membership = membership
        self._partition = partition

    def open(self) -> tuple[int, str | None]:
        return self._log.open()

    def fetch(self, max_records: int) -> list[Record]:
        return self._log.fetch(max_records)

    def commit(self, offset: int, metadata: str | None = None) -> None:
        self._membership.commit(self._partition, offset, metadata)

    def log_end(self) -> int:
        return self._log.log_end()

    def partition_count(self) -> int:
        return self._log.partition_count()

    def close(self) -> None:
        self._log.close()
