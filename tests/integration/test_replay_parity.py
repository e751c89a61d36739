"""`triage dlq replay` and the Spark segment job replay the same way, fault for fault.

Both paths run over their own copy of the same dead letters (one source topic each, one
table, real Tansu and moto), each with the same fault injected through a wrapper around
its real producer, and must leave identical item states (status, claim, replay count,
`replayed_to` = "<topic>/<partition>/<offset>") and report identical counts:

- the broker goes away mid-batch: what was delivered is marked, the rest (timed out,
  maybe written) stays claimed, in doubt;
- a produce reports an error librdkafka does not name as "not sent": the claim is kept
  (the copy is in fact in Kafka), and a rerun leaves it alone;
- the process dies between a confirmed delivery and the mark (in a child process): the
  marked chunk stays replayed, the delivered chunk stays claimed, the rest untouched;

and with `--to-topic`, a key lands on the same partition from either path (the Java
client's, `kafka.producer.replay_producer_config`).

The CLI side is `store.replay.replay` with `triage dlq replay`'s producer configuration
(`triage_cli.dlq.broker.producer_config`); the Spark side is `SegmentReplayer` run in this
process (no Spark needed to run one segment), which configures its own producer.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from confluent_kafka import KafkaError, Producer

from tests.integration.harness import create_topic
from tests.samples import GROUP
from triage_cli.dlq.broker import producer_config
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.kafka.producer import never_written
from triage_proxy.store.deadletter_store import MAX_BATCH, DynamoDBStore
from triage_proxy.store.provisioning import create_table
from triage_proxy.store.query import DeadLetterTable, Filters
from triage_proxy.store.replay import REPLAY_OF_HEADER, new_replay_id, replay
from triage_proxy.structs import DeadLetter, Record
from triage_replay.options import ReplayOptions
from triage_replay.segment import SegmentJob, SegmentReplayer

if TYPE_CHECKING:
    from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker

pytestmark = pytest.mark.integration

ITEMS = 10
CHUNK = 4
PATHS = ("cli", "spark")
CRASH_EXIT_CODE = 70
DEAD_TIMEOUT_MS = 2000
"""message.timeout.ms of the producer whose broker is gone."""

Counts = tuple[int, int, int, int]
"""(replayed, skipped, failed, in_doubt) as a path reports them."""
State = tuple[str, bool, str | None, bool]
"""Per offset: status, claimed, replay_count, replayed_to names a copy in the topic."""
MakeProducer = Callable[[dict[str, Any]], Any]


# --- producers with faults ------------------------------------------------------------


class Passthrough:
    """A real producer, as the replay Producer protocol sees it."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def produce(self, topic: str, **kwargs: Any) -> None:
        self.real.produce(topic, **kwargs)

    def poll(self, timeout: float) -> int:
        return int(self.real.poll(timeout))

    def flush(self, timeout: float) -> int:
        return int(self.real.flush(timeout))

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self.real.purge(in_queue=in_queue, in_flight=in_flight, blocking=blocking)


class BrokerGoneAfter(Passthrough):
    """The first `after` messages reach the broker; then it is gone (nothing listens),
    so every later message times out in librdkafka's queue: maybe written, as far as
    librdkafka can tell."""

    def __init__(self, real: Any, after: int) -> None:
        super().__init__(real)
        self.after = after
        self.sent = 0
        self.dead = Producer(
            {
                "bootstrap.servers": f"127.0.0.1:{_closed_port()}",
                "message.timeout.ms": DEAD_TIMEOUT_MS,
                "logger": _quiet_logger(),
            }
        )

    def produce(self, topic: str, **kwargs: Any) -> None:
        (self.real if self.sent < self.after else self.dead).produce(topic, **kwargs)
        self.sent += 1

    def poll(self, timeout: float) -> int:
        return int(self.real.poll(timeout)) + int(self.dead.poll(0))

    def flush(self, timeout: float) -> int:
        return int(self.real.flush(timeout)) + int(self.dead.flush(timeout))

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        super().purge(in_queue, in_flight, blocking)
        self.dead.purge(in_queue=in_queue, in_flight=in_flight, blocking=blocking)


