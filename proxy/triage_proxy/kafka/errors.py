"""The one place librdkafka's errors become the proxy's own.

Why: the proxy, the CLI and the replay tools all talk to Kafka through confluent-kafka,
and none of them should know its exception types or error codes (as httpx's
`map_httpcore_exceptions` keeps httpcore's inside its transport). Every call that may
raise `KafkaException` runs inside one of these:

    with kafka_errors(f"commit of offset {offset}"):        # -> BrokerUnavailable
        consumer.commit(...)

    with kafka_errors("reading the metadata", UnavailableError):   # any error type
        admin.list_topics(...)

    found = admin_answer(futures[group], "describing the group", 6.0)  # an admin call's future

    with kafka_warnings("pausing partition %d", partition):  # logged, not raised
        consumer.pause(...)

    with opening_errors(settings, topic, partition, consumer):   # what `open` raises
        consumer.assign(...)

Messages are "<what>: <librdkafka's own description>". A `KafkaError` handed back as a
value (a message's `error()`, `error_cb`, a commit callback) is read through `describe`
and `is_gone`, so no caller outside `kafka/` imports its type either.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, NoReturn, TypeVar

from confluent_kafka import KafkaError, KafkaException

from triage_proxy.config.sections import KafkaSettings
from triage_proxy.config.validation import client_key
from triage_proxy.errors import BrokerUnavailable, ConfigError, NotFoundError, TriageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

GONE_CODES = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
    }
)
"""Error codes that mean the topic or partition does not exist (any more)."""


def describe(exc: object) -> str:
    """librdkafka's own description of an error (a raised KafkaException, or a KafkaError
    value); anything else as `str`."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else exc
    return str(err.str()) if isinstance(err, KafkaError) else str(err)


def is_gone(err: Any) -> bool:
    """Whether a KafkaError value says the topic or partition does not exist (any more)."""
    return isinstance(err, KafkaError) and err.code() in GONE_CODES


class _KafkaBlock:
    """A `with` block whose KafkaException becomes our error (`translate`): the one shape
    of the translations that raise (a class, not a generator: it wraps every fetch, so
    entering it must cost little)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and isinstance(exc, KafkaException):
            self.translate(exc)

    def translate(self, exc: KafkaException) -> NoReturn:
        """Raise our error for `exc`."""
        raise NotImplementedError


class kafka_errors(_KafkaBlock):  # lower case: used as a context manager (`with`)
    """Run the block; turn a KafkaException into `error("<what>: <cause>")`, raised from it."""

    __slots__ = ("_error", "_what")

    def __init__(self, what: str, error: Callable[[str], Exception] = BrokerUnavailable) -> None:
        self._what = what
        self._error = error

    def translate(self, exc: KafkaException) -> NoReturn:
        raise self._error(f"{self._what}: {describe(exc)}") from exc


class kafka_warnings:  # lower case: used as a context manager (`with`)
    """Run the block; log a KafkaException at WARNING ("<what>: <cause>", %-style `args`)
    and carry on: for calls whose failure the next one recovers from (pause, resume,
    close, an idle poll)."""

    __slots__ = ("_args", "_log", "_what")

    def __init__(self, what: str, *args: object, log: logging.Logger | None = None) -> None:
        self._what = what
        self._args = args
        self._log = log or logger

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is not None and isinstance(exc, KafkaException):
            self._log.warning(self._what + ": %s", *self._args, describe(exc))
            return True
        return False


def admin_answer(future: concurrent.futures.Future[T], what: str, timeout_s: float) -> T:
    """The result of an AdminClient call's future: its KafkaException becomes
    BrokerUnavailable("<what>: <cause>"), as does no answer in `timeout_s`."""
    try:
        with kafka_errors(what):
            return future.result(timeout_s)
    except concurrent.futures.TimeoutError as exc:
        raise BrokerUnavailable(f"{what}: no answer in {timeout_s:g}s") from exc


def refused_property(client: Mapping[str, object], exc: BaseException) -> ConfigError:
    """A property librdkafka refused, as a ConfigError naming its `[kafka.client]` key
    (the whole table when the cause names no property of it)."""
    cause = describe(exc)
    name = cause.split('"')[1] if cause.count('"') >= 2 else ""
    key = client_key(name) if name in client else "kafka.client"
    return ConfigError(key, f"librdkafka refuses it: {cause}")


class client_config_errors(_KafkaBlock):  # lower case: used as a context manager (`with`)
    """Run the block (building a client); a KafkaException becomes the ConfigError of the
    property librdkafka refused (`refused_property`)."""

    __slots__ = ("_client",)

    def __init__(self, client: Mapping[str, object]) -> None:
        self._client = client

    def translate(self, exc: KafkaException) -> NoReturn:
        raise refused_property(self._client, exc) from None


class opening_errors(_KafkaBlock):  # lower case: used as a context manager (`with`)
    """Run the block (opening a partition); a KafkaException becomes `open_error`'s
    translation. `consumer`, when given, is asked whether the partition exists."""

    __slots__ = ("_consumer", "_partition", "_settings")

    def __init__(self, settings: KafkaSettings, partition: int, consumer: Any = None) -> None:
        self._settings = settings
        self._partition = partition
        self._consumer = consumer

    def translate(self, exc: KafkaException) -> NoReturn:
        raise open_error(self._settings, self._partition, exc, self._consumer) from exc


def open_error(
    settings: KafkaSettings, partition: int, exc: BaseException, consumer: Any
) -> TriageError:
    """What made opening a partition fail, keeping librdkafka's cause: a property librdkafka
    refuses is a ConfigError naming it; a topic or partition the broker does not have is
    NotFoundError; anything else BrokerUnavailable (the broker may come back)."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    where = f"{settings.topic}[{partition}]"
    if isinstance(err, KafkaError) and err.code() == KafkaError._INVALID_ARG:
        return refused_property(settings.client, exc)
    if consumer is not None and is_gone(err):
        missing = missing_reason(settings, partition, consumer)
        if missing is not None:
            return NotFoundError(f"cannot open {where}: {missing}")
    return BrokerUnavailable(f"opening {where}: {describe(exc)}")


METADATA_TIMEOUT_S = 1.0
"""How long `missing_reason` waits for the broker's metadata."""


def missing_reason(settings: KafkaSettings, partition: int, consumer: Any) -> str | None:
    """Why the broker's metadata has no such partition, or None if it does (or the
    metadata cannot be read)."""
    topic = settings.topic
    try:
        meta = consumer.list_topics(topic, timeout=METADATA_TIMEOUT_S)
    except KafkaException:
        return None
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        return f"topic {topic!r} does not exist on {settings.bootstrap_servers}"
    if partition not in found.partitions:
        return f"topic {topic!r} has {len(found.partitions)} partition(s), not {partition}"
    return None
