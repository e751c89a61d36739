"""The sections of the settings, one frozen dataclass each, their fields' defaults and
bounds; `SECTIONS` maps each TOML table to its dataclass. The keys, by section:

    [kafka]        bootstrap_servers, topic, group_id, fetch_batch, fetch_wait_ms, partitions,
                   security_protocol,
                   sasl_mechanism, sasl_username, sasl_password (a reference: "env:VAR" or
                   "secret:NAME", never inline), client (librdkafka extras)
    [server]       host, port (a process listens on port + its slot), max_frame_bytes,
                   http_port (metrics/health/status; on http_port + the slot),
                   http_host (its own interface, default loopback), http_enabled,
                   advertised_host, advertised_port (what consumers are told to dial;
                   advertised_host "ecs-task-dns"/"ecs-task-ip": the ECS task's own, see
                   config/ecs.py)
    [auth]         token | token_env, tokens (name -> token or "env:VAR"/"secret:NAME"),
                   revoked (names refused even though listed)
    [tls]          cert_file, key_file, client_ca_file (set: client certificates required)
    [ownership]    enabled, lease_s, renew_interval_s
    [rate_limit]   messages_per_s, bytes_per_s
    [aws]          image, proxies, vpc_id, subnet_ids, scheme, client_cidr,
                   assign_public_ip, cpu, memory_mb, log_retention_days, stack_name,
                   listener, certificate_arn (deprecated: accepted and ignored)
                   (read only by `triage deploy --target aws`)
    [dead_letters] table, region, endpoint_url, batch_size, flush_interval_ms, retry_max_s,
                   overflow_bucket, ttl_days, notify_sns_topic_arn, notify_webhook_url,
                   notify_interval_s
    [window]       max_messages, max_bytes
    [delivery]     ack_deadline_s, max_attempts, redelivery_span_s, ordering ("none" | "key")
    [retry]        initial_backoff_s, max_backoff_s, multiplier
    [commit]       interval_s, encode_settled
    [shutdown]     drain_timeout_s

A field's docstring is its entry in the configuration reference (docs/generate.py).
"""

from __future__ import annotations

import socket
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triage_protocol.constants import UINT32_MAX
from triage_proxy.config.bounds import (
    FARGATE_CPU,
    FARGATE_MEMORY_MB,
    MAX_AWS_PROXIES,
    MAX_DLQ_BATCH,
    MAX_DURATION_MS,
    MAX_FETCH_BATCH,
    MAX_FETCH_WAIT_MS,
    MAX_FRAME_BYTES,
    MAX_LOG_RETENTION_DAYS,
    MAX_PARTITIONS,
    MAX_PORT,
    MAX_RATE_PER_S,
    MAX_RETRY_MULTIPLIER,
    MAX_TTL_DAYS,
    MAX_WINDOW_BYTES,
    MAX_WINDOW_MESSAGES,
    MIN_FRAME_BYTES,
    NO_CAP,
    bounded,
    duration,
)
from triage_proxy.config.secrets import SecretResolver, Secrets
from triage_proxy.config.validation import (
    WILDCARD_HOSTS,
    client_key,
    is_secret_property,
    join_host_port,
    slot_port,
)
from triage_proxy.errors import ConfigError

DEFAULT_PORT = 7700
DEFAULT_FETCH_BATCH = 2000
DEFAULT_FETCH_WAIT_MS = 100
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_WINDOW_MESSAGES = 10_000
DEFAULT_WINDOW_BYTES = 64 * 1024 * 1024
DEFAULT_ACK_DEADLINE_S = 30.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_REDELIVERY_SPAN_S = 60.0
DEFAULT_COMMIT_INTERVAL_S = 1.0
DEFAULT_RETRY_INITIAL_S = 1.0
DEFAULT_RETRY_MAX_S = 60.0
DEFAULT_RETRY_MULTIPLIER = 2.0
ORDERINGS = ("none", "key")
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_DLQ_BATCH = MAX_DLQ_BATCH
DEFAULT_DLQ_FLUSH_MS = 20
DEFAULT_DLQ_RETRY_MAX_S = 5.0
DEFAULT_REGION = "us-east-1"
DEFAULT_HTTP_PORT = 9700
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_LEASE_S = 10.0
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
DEFAULT_TOKEN_NAME = "default"
DEFAULT_AWS_CPU = 512
DEFAULT_AWS_MEMORY_MB = 1024
DEFAULT_LOG_RETENTION_DAYS = 30
LB_SCHEMES = ("internal", "internet-facing")
DEFAULT_AWS_PROXIES = 2
"""Fleet tasks on AWS unless `aws.proxies` says (fewer when the topic has fewer
partitions): two, so losing a task leaves one serving while ECS replaces it."""


