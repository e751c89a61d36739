"""One frozen, validated settings object, built once at the edge from a TOML file.

Nothing below the CLI reads files or the environment: `load_settings` resolves
`token_env` and friends here and hands the proxy a complete `Settings`.

    [kafka]        bootstrap_servers, topic, group_id, fetch_batch, client (librdkafka extras)
    [server]       host, port (partition p listens on port + p), max_frame_bytes
    [auth]         token | token_env
    [dead_letters] table, region, endpoint_url, batch_size, flush_interval_ms, retry_max_s,
                   overflow_bucket, ttl_days, notify_sns_topic_arn, notify_webhook_url,
                   notify_interval_s
    [window]       max_messages, max_bytes
    [delivery]     ack_deadline_s, max_attempts, ordering ("none" | "key")
    [retry]        initial_backoff_s, max_backoff_s, multiplier
    [commit]       interval_s, encode_settled
    [shutdown]     drain_timeout_s
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triage_proxy.errors import ConfigError

DEFAULT_PORT = 7700
DEFAULT_FETCH_BATCH = 2000
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_WINDOW_MESSAGES = 10_000
DEFAULT_WINDOW_BYTES = 64 * 1024 * 1024
DEFAULT_ACK_DEADLINE_S = 30.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_COMMIT_INTERVAL_S = 1.0
DEFAULT_RETRY_INITIAL_S = 1.0
DEFAULT_RETRY_MAX_S = 60.0
DEFAULT_RETRY_MULTIPLIER = 2.0
ORDERINGS = ("none", "key")
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_DLQ_BATCH = 25  # DynamoDB BatchWriteItem takes at most 25 items
DEFAULT_DLQ_FLUSH_MS = 20
DEFAULT_DLQ_RETRY_MAX_S = 5.0
DEFAULT_REGION = "us-east-1"


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str
    """Comma-separated host:port list."""
    topic: str
    """The topic whose partitions the proxies own."""
    group_id: str
    """Consumer group under which offsets are committed."""
    fetch_batch: int = DEFAULT_FETCH_BATCH
    """Most messages taken from librdkafka per fetch."""
    client: Mapping[str, str | int | bool] = field(default_factory=dict)
    """Extra librdkafka properties (security.protocol, sasl.*), passed through."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    """Interface the gRPC listener binds."""
    port: int = DEFAULT_PORT
    """Base port: the proxy for partition p listens on port + p."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest gRPC frame either side may send; bounds one oversized message."""


@dataclass(frozen=True)
class AuthSettings:
    token: str
    """Bearer token every call must carry (resolved from token_env if given)."""


@dataclass(frozen=True)
class DeadLetterSettings:
    table: str
    """DynamoDB table that holds dead letters."""
    region: str = DEFAULT_REGION
    """AWS region of the table."""
    endpoint_url: str | None = None
    """Override for a local endpoint (moto server); None means AWS itself."""
    batch_size: int = DEFAULT_DLQ_BATCH
    """Items per BatchWriteItem call (1..25)."""
    flush_interval_ms: int = DEFAULT_DLQ_FLUSH_MS
    """How long a dead letter may wait for others to share its batch."""
    retry_max_s: float = DEFAULT_DLQ_RETRY_MAX_S
    """Cap of the exponential backoff between failed writes."""
    overflow_bucket: str | None = None
    """S3 bucket for payloads too large for a DynamoDB item (None: such items wait)."""
    ttl_days: float | None = None
    """Replayed and discarded items expire this long after (DynamoDB TTL); None keeps them."""
    notify_sns_topic_arn: str | None = None
    """SNS topic that gets aggregated dead-letter notifications."""
    notify_webhook_url: str | None = None
    """Alternative to SNS: a URL that gets the same summaries as JSON POSTs."""
    notify_interval_s: float = 60.0
    """Longest a notification waits to aggregate more dead letters into one summary."""


@dataclass(frozen=True)
class WindowSettings:
    max_messages: int = DEFAULT_WINDOW_MESSAGES
    """Most fetched-but-unsettled messages; fetching pauses beyond it."""
    max_bytes: int = DEFAULT_WINDOW_BYTES
    """Most fetched-but-unsettled payload bytes; fetching pauses beyond it."""


