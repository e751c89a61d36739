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
  marked chunk stays replayed, the delivered chunk stays claimed, the rest untouched.

The CLI side is `table.replay.replay` (what `triage dlq replay` runs); the Spark side is
`SegmentReplayer` run in this process (no Spark needed to run one segment).
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
from triage_proxy.config.settings import DeadLetterSettings
from triage_proxy.store.deadletter_store import DynamoDBStore
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
    """What `triage dlq replay` configures (triage_cli.dlq._producer), broker aside."""
    return {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "linger.ms": 5,
        "enable.idempotence": True,
        "message.timeout.ms": 60_000,
    }


def run_path(
    path: str, settings: DeadLetterSettings, bootstrap: str, topic: str, wrap: Callable[[Any], Any]
) -> Counts:
    """Replay every dead letter of `topic` the way `path` does, through `wrap`'s producer."""
    make_producer: MakeProducer = lambda config: wrap(Producer(config))  # noqa: E731
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
                chunk=CHUNK,
            )
        return (len(result.replayed), len(result.skipped), len(result.failed), len(result.in_doubt))
    options = ReplayOptions(
        settings, bootstrap=bootstrap, filters=Filters(topic=topic), chunk_size=CHUNK, group=GROUP
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


def dead_letters(settings: DeadLetterSettings, bootstrap: str, topic: str) -> None:
    """A fresh one-partition topic and ITEMS pending dead letters from it."""
    create_topic(bootstrap, topic)
    dls = [
        DeadLetter(
            Record(topic, 0, o, b"k%d" % o, b"v%d" % o, (("h", b"x"),), 1000 + o),
            "bad",
            3,
            "w",
            5000,
        )
        for o in range(ITEMS)
    ]
    with DynamoDBStore(settings, group=GROUP) as store:
        assert store.put_batch(dls) == []


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