_NOT_A_KEY = types.MappingProxyType({"config_key": False})
"""Field metadata of what the loader binds rather than reads from the file."""


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str
    """Comma-separated host:port list."""
    topic: str
    """The topic whose partitions the proxies own."""
    group_id: str
    """Consumer group under which offsets are committed."""
    fetch_batch: int = bounded(
        DEFAULT_FETCH_BATCH, 1, MAX_FETCH_BATCH, why="confluent-kafka's consume() limit"
    )
    """Most messages taken from librdkafka per fetch."""
    fetch_wait_ms: int = bounded(
        DEFAULT_FETCH_WAIT_MS, 1, MAX_FETCH_WAIT_MS, why="librdkafka's fetch.wait.max.ms range"
    )
    """How long the broker may hold a fetch that finds nothing new (librdkafka's
    fetch.wait.max.ms, which `[kafka.client]` may not set: the proxy sizes its prefetch).
    A broker that answers such a fetch only when this runs out (Tansu) delays a record
    by up to this much; a shorter wait costs the broker more empty fetches."""
    partitions: int | None = bounded(
        None, 1, MAX_PARTITIONS, why="each partition listens on its own port"
    )
    """Partitions to deploy proxies for (`triage init` writes what the broker reported);
    None: ask the broker at deploy time."""
    security_protocol: str = "PLAINTEXT"
    """PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
    sasl_mechanism: str | None = None
    """PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (with a SASL protocol)."""
    sasl_username: str | None = None
    """SASL user name (not a secret)."""
    sasl_password: str | None = None
    """A reference, never the password: "env:VAR" or "secret:NAME" (Secrets Manager).
    Resolved when the client is built (`librdkafka_config`), so it never sits in Settings."""
    client: Mapping[str, str | int | bool] = field(default_factory=dict)
    """Extra librdkafka properties, passed through; never one of RESERVED_CLIENT_PROPERTIES,
    and secrets (`is_secret_property`) only as references."""
    secrets: Secrets = field(default=Secrets(), repr=False, compare=False, metadata=_NOT_A_KEY)
    """How this process resolves the references above (bound by the loader; not a config
    key): the environment, and Secrets Manager when the loader was given access."""

    def librdkafka_config(self, resolve: SecretResolver | None = None) -> dict[str, Any]:
        """Connection properties for a confluent-kafka client, secrets resolved now."""
        resolve = resolve or self.secrets
        # The extras first: what follows wins, even for a KafkaSettings the loader never saw.
        config: dict[str, Any] = {
            name: resolve(client_key(name), str(value)) if is_secret_property(name) else value
            for name, value in self.client.items()
        }
        config["bootstrap.servers"] = self.bootstrap_servers
        config["security.protocol"] = self.security_protocol.lower()
        if self.sasl_mechanism:
            config["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            config["sasl.username"] = self.sasl_username
        if self.sasl_password:
            config["sasl.password"] = resolve("kafka.sasl_password", self.sasl_password)
        return config


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    """Interface the gRPC listener binds."""
    port: int = bounded(DEFAULT_PORT, 0, MAX_PORT, why="a TCP port")
    """Base port: a proxy process listens on port + its slot (the partition when it pins
    exactly one, else `triage proxy --slot K`, default 0); 0 picks a free port."""
    max_frame_bytes: int = bounded(
        DEFAULT_MAX_FRAME_BYTES,
        MIN_FRAME_BYTES,
        MAX_FRAME_BYTES,
        why="64 KiB of framing plus 64 KiB for a record, up to gRPC's C int",
    )
    """Largest gRPC frame either side may send; bounds one oversized message."""
    http_port: int = bounded(DEFAULT_HTTP_PORT, 0, MAX_PORT, why="a TCP port")
    """Base port of the HTTP endpoint (/metrics, /healthz, /readyz, /status): a process
    serves it on http_port + its slot, as `port`; 0 picks a free port. `http_enabled =
    false` turns it off."""
    http_host: str = DEFAULT_HTTP_HOST
    """Interface the HTTP endpoint binds: its own, since /status has no token (exposing
    gRPC on a public interface must not expose it too). Default loopback."""
    http_enabled: bool = True
    """False turns the HTTP endpoint off."""

    advertised_host: str | None = None
    """Host consumers are given for this deployment's proxies (Topology, the lease item),
    e.g. a load balancer's name. Default: `host`, or this machine's host name when `host`
    is a wildcard (0.0.0.0, :: or empty), since a wildcard cannot be dialled."""
    advertised_port: int | None = bounded(None, 1, MAX_PORT, why="a TCP port")
    """Base port consumers are given: partition p at advertised_port + p (a load
    balancer's listeners). Default: the port bound (port + slot, or the free one picked when
    `port` is 0)."""

    def http_address(self, partition: int) -> tuple[str, int] | None:
        """(host, port) the HTTP endpoint for `partition` binds, or None when off."""
        if not self.http_enabled:
            return None
        return self.http_host, slot_port("server.http_port", self.http_port, partition)

    def advertised_endpoint(self, partition: int, bound_port: int = 0) -> str | None:
        """host:port consumers dial for `partition` (the one formula, see the two fields
        above). `bound_port` is the port its proxy actually bound (0: not known here); None
        when the port cannot be known (port 0 picks a free one, and none was bound here)."""
        if self.advertised_port is not None:
            port = self.advertised_port + partition
            if port > MAX_PORT:
                raise ConfigError(
                    "server.advertised_port",
                    f"partition {partition} would be advertised on port {port}, over {MAX_PORT}",
                )
        elif bound_port:
            port = bound_port
        elif self.port:
            port = self.port + partition
        else:
            return None
        host = self.advertised_host or self.host
        if host in WILDCARD_HOSTS:
            host = socket.gethostname()
        return join_host_port(host, port)


@dataclass(frozen=True)
class AuthSettings:
    """`token` and `tokens` merge: `token` is the one named "default", so both may be set,
    but not together with a `tokens.default` (one of the two would be dropped)."""

    token: str | None = None
    """The unnamed token (named "default"), resolved from token_env if given."""
    tokens: Mapping[str, str] = field(default_factory=dict)
    """Named tokens, one per consumer app, so one can be revoked alone. Values are the
    token or a reference ("env:VAR", "secret:NAME"), resolved at load."""
    revoked: tuple[str, ...] = ()
    """Names whose tokens are refused (keeps the entry, documents the revocation)."""

    def __post_init__(self) -> None:
        if self.token is not None and DEFAULT_TOKEN_NAME in self.tokens:
            raise ConfigError(
                "auth.token",
                f"auth.token is the token named {DEFAULT_TOKEN_NAME!r}, and auth.tokens has "
                f"a {DEFAULT_TOKEN_NAME!r} too: keep one of them (or rename the entry)",
            )

    def active(self) -> dict[str, str]:
        """name -> token for every token a call may present. Revoking a name revokes its
        token under every name it is configured as (a token copied to a second entry
        must not outlive its revocation)."""
        named = dict(self.tokens)
        if self.token:
            named[DEFAULT_TOKEN_NAME] = self.token
        dead = {tok for name, tok in named.items() if name in self.revoked}
        return {
            name: tok for name, tok in named.items() if name not in self.revoked and tok not in dead
        }


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str | None = None
    """PEM certificate chain the gRPC listener presents; set with key_file to turn TLS on."""
    key_file: str | None = None
    """PEM private key of cert_file."""
    client_ca_file: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mTLS)."""

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