@dataclass(frozen=True)
class DeliverySettings:
    ack_deadline_s: float = DEFAULT_ACK_DEADLINE_S
    """Time a delivery may stay unsettled before it is redelivered."""
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Deliveries of one message before it is dead-lettered."""
    ordering: str = "none"
    """"key": messages with the same key are never in flight at once and go in offset
    order (null keys stay unordered); "none": any order, most parallel."""


@dataclass(frozen=True)
class RetrySettings:
    initial_backoff_s: float = DEFAULT_RETRY_INITIAL_S
    """Wait before the first redelivery of a message nacked with retry."""
    max_backoff_s: float = DEFAULT_RETRY_MAX_S
    """Cap of the wait between redeliveries."""
    multiplier: float = DEFAULT_RETRY_MULTIPLIER
    """Growth of the wait per attempt."""


@dataclass(frozen=True)
class CommitSettings:
    interval_s: float = DEFAULT_COMMIT_INTERVAL_S
    """How often the committable offset is committed when it advanced."""
    encode_settled: bool = True
    """Encode offsets settled above the committed one into the commit (and a checkpoint
    item), so a restarted proxy does not redeliver them."""


@dataclass(frozen=True)
class ShutdownSettings:
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    """How long SIGTERM waits for in-flight work to settle."""


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings
    auth: AuthSettings
    dead_letters: DeadLetterSettings
    server: ServerSettings = field(default_factory=ServerSettings)
    window: WindowSettings = field(default_factory=WindowSettings)
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    commit: CommitSettings = field(default_factory=CommitSettings)
    shutdown: ShutdownSettings = field(default_factory=ShutdownSettings)

    def __post_init__(self) -> None:
        _positive("kafka.fetch_batch", self.kafka.fetch_batch)
        _positive("window.max_messages", self.window.max_messages)
        _positive("window.max_bytes", self.window.max_bytes)
        _positive("delivery.max_attempts", self.delivery.max_attempts)
        _positive("delivery.ack_deadline_s", self.delivery.ack_deadline_s)
        _positive("commit.interval_s", self.commit.interval_s)
        _positive("retry.initial_backoff_s", self.retry.initial_backoff_s)
        _positive("retry.max_backoff_s", self.retry.max_backoff_s)
        if self.retry.multiplier < 1:
            raise ConfigError("retry.multiplier", "must be >= 1")
        if self.delivery.ordering not in ORDERINGS:
            raise ConfigError("delivery.ordering", f"must be one of {', '.join(ORDERINGS)}")
        _positive("server.max_frame_bytes", self.server.max_frame_bytes)
        if not 0 <= self.server.port <= 65535:
            raise ConfigError("server.port", f"must be 0..65535, got {self.server.port}")
        if not 1 <= self.dead_letters.batch_size <= DEFAULT_DLQ_BATCH:
            raise ConfigError("dead_letters.batch_size", "must be 1..25 (DynamoDB's limit)")
        if self.shutdown.drain_timeout_s < 0:
            raise ConfigError("shutdown.drain_timeout_s", "must be >= 0")
        if not self.auth.token:
            raise ConfigError("auth.token", "must not be empty")

    def listen_address(self, partition: int) -> str:
        """host:port the proxy for `partition` binds (port 0 picks a free one)."""
        port = self.server.port + partition if self.server.port else 0
        return f"{self.server.host}:{port}"


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be > 0, got {value}")


_SECTIONS: dict[str, type[Any]] = {
    "kafka": KafkaSettings,
    "server": ServerSettings,
    "auth": AuthSettings,
    "dead_letters": DeadLetterSettings,
    "window": WindowSettings,
    "delivery": DeliverySettings,
    "retry": RetrySettings,
    "commit": CommitSettings,
    "shutdown": ShutdownSettings,
}


def load_settings(path: str | Path, env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate a TOML config; every problem names the offending key."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("<file>", f"{path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{path} is not valid TOML: {exc}") from None
    return settings_from_dict(raw, os.environ if env is None else env)


def settings_from_dict(raw: Mapping[str, Any], env: Mapping[str, str]) -> Settings:
    """Build Settings from parsed TOML, resolving `auth.token_env` through `env`."""
    for name in raw:
        if name not in _SECTIONS:
            raise ConfigError(name, f"unknown section (known: {', '.join(_SECTIONS)})")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        if name == "auth":
            table = _resolve_token(table, env)
        if name in raw or name in ("kafka", "auth", "dead_letters"):
            sections[name] = _build(name, cls, table)
    return Settings(**sections)


def _resolve_token(table: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    table = dict(table)
    var = table.pop("token_env", None)
    if var is None:
        return table
    if "token" in table:
        raise ConfigError("auth.token_env", "give either token or token_env, not both")
    if not isinstance(var, str):
        raise ConfigError("auth.token_env", "must be a string naming an environment variable")
    if not env.get(var):
        raise ConfigError("auth.token_env", f"environment variable {var} is not set")
    table["token"] = env[var]
    return table


def _build(section: str, cls: type[Any], table: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"{section}.{key}", f"unknown key (known: {', '.join(known)})")
    values: dict[str, Any] = {}
    for name, f in known.items():
        dotted = f"{section}.{name}"
        if name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(dotted, "is required")
            continue
        values[name] = _check_type(dotted, table[name], hints[name])
    return cls(**values)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check_type(key, value, options[0])
    if origin is not None and issubclass(origin, Mapping):
        if not isinstance(value, dict) or not all(
            isinstance(v, str | int | bool) for v in value.values()
        ):
            raise ConfigError(key, "must be a table of strings, numbers or booleans")
        return dict(value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str):
        return value
    if hint is bool and isinstance(value, bool):
        return value
    raise ConfigError(key, f"must be {hint.__name__}, got {type(value).__name__} {value!r}")