class UnknownErrorFor(Passthrough):
    """Produces everything for real, but reports the copies of `offsets` as failed with
    an error librdkafka does not name as "not sent" (the copy is in Kafka all the same)."""

    def __init__(self, real: Any, offsets: set[int]) -> None:
        super().__init__(real)
        self.offsets = offsets

    def produce(self, topic: str, **kwargs: Any) -> None:
        origin = dict(kwargs["headers"])[REPLAY_OF_HEADER].decode()
        if int(origin.rsplit("/", 1)[1]) in self.offsets:
            report = kwargs["on_delivery"]

            def unknown(err: Any, msg: Any) -> None:
                report(err or KafkaError(KafkaError.UNKNOWN), msg)

            kwargs["on_delivery"] = unknown
        self.real.produce(topic, **kwargs)


class CrashAtFlush(Passthrough):
    """Dies (os._exit) right after the `nth` flush confirmed its chunk: delivered, and
    not yet marked."""

    def __init__(self, real: Any, nth: int) -> None:
        super().__init__(real)
        self.nth = nth
        self.flushes = 0

    def flush(self, timeout: float) -> int:
        left = int(self.real.flush(timeout))
        self.flushes += 1
        if self.flushes == self.nth:
            os._exit(CRASH_EXIT_CODE)
        return left


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quiet_logger() -> logging.Logger:
    log = logging.getLogger("tests.replay_parity.kafka")
    log.setLevel(logging.CRITICAL)
    return log


def fault(name: str) -> Callable[[Any], Any]:
    """Wrap a real producer with the named fault."""
    if name == "broker-gone":
        return lambda real: BrokerGoneAfter(real, after=6)
    if name == "unknown-error":
        return lambda real: UnknownErrorFor(real, offsets={2, 6})
    if name == "crash":
        return lambda real: CrashAtFlush(real, nth=2)
    return Passthrough


# --- the two paths --------------------------------------------------------------------


def cli_producer_config(bootstrap: str) -> dict[str, Any]:
    """What `triage dlq replay` configures, for a config naming `bootstrap`."""
    raw = {
        "kafka": {"bootstrap_servers": bootstrap, "topic": "t", "group_id": GROUP},
        "auth": {"token": "parity-test-token-0123"},
        "dead_letters": {"table": "unused"},
    }
    return producer_config(settings_from_dict(raw, {}, fetch_secret=no_secrets))


def no_secrets(key: str, name: str) -> str:
    raise AssertionError(f"{key} references secret {name}: not in these tests")


def run_path(
    path: str,
    settings: DeadLetterSettings,
    bootstrap: str,
    topic: str,
    wrap: Callable[[Any], Any],
    to_topic: str | None = None,
    chunk: int = CHUNK,
    configs: list[dict[str, Any]] | None = None,
) -> Counts:
    """Replay every dead letter of `topic` the way `path` does, through `wrap`'s producer
    (to `to_topic` when given); the producer configuration `path` builds is appended to
    `configs` when given."""

    def make_producer(config: dict[str, Any]) -> Any:
        if configs is not None:
            configs.append(config)
        return wrap(Producer(config))

    if path == "cli":
        with DeadLetterTable(settings, group=GROUP) as table:
            items = sorted(
                table.scan(Filters(topic=topic), consistent=True),
                key=lambda i: int(i["offset"]["N"]),
            )
            result = replay(
                table,
                make_producer(cli_producer_config(bootstrap)),
                items,
                replay_id=new_replay_id(),
                never_written=never_written,
                to_topic=to_topic,
                chunk=chunk,
            )
        return (len(result.replayed), len(result.skipped), len(result.failed), len(result.in_doubt))
    options = ReplayOptions(
        settings,
        bootstrap=bootstrap,
        filters=Filters(topic=topic),
        chunk_size=chunk,
        group=GROUP,
        to_topic=to_topic,
    )
    job = SegmentJob(options, total_segments=1, replay_id=new_replay_id())
    counts = SegmentReplayer(job, 0, make_producer=make_producer).run()
    assert counts.error is None, counts.error
    return (counts.replayed, counts.skipped, counts.failed, counts.in_doubt)


def crash_child(path: str, settings: DeadLetterSettings, bootstrap: str, topic: str) -> None:
    """Runs in a spawned child: replay with the crash fault (the child never returns)."""
    run_path(path, settings, bootstrap, topic, fault("crash"))