@dataclass(frozen=True)
class OwnershipSettings:
    enabled: bool = True
    """Hold a DynamoDB lease on the partition, so two proxies never deliver it at once."""
    lease_s: float = duration(DEFAULT_LEASE_S)
    """How long a lease lives without renewal; a standby takes over after it lapses."""
    renew_interval_s: float | None = duration(None)
    """How often the holder renews (default: lease_s / 3)."""

    @property
    def renew_every_s(self) -> float:
        return self.renew_interval_s or self.lease_s / 3


@dataclass(frozen=True)
class AwsSettings:
    """How `triage deploy --target aws` lays out the stack; the proxy never reads it."""

    image: str | None = None
    """Container image of the proxy (built from infra/Dockerfile); --image overrides."""
    proxies: int | None = bounded(None, 1, MAX_AWS_PROXIES, why="ECS's tasks per service")
    """Fleet tasks the one ECS service runs (the consumer group spreads the partitions
    over them). None: `aws_proxies(partitions)`, min(partitions, DEFAULT_AWS_PROXIES)."""
    certificate_arn: str | None = None
    """Deprecated and ignored: TLS runs from each consumer to the task that serves it
    ([tls], stored in Secrets Manager), so the load balancer presents no certificate.
    Accepted so existing config files keep loading; a future version refuses it."""
    vpc_id: str | None = None
    """VPC of the load balancer and the tasks (None: the account's default VPC)."""
    subnet_ids: tuple[str, ...] = ()
    """Subnets of the load balancer and the tasks (empty: the VPC's default subnets)."""
    scheme: str = "internal"
    """"internal" (reachable inside the VPC) or "internet-facing"."""
    client_cidr: str = "0.0.0.0/0"
    """Addresses allowed to reach the listener ports."""
    assign_public_ip: bool = False
    """Give tasks a public IP (public subnets without a NAT gateway need it to pull)."""
    cpu: int = bounded(DEFAULT_AWS_CPU, *FARGATE_CPU, why="Fargate's range")
    """Fargate CPU units per proxy task (256, 512, 1024, ...)."""
    memory_mb: int = bounded(DEFAULT_AWS_MEMORY_MB, *FARGATE_MEMORY_MB, why="Fargate's range")
    """Fargate memory per proxy task, MiB (must suit cpu)."""
    log_retention_days: int = bounded(
        DEFAULT_LOG_RETENTION_DAYS, 1, MAX_LOG_RETENTION_DAYS, why="CloudWatch Logs' longest"
    )
    """How long CloudWatch keeps the proxies' logs."""
    stack_name: str | None = None
    """CloudFormation stack name (None: derived from the topic and group)."""
    listener: bool = True
    """False leaves the NLB's listener out: only for an endpoint whose CloudFormation
    cannot create an NLB listener (moto server, in the tests); a real deployment needs it."""

    def fleet_size(self, partitions: int) -> int:
        """Tasks to run for a topic of `partitions`: `proxies`, else
        min(partitions, DEFAULT_AWS_PROXIES) (the one formula: deploy and init use it)."""
        return self.proxies if self.proxies is not None else min(partitions, DEFAULT_AWS_PROXIES)


