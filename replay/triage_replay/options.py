"""What one run of the Spark job is asked to do: `ReplayOptions` (and the test-only `Fault`).

Why a module of its own: the options travel to the executors inside every task (pickled
by reference to their class), so their class must live in a module that is importable
there under its own name. `job.py` does not qualify: `python -m triage_replay.job` runs
it as `__main__`, and a class pickled as `__main__.ReplayOptions` cannot be found on a
worker. The table side is the proxy's own `DeadLetterSettings` and group id (the
deployment), so the job reaches the table, the S3 overflow bucket and TTL exactly as the
proxy and `triage dlq` do, and acts on that deployment's dead letters only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.settings import Settings
from triage_proxy.errors import ConfigError
from triage_proxy.kafka.producer import REPLAY_DELIVERY_TIMEOUT_S
from triage_proxy.store.items import check_group
from triage_proxy.store.query import Filters
from triage_proxy.store.replay import DEFAULT_CLAIM_LEASE_S

DEFAULT_CHUNK = 500
"""Selected items claimed, produced and marked together (bounds what a crash leaves in doubt)."""
DEFAULT_WRITE_CONCURRENCY = 8
"""Conditional UpdateItem calls in flight per task."""
MAX_WRITE_CONCURRENCY = 10
"""botocore's connection pool per client: more calls in flight would only queue."""
DEFAULT_DELIVERY_TIMEOUT_S = REPLAY_DELIVERY_TIMEOUT_S
"""How long a produced message may take to be acknowledged (librdkafka message.timeout.ms)."""
MAX_SEGMENTS = 1_000_000
"""DynamoDB's limit on TotalSegments."""


@dataclass(frozen=True)
class Fault:
    """Tests only: make every segment's replay fail midway (a rerun goes without it)."""

    after: int
    """A segment fails once it has handed this many messages to its producer (at the
    next one, or, with crash, at the first flush from then on)."""
    crash: bool = False
    """False: raise in the middle of a chunk (the task cleans up). True: kill the worker
    process right after the chunk was flushed and before it is marked (an executor lost
    at the worst moment)."""


@dataclass(frozen=True)
class ReplayOptions:
    """Everything one run needs; `from_settings` builds it from a proxy's config file."""

    dead_letters: DeadLetterSettings
    """The table (and overflow bucket, TTL) exactly as the proxy's config names it."""
    group: str = ""
    """The deployment whose dead letters to act on: the proxies' `kafka.group_id`
    (required; a default only so that the fields after it may have theirs)."""
    bootstrap: str | None = None
    """Kafka bootstrap servers; required to replay, unused by export."""
    kafka_config: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """Extra librdkafka producer properties (security.protocol, sasl.*; secrets resolved)."""
    filters: Filters = field(default_factory=Filters)
    """Which dead letters to act on (the same filters as `triage dlq`)."""
    to_topic: str | None = None
    """Replay every item to this topic instead of its source partition."""
    export_path: str | None = None
    """Export to Parquet here instead of replaying (any path Spark can write)."""
    overwrite: bool = False
    """Export: replace what is at export_path. Without it an existing path is refused
    (`job.ExportExists`), including one a failed export left half-written."""
    master: str | None = None
    """Spark master; None: spark-submit's, else local[*]. Ignored when a session is passed."""
    segments: int | None = None
    """Scan segments (= Spark partitions); None: two per default core."""
    chunk_size: int = DEFAULT_CHUNK
    """See DEFAULT_CHUNK."""
    write_concurrency: int = DEFAULT_WRITE_CONCURRENCY
    """See DEFAULT_WRITE_CONCURRENCY (1..MAX_WRITE_CONCURRENCY)."""
    delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S
    """See DEFAULT_DELIVERY_TIMEOUT_S."""
    claim_lease_s: float = DEFAULT_CLAIM_LEASE_S
    """How long a claim is honoured; after it, retry_in_doubt may take the item over."""
    retry_in_doubt: bool = False
    """Replay items whose claim by an earlier run expired: they may already be in Kafka."""
    fault: Fault | None = None
    """Tests only: inject a failure into every segment's replay."""

    def __post_init__(self) -> None:
        if self.export_path is None and not self.bootstrap:
            raise ConfigError("bootstrap", "is required to replay (or give an export path)")
        if self.export_path is not None and self.to_topic is not None:
            raise ConfigError("to_topic", "means nothing to an export")
        if self.to_topic is not None and (not self.to_topic or "#" in self.to_topic):
            raise ConfigError("to_topic", f"not a Kafka topic name: {self.to_topic!r}")
        if self.segments is not None and not 1 <= self.segments <= MAX_SEGMENTS:
            raise ConfigError("segments", f"must be 1..{MAX_SEGMENTS}, got {self.segments}")
        if self.chunk_size < 1:
            raise ConfigError("chunk_size", f"must be >= 1, got {self.chunk_size}")
        if not 1 <= self.write_concurrency <= MAX_WRITE_CONCURRENCY:
            raise ConfigError(
                "write_concurrency",
                f"must be 1..{MAX_WRITE_CONCURRENCY}, got {self.write_concurrency}",
            )
        if self.delivery_timeout_s <= 0:
            raise ConfigError("delivery_timeout_s", f"must be > 0, got {self.delivery_timeout_s}")
        if self.claim_lease_s <= self.delivery_timeout_s:
            raise ConfigError("claim_lease_s", "must be longer than delivery_timeout_s")
        if not self.group:
            raise ConfigError("group", "is required: the deployment's kafka.group_id")
        check_group(self.group)

    @property
    def mode(self) -> str:
        """ "export" or "replay"."""
        return "export" if self.export_path is not None else "replay"

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> ReplayOptions:
        """Options for the table and broker of a proxy's config (its connection and
        security properties, secrets resolved here on the driver), plus `overrides`."""
        kafka = settings.kafka.librdkafka_config()
        base: dict[str, Any] = {
            "dead_letters": settings.dead_letters,
            "group": settings.kafka.group_id,
            "bootstrap": kafka.pop("bootstrap.servers"),
            "kafka_config": kafka,
        }
        return cls(**{**base, **overrides})