def run_crashing(path: str, settings: DeadLetterSettings, bootstrap: str, topic: str) -> None:
    child = multiprocessing.get_context("spawn").Process(
        target=crash_child, args=(path, settings, bootstrap, topic)
    )
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == CRASH_EXIT_CODE, f"{path}: exit code {child.exitcode}"


# --- setup and states -----------------------------------------------------------------


@pytest.fixture
def settings(aws: EmbeddedAWS, unique_name: str) -> DeadLetterSettings:
    made = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(made)
    return made


def dead_letters(
    settings: DeadLetterSettings, bootstrap: str, topic: str, items: int = ITEMS
) -> None:
    """A fresh one-partition topic and `items` pending dead letters from it (key k<offset>)."""
    create_topic(bootstrap, topic)
    dls = [
        DeadLetter(
            Record(topic, 0, o, b"k%d" % o, b"v%d" % o, (("h", b"x"),), 1000 + o),
            "bad",
            3,
            "w",
            5000,
        )
        for o in range(items)
    ]
    with DynamoDBStore(settings, group=GROUP) as store:
        for start in range(0, items, MAX_BATCH):
            assert store.put_batch(dls[start : start + MAX_BATCH]) == []


def states(settings: DeadLetterSettings, topic: str) -> dict[int, State]:
    """Every item of `topic`, by offset, with the topic itself left out (it differs)."""
    out: dict[int, State] = {}
    with DeadLetterTable(settings, group=GROUP) as table:
        for item in table.scan(Filters(topic=topic), consistent=True):
            replayed_to = item.get("replayed_to", {}).get("S")
            if replayed_to is not None:
                assert re.fullmatch(rf"{re.escape(topic)}/0/\d+", replayed_to), replayed_to
            out[int(item["offset"]["N"])] = (
                item["status"]["S"],
                "replay_claim" in item,
                item.get("replay_count", {}).get("N"),
                replayed_to is not None,
            )
    return out


REPLAYED: State = ("replayed", False, "1", True)
CLAIMED: State = ("pending", True, None, False)
"""Pending, claim kept: in doubt."""
PENDING: State = ("pending", False, None, False)


def both(settings: DeadLetterSettings, broker: EmbeddedBroker, unique_name: str) -> dict[str, str]:
    topics = {path: f"{unique_name}-{path}" for path in PATHS}
    for topic in topics.values():
        dead_letters(settings, broker.bootstrap, topic)
    return topics


# --- the fault cases ------------------------------------------------------------------


def test_broker_gone_mid_batch(
    settings: DeadLetterSettings, broker: EmbeddedBroker, unique_name: str
) -> None:
    topics = both(settings, broker, unique_name)
    counts = {
        path: run_path(path, settings, broker.bootstrap, topics[path], fault("broker-gone"))
        for path in PATHS
    }
    found = {path: states(settings, topics[path]) for path in PATHS}
    expected = {o: REPLAYED if o < 6 else CLAIMED for o in range(ITEMS)}
    assert found["cli"] == found["spark"] == expected
    assert counts["cli"] == counts["spark"] == (6, 0, 0, 4)


def test_unknown_produce_error_keeps_the_claim(
    settings: DeadLetterSettings, broker: EmbeddedBroker, unique_name: str
) -> None:
    topics = both(settings, broker, unique_name)
    counts = {
        path: run_path(path, settings, broker.bootstrap, topics[path], fault("unknown-error"))
        for path in PATHS
    }
    found = {path: states(settings, topics[path]) for path in PATHS}
    expected = {o: CLAIMED if o in (2, 6) else REPLAYED for o in range(ITEMS)}
    assert found["cli"] == found["spark"] == expected
    assert counts["cli"] == counts["spark"] == (8, 0, 0, 2)

    # A rerun (no fault) leaves the claimed ones alone and says so.
    reruns = {
        path: run_path(path, settings, broker.bootstrap, topics[path], fault("none"))
        for path in PATHS
    }
    assert reruns["cli"] == reruns["spark"] == (0, 8, 0, 2)
    assert {path: states(settings, topics[path]) for path in PATHS} == found