@dataclass(frozen=True)
class RateLimitSettings:
    messages_per_s: float | None = bounded(None, 0, MAX_RATE_PER_S, above=True, why=NO_CAP)
    """Most messages delivered per second by this proxy (None: no cap)."""
    bytes_per_s: float | None = bounded(None, 0, MAX_RATE_PER_S, above=True, why=NO_CAP)
    """Most payload bytes delivered per second by this proxy (None: no cap)."""


@dataclass(frozen=True)
class DeadLetterSettings:
    table: str
    """DynamoDB table that holds dead letters."""
    region: str = DEFAULT_REGION
    """AWS region of the table."""
    endpoint_url: str | None = None
    """Override for a local endpoint (moto server); None means AWS itself."""
    batch_size: int = bounded(DEFAULT_DLQ_BATCH, 1, MAX_DLQ_BATCH, why="DynamoDB's limit")
    """Items per BatchWriteItem call (1..25)."""
    flush_interval_ms: int = bounded(
        DEFAULT_DLQ_FLUSH_MS, 0, MAX_DURATION_MS, why="a uint32 of milliseconds"
    )
    """How long a dead letter may wait for others to share its batch."""
    retry_max_s: float = duration(DEFAULT_DLQ_RETRY_MAX_S)
    """Cap of the exponential backoff between failed writes."""
    overflow_bucket: str | None = None
    """S3 bucket for payloads too large for a DynamoDB item (None: such items wait)."""
    ttl_days: float | None = bounded(None, 0, MAX_TTL_DAYS, above=True, why="a century")
    """Replayed and discarded items expire this long after (DynamoDB TTL); None keeps them."""
    notify_sns_topic_arn: str | None = None
    """SNS topic that gets aggregated dead-letter notifications."""
    notify_webhook_url: str | None = None
    """Alternative to SNS: a URL that gets the same summaries as JSON POSTs."""
    notify_interval_s: float = duration(60.0)
    """Longest a notification waits to aggregate more dead letters into one summary."""


@dataclass(frozen=True)
class WindowSettings:
    max_messages: int = bounded(
        DEFAULT_WINDOW_MESSAGES, 1, MAX_WINDOW_MESSAGES, why="held in memory"
    )
    """Most fetched-but-unsettled messages; fetching pauses beyond it. With
    commit.encode_settled, most fetched messages whose settlement no commit or checkpoint
    recorded yet: what one kill -9 redelivers at most."""
    max_bytes: int = bounded(DEFAULT_WINDOW_BYTES, 1, MAX_WINDOW_BYTES, why="held in memory")
    """Most fetched-but-unsettled payload bytes; fetching pauses beyond it."""


@dataclass(frozen=True)
class DeliverySettings:
    ack_deadline_s: float = duration(
        DEFAULT_ACK_DEADLINE_S, why="Welcome.ack_deadline_ms is a uint32"
    )
    """Time a delivery may stay unsettled before it is redelivered."""
    max_attempts: int = bounded(
        DEFAULT_MAX_ATTEMPTS, 1, UINT32_MAX, why="Welcome.max_attempts is a uint32"
    )
    """Deliveries of one message before it is dead-lettered."""
    redelivery_span_s: float = duration(DEFAULT_REDELIVERY_SPAN_S, lo=0)
    """Least time from a message's first failed delivery to its dead letter when its
    instances vanish or its leases lapse: redeliveries after those back off (the first is
    immediate, then the gaps double and sum to this; policies.redelivery_delay), so a
    fleet in a crash loop cannot use up a healthy message's attempts in seconds. 0: no
    gaps."""
    ordering: str = "none"
    """"key": messages with the same key are never in flight at once and go in offset
    order (null keys stay unordered); "none": any order, most parallel."""


@dataclass(frozen=True)
class RetrySettings:
    initial_backoff_s: float = duration(DEFAULT_RETRY_INITIAL_S)
    """Wait before the first redelivery of a message nacked with retry."""
    max_backoff_s: float = duration(DEFAULT_RETRY_MAX_S)
    """Cap of the wait between redeliveries."""
    multiplier: float = bounded(
        DEFAULT_RETRY_MULTIPLIER, 1, MAX_RETRY_MULTIPLIER, why="growth per attempt"
    )
    """Growth of the wait per attempt."""


@dataclass(frozen=True)
class CommitSettings:
    interval_s: float = duration(DEFAULT_COMMIT_INTERVAL_S)
    """How often the committable offset is committed when it advanced."""
    encode_settled: bool = True
    """Encode offsets settled above the committed one into the commit (and a checkpoint
    item), so a restarted proxy does not redeliver them."""


@dataclass(frozen=True)
class ShutdownSettings:
    drain_timeout_s: float = duration(DEFAULT_DRAIN_TIMEOUT_S, lo=0)
    """How long SIGTERM waits for in-flight work to settle."""


SECTIONS: dict[str, type[Any]] = {
    "kafka": KafkaSettings,
    "server": ServerSettings,
    "auth": AuthSettings,
    "dead_letters": DeadLetterSettings,
    "window": WindowSettings,
    "delivery": DeliverySettings,
    "retry": RetrySettings,
    "commit": CommitSettings,
    "shutdown": ShutdownSettings,
    "tls": TlsSettings,
    "ownership": OwnershipSettings,
    "rate_limit": RateLimitSettings,
    "aws": AwsSettings,
}
"""Each TOML table and its section's dataclass, in the order the configuration reference
lists them (the loader reads `[[push]]` apart: config/push.py)."""