def test_crash_between_produce_and_mark(
    settings: DeadLetterSettings, broker: EmbeddedBroker, unique_name: str
) -> None:
    topics = both(settings, broker, unique_name)
    for path in PATHS:
        run_crashing(path, settings, broker.bootstrap, topics[path])
    found = {path: states(settings, topics[path]) for path in PATHS}
    expected = {
        o: REPLAYED if o < CHUNK else CLAIMED if o < 2 * CHUNK else PENDING for o in range(ITEMS)
    }
    assert found["cli"] == found["spark"] == expected


# --- partitioning ---------------------------------------------------------------------

KEYS = 1000
"""Keys produced with each path's producer configuration."""
REPLAYED_KEYS = 24
"""Dead letters each path replays end to end (DynamoDB calls are what a replay costs)."""
TARGET_PARTITIONS = 6


def java_partition(key: bytes, partitions: int) -> int:
    """The partition the Java client's default partitioner picks for `key`: murmur2 (Kafka's
    `Utils.murmur2`), made positive, modulo the partition count."""
    m, length = 0x5BD1E995, len(key)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(key[i : i + 4], "little") * m & 0xFFFFFFFF
        k = (k ^ (k >> 24)) * m & 0xFFFFFFFF
        h = (h * m & 0xFFFFFFFF) ^ k
    tail = key[whole:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h = (h ^ tail[0]) * m & 0xFFFFFFFF
    h = (h ^ (h >> 13)) * m & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def test_java_partition_matches_kafkas_own_vectors() -> None:
    """Kafka's UtilsTest.testMurmur2 values, so the check below checks against Java."""
    expected = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536}
    for key, signed in expected.items():
        assert java_partition(key, 2**31 - 1) == (signed & 0x7FFFFFFF) % (2**31 - 1)


def partitions_of(config: dict[str, Any], topic: str, keys: list[bytes]) -> dict[bytes, int]:
    """Produce each of `keys` to `topic` with a producer of `config`; the partition the
    broker acknowledged for each."""
    landed: dict[bytes, int] = {}

    def report(err: Any, msg: Any) -> None:
        assert err is None, err
        landed[msg.key()] = msg.partition()

    producer = Producer(config)
    for key in keys:
        producer.produce(topic, key=key, value=b"v", on_delivery=report)
        producer.poll(0)
    assert producer.flush(30) == 0
    return landed


def test_a_key_lands_on_one_partition_from_either_tool(
    settings: DeadLetterSettings, broker: EmbeddedBroker, unique_name: str
) -> None:
    """Each path replays a few dead letters --to-topic (a topic of several partitions) with
    the producer configuration it builds, recorded as it builds it; 1,000 keys produced with
    each recorded configuration then land, like the replayed ones, on the Java client's
    partition from both paths."""
    configs: dict[str, list[dict[str, Any]]] = {}
    replayed: dict[str, dict[int, int]] = {}
    for path in PATHS:
        source, to_topic = f"{unique_name}-{path}", f"{unique_name}-{path}-to"
        dead_letters(settings, broker.bootstrap, source, items=REPLAYED_KEYS)
        create_topic(broker.bootstrap, to_topic, partitions=TARGET_PARTITIONS)
        configs[path] = []
        counts = run_path(
            path,
            settings,
            broker.bootstrap,
            source,
            Passthrough,
            to_topic=to_topic,
            configs=configs[path],
        )
        assert counts == (REPLAYED_KEYS, 0, 0, 0), path
        with DeadLetterTable(settings, group=GROUP) as table:
            replayed[path] = {
                int(item["offset"]["N"]): int(item["replayed_to"]["S"].split("/")[1])
                for item in table.scan(Filters(topic=source), consistent=True)
            }
    java_replayed = {o: java_partition(b"k%d" % o, TARGET_PARTITIONS) for o in range(REPLAYED_KEYS)}
    assert replayed["cli"] == replayed["spark"] == java_replayed

    keys = [b"k%d" % o for o in range(KEYS)]
    landed: dict[str, dict[bytes, int]] = {}
    for path in PATHS:
        assert len(configs[path]) == 1, path
        topic = f"{unique_name}-{path}-keys"
        create_topic(broker.bootstrap, topic, partitions=TARGET_PARTITIONS)
        landed[path] = partitions_of(configs[path][0], topic, keys)
    java = {key: java_partition(key, TARGET_PARTITIONS) for key in keys}
    assert landed["cli"] == landed["spark"] == java
    assert set(java.values()) == set(range(TARGET_PARTITIONS))
