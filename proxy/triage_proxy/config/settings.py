"""One frozen, validated settings object, built once at the edge from a TOML file.

Nothing below the CLI reads files or the environment: `load_settings` resolves
`token_env` and friends here and hands the proxy a complete `Settings`.

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

Every number is checked here, once, for its type (a TOML `true` is not a number), for
finiteness and for a range whose upper bound is what the field feeds can hold (a uint32
on the wire, a C int in gRPC, ...): each numeric field carries its `Bounds`, and a
numeric field without them fails at import. `kafka.client` may not set what the proxy's
guarantees rest on (`RESERVED_CLIENT_PROPERTIES`), and holds secrets only by reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import socket
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from triage_protocol.constants import UINT32_MAX
from triage_proxy.config.files import read_text_file
from triage_proxy.config.push import PushTargetSettings, push_targets
from triage_proxy.config.secrets import SecretFetcher, SecretResolver, Secrets, secret_reference
from triage_proxy.errors import ConfigError

_T = TypeVar("_T")

DEFAULT_PORT = 7700
DEFAULT_FETCH_BATCH = 2000
DEFAULT_FETCH_WAIT_MS = 100
MAX_FETCH_WAIT_MS = 300_000
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
MAX_DLQ_BATCH = 25
"""DynamoDB's BatchWriteItem takes at most 25 items."""
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

# Bounds of the numeric settings (see `Bounds`): the upper ones are what the field a
# setting feeds can hold, or where a larger value can only be a typo.
INT32_MAX = 2**31 - 1
"""Largest C int: gRPC's message size options are ints."""
MAX_PORT = 65535
MIN_DURATION_S = 0.001
"""Shortest wait, period or deadline in seconds: below a millisecond a loop only spins,
and the ack deadline travels in whole milliseconds."""
MAX_DURATION_S = UINT32_MAX / 1000
"""Longest duration in seconds: what a uint32 of milliseconds holds (about 49.7 days),
the unit of the ack deadline on the wire; any duration beyond it is a typo."""
MAX_DURATION_MS = UINT32_MAX
MAX_FETCH_BATCH = 1_000_000
"""confluent-kafka's Consumer.consume() takes at most 1,000,000 messages per call."""
MIN_FRAME_BYTES = 128 * 1024
"""The dispatcher keeps 64 KiB of a frame for framing (dispatcher.FRAME_OVERHEAD_BYTES): a
frame not above that would dead-letter every message as too large, a false reason. This
floor leaves a record at least 64 KiB; a larger one is dead-lettered, truly too large."""
MAX_FRAME_BYTES = INT32_MAX
MAX_WINDOW_MESSAGES = 10_000_000
"""Every unsettled message is held in memory; more than this is not a window but a typo."""
MAX_WINDOW_BYTES = 2**40
MAX_RETRY_MULTIPLIER = 1000.0
MAX_RATE_PER_S = 1e12
_NO_CAP = "beyond any machine; for no cap leave the key out"
MAX_TTL_DAYS = 36_500
MAX_PARTITIONS = MAX_PORT
"""Each partition's proxy listens on its own port (server.port + p)."""
FARGATE_CPU = (256, 16_384)
FARGATE_MEMORY_MB = (512, 122_880)
MAX_LOG_RETENTION_DAYS = 3653
"""CloudWatch Logs' longest retention (10 years)."""
MAX_AWS_PROXIES = 5000
"""ECS's quota of tasks per service."""
DEFAULT_AWS_PROXIES = 2
"""Fleet tasks on AWS unless `aws.proxies` says (fewer when the topic has fewer
partitions): two, so losing a task leaves one serving while ECS replaces it."""


_COMMITS = "the proxy commits only settled offsets itself (how often: commit.interval_s)"
_ASSIGNS = "the proxy assigns its partitions itself, one owner per partition"
_PREFETCH = "the proxy sizes librdkafka's prefetch so a full window stops fetching"
_CALLBACK = "a callback, which a config file cannot give"
RESERVED_CLIENT_PROPERTIES: Mapping[str, str] = {
    # Each has its own key: one place to set it.
    "bootstrap.servers": "set kafka.bootstrap_servers instead",
    "metadata.broker.list": "set kafka.bootstrap_servers instead",
    "group.id": "set kafka.group_id instead",
    "security.protocol": "set kafka.security_protocol instead",
    "sasl.mechanism": "set kafka.sasl_mechanism instead",
    "sasl.mechanisms": "set kafka.sasl_mechanism instead",
    "sasl.username": "set kafka.sasl_username instead",
    "sasl.password": 'set kafka.sasl_password instead, as "env:VAR" or "secret:NAME"',
    # What the proxy's guarantees rest on; kafka/client.py sets these (a unit test checks that
    # every property it sets is listed here).
    "enable.auto.commit": _COMMITS,
    "auto.commit.enable": _COMMITS,
    "auto.commit.interval.ms": _COMMITS,
    "enable.auto.offset.store": _COMMITS,
    "offset.store.method": _COMMITS,
    "auto.offset.reset": "the proxy starts at the committed offset, else the earliest one",
    "enable.partition.eof": "the proxy never decides end of partition from the log",
    "isolation.level": "the proxy delivers only committed transactional records",
    "group.protocol": _ASSIGNS,
    "group.protocol.type": _ASSIGNS,
    "group.remote.assignor": _ASSIGNS,
    "partition.assignment.strategy": _ASSIGNS,
    "group.instance.id": _ASSIGNS + "; every proxy reads this file, so all would share it",
    "queued.min.messages": _PREFETCH + " (window.max_messages bounds memory)",
    "queued.max.messages.kbytes": _PREFETCH + " (window.max_bytes bounds memory)",
    "fetch.queue.backoff.ms": _PREFETCH,
    "fetch.wait.max.ms": "set kafka.fetch_wait_ms instead",
    "error_cb": _CALLBACK,
    "logger": _CALLBACK,
    "stats_cb": _CALLBACK,
    "throttle_cb": _CALLBACK,
    "oauth_cb": _CALLBACK,
    "on_commit": _CALLBACK,
    "on_delivery": _CALLBACK,
}
"""librdkafka properties `[kafka.client]` may not set, and why (or what to set instead).
Librdkafka matches property names exactly, so no other spelling reaches these."""
SECRET_PROPERTY_WORDS = ("password", "secret", "passphrase", "key.pem")
"""A `[kafka.client]` property whose name holds one of these is a secret (ssl.key.password,
ssl.keystore.password, ssl.key.pem, sasl.oauthbearer.client.secret, ...): given only as a
reference, resolved when the client is built, like kafka.sasl_password."""


@dataclass(frozen=True)
class Bounds:
    """The range a numeric setting must lie in; NaN and infinities never do."""

    lo: float
    hi: float
    above: bool = False
    """True: `lo` itself is refused (the value must be > lo)."""
    why: str = ""
    """Where `hi` comes from, shown in the error."""

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and (
            (value > self.lo if self.above else value >= self.lo) and value <= self.hi
        )

    def describe(self, kind: type) -> str:
        """The range in words, e.g. "1..4294967295 (Welcome.max_attempts is a uint32)"."""
        if kind is int and not self.above:
            text = f"{_fmt(self.lo)}..{_fmt(self.hi)}"
        else:
            text = f"{'>' if self.above else '>='} {_fmt(self.lo)} and <= {_fmt(self.hi)}"
        return f"{text} ({self.why})" if self.why else text


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _bounded(default: _T, lo: float, hi: float, *, above: bool = False, why: str = "") -> _T:
    """A dataclass field whose value must lie in [lo, hi] (or (lo, hi] with `above`)."""
    return field(default=default, metadata={"bounds": Bounds(lo, hi, above, why)})


def _duration(
    default: _T, lo: float = MIN_DURATION_S, why: str = "about 49.7 days, a uint32 of milliseconds"
) -> _T:
    """A duration in seconds: at least a millisecond (or `lo`), at most MAX_DURATION_S."""
    return _bounded(default, lo, MAX_DURATION_S, why=why)


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
    fetch_batch: int = _bounded(
        DEFAULT_FETCH_BATCH, 1, MAX_FETCH_BATCH, why="confluent-kafka's consume() limit"
    )
    """Most messages taken from librdkafka per fetch."""
    fetch_wait_ms: int = _bounded(
        DEFAULT_FETCH_WAIT_MS, 1, MAX_FETCH_WAIT_MS, why="librdkafka's fetch.wait.max.ms range"
    )
    """How long the broker may hold a fetch that finds nothing new (librdkafka's
    fetch.wait.max.ms, which `[kafka.client]` may not set: the proxy sizes its prefetch).
    A broker that answers such a fetch only when this runs out (Tansu) delays a record
    by up to this much; a shorter wait costs the broker more empty fetches."""
    partitions: int | None = _bounded(
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
    port: int = _bounded(DEFAULT_PORT, 0, MAX_PORT, why="a TCP port")
    """Base port: a proxy process listens on port + its slot (the partition when it pins
    exactly one, else `triage proxy --slot K`, default 0); 0 picks a free port."""
    max_frame_bytes: int = _bounded(
        DEFAULT_MAX_FRAME_BYTES,
        MIN_FRAME_BYTES,
        MAX_FRAME_BYTES,
        why="64 KiB of framing plus 64 KiB for a record, up to gRPC's C int",
    )
    """Largest gRPC frame either side may send; bounds one oversized message."""
    http_port: int = _bounded(DEFAULT_HTTP_PORT, 0, MAX_PORT, why="a TCP port")
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
    advertised_port: int | None = _bounded(None, 1, MAX_PORT, why="a TCP port")
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


def slot_port(key: str, base: int, slot: int) -> int:
    """`base + slot`, the port of one slot (0 stays 0: a free port). Over MAX_PORT is a
    ConfigError naming `key`: the OS would bind another port than the one configured."""
    problem = _overflow(key, base, slot)
    if problem is not None:
        raise ConfigError(key, problem)
    return base + slot if base else 0


def _overflow(key: str, base: int, slot: int) -> str | None:
    if not base or base + slot <= MAX_PORT:
        return None
    return (
        f"{base} + partition/slot {slot} = {base + slot} is over {MAX_PORT}: "
        f"set {key} to at most {MAX_PORT - slot}"
    )


WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""`server.host` values that bind every interface: no consumer can dial them."""


def join_host_port(host: str, port: int) -> str:
    """host:port as gRPC targets spell it (an IPv6 literal in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


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
    lease_s: float = _duration(DEFAULT_LEASE_S)
    """How long a lease lives without renewal; a standby takes over after it lapses."""
    renew_interval_s: float | None = _duration(None)
    """How often the holder renews (default: lease_s / 3)."""

    @property
    def renew_every_s(self) -> float:
        return self.renew_interval_s or self.lease_s / 3


@dataclass(frozen=True)
class AwsSettings:
    """How `triage deploy --target aws` lays out the stack; the proxy never reads it."""

    image: str | None = None
    """Container image of the proxy (built from infra/Dockerfile); --image overrides."""
    proxies: int | None = _bounded(None, 1, MAX_AWS_PROXIES, why="ECS's tasks per service")
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
    cpu: int = _bounded(DEFAULT_AWS_CPU, *FARGATE_CPU, why="Fargate's range")
    """Fargate CPU units per proxy task (256, 512, 1024, ...)."""
    memory_mb: int = _bounded(DEFAULT_AWS_MEMORY_MB, *FARGATE_MEMORY_MB, why="Fargate's range")
    """Fargate memory per proxy task, MiB (must suit cpu)."""
    log_retention_days: int = _bounded(
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
    messages_per_s: float | None = _bounded(None, 0, MAX_RATE_PER_S, above=True, why=_NO_CAP)
    """Most messages delivered per second by this proxy (None: no cap)."""
    bytes_per_s: float | None = _bounded(None, 0, MAX_RATE_PER_S, above=True, why=_NO_CAP)
    """Most payload bytes delivered per second by this proxy (None: no cap)."""


@dataclass(frozen=True)
class DeadLetterSettings:
    table: str
    """DynamoDB table that holds dead letters."""
    region: str = DEFAULT_REGION
    """AWS region of the table."""
    endpoint_url: str | None = None
    """Override for a local endpoint (moto server); None means AWS itself."""
    batch_size: int = _bounded(DEFAULT_DLQ_BATCH, 1, MAX_DLQ_BATCH, why="DynamoDB's limit")
    """Items per BatchWriteItem call (1..25)."""
    flush_interval_ms: int = _bounded(
        DEFAULT_DLQ_FLUSH_MS, 0, MAX_DURATION_MS, why="a uint32 of milliseconds"
    )
    """How long a dead letter may wait for others to share its batch."""
    retry_max_s: float = _duration(DEFAULT_DLQ_RETRY_MAX_S)
    """Cap of the exponential backoff between failed writes."""
    overflow_bucket: str | None = None
    """S3 bucket for payloads too large for a DynamoDB item (None: such items wait)."""
    ttl_days: float | None = _bounded(None, 0, MAX_TTL_DAYS, above=True, why="a century")
    """Replayed and discarded items expire this long after (DynamoDB TTL); None keeps them."""
    notify_sns_topic_arn: str | None = None
    """SNS topic that gets aggregated dead-letter notifications."""
    notify_webhook_url: str | None = None
    """Alternative to SNS: a URL that gets the same summaries as JSON POSTs."""
    notify_interval_s: float = _duration(60.0)
    """Longest a notification waits to aggregate more dead letters into one summary."""


@dataclass(frozen=True)
class WindowSettings:
    max_messages: int = _bounded(
        DEFAULT_WINDOW_MESSAGES, 1, MAX_WINDOW_MESSAGES, why="held in memory"
    )
    """Most fetched-but-unsettled messages; fetching pauses beyond it. With
    commit.encode_settled, most fetched messages whose settlement no commit or checkpoint
    recorded yet: what one kill -9 redelivers at most."""
    max_bytes: int = _bounded(DEFAULT_WINDOW_BYTES, 1, MAX_WINDOW_BYTES, why="held in memory")
    """Most fetched-but-unsettled payload bytes; fetching pauses beyond it."""


@dataclass(frozen=True)
class DeliverySettings:
    ack_deadline_s: float = _duration(
        DEFAULT_ACK_DEADLINE_S, why="Welcome.ack_deadline_ms is a uint32"
    )
    """Time a delivery may stay unsettled before it is redelivered."""
    max_attempts: int = _bounded(
        DEFAULT_MAX_ATTEMPTS, 1, UINT32_MAX, why="Welcome.max_attempts is a uint32"
    )
    """Deliveries of one message before it is dead-lettered."""
    redelivery_span_s: float = _duration(DEFAULT_REDELIVERY_SPAN_S, lo=0)
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
    initial_backoff_s: float = _duration(DEFAULT_RETRY_INITIAL_S)
    """Wait before the first redelivery of a message nacked with retry."""
    max_backoff_s: float = _duration(DEFAULT_RETRY_MAX_S)
    """Cap of the wait between redeliveries."""
    multiplier: float = _bounded(
        DEFAULT_RETRY_MULTIPLIER, 1, MAX_RETRY_MULTIPLIER, why="growth per attempt"
    )
    """Growth of the wait per attempt."""


@dataclass(frozen=True)
class CommitSettings:
    interval_s: float = _duration(DEFAULT_COMMIT_INTERVAL_S)
    """How often the committable offset is committed when it advanced."""
    encode_settled: bool = True
    """Encode offsets settled above the committed one into the commit (and a checkpoint
    item), so a restarted proxy does not redeliver them."""


@dataclass(frozen=True)
class ShutdownSettings:
    drain_timeout_s: float = _duration(DEFAULT_DRAIN_TIMEOUT_S, lo=0)
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
    tls: TlsSettings = field(default_factory=TlsSettings)
    ownership: OwnershipSettings = field(default_factory=OwnershipSettings)
    rate_limit: RateLimitSettings = field(default_factory=RateLimitSettings)
    aws: AwsSettings = field(default_factory=AwsSettings)
    push: tuple[PushTargetSettings, ...] = ()
    """`[[push]]`: endpoints the proxy delivers to itself (config/push.py)."""

    def __post_init__(self) -> None:
        for key, (kind, bounds) in numeric_settings().items():
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if value is not None:
                _number(key, value, kind, bounds)
        _check_client(self.kafka.client)
        if self.delivery.ordering not in ORDERINGS:
            raise ConfigError("delivery.ordering", f"must be one of {', '.join(ORDERINGS)}")
        if not self.auth.active():
            raise ConfigError("auth.tokens", "no usable token: set auth.token or auth.tokens")
        for name, tok in self.auth.active().items():
            problem = token_problem(tok)
            if problem is not None:
                raise ConfigError(f"auth.tokens.{name}", problem)
        for key, problem in (
            ("kafka.topic", topic_problem(self.kafka.topic)),
            ("kafka.group_id", group_problem(self.kafka.group_id)),
            ("kafka.bootstrap_servers", bootstrap_problem(self.kafka.bootstrap_servers)),
            ("dead_letters.table", table_problem(self.dead_letters.table)),
            ("dead_letters.region", region_problem(self.dead_letters.region)),
            ("server.advertised_host", host_problem(self.server.advertised_host)),
            *self._port_overflows(),
        ):
            if problem is not None:
                raise ConfigError(key, problem)
        for key, url in (
            ("dead_letters.endpoint_url", self.dead_letters.endpoint_url),
            ("dead_letters.notify_webhook_url", self.dead_letters.notify_webhook_url),
        ):
            problem = None if url is None else url_problem(url)
            if problem is not None:
                raise ConfigError(key, problem)
        if self.kafka.security_protocol not in SECURITY_PROTOCOLS:
            raise ConfigError(
                "kafka.security_protocol", f"must be one of {', '.join(SECURITY_PROTOCOLS)}"
            )
        if self.kafka.sasl_mechanism is not None:
            if self.kafka.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(
                    "kafka.sasl_mechanism", f"must be one of {', '.join(SASL_MECHANISMS)}"
                )
            if not self.kafka.security_protocol.startswith("SASL"):
                raise ConfigError("kafka.sasl_mechanism", "needs a SASL_* security_protocol")
        if (
            self.kafka.sasl_password is not None
            and secret_reference(self.kafka.sasl_password) is None
        ):
            raise ConfigError(
                "kafka.sasl_password",
                'must reference the secret ("env:VAR" or "secret:NAME"), never hold it',
            )
        if (self.tls.cert_file is None) != (self.tls.key_file is None):
            raise ConfigError("tls.key_file", "set tls.cert_file and tls.key_file together")
        if self.tls.client_ca_file is not None and not self.tls.enabled:
            raise ConfigError("tls.client_ca_file", "client certificates need tls.cert_file")
        if not 0 < self.ownership.renew_every_s < self.ownership.lease_s:
            raise ConfigError("ownership.renew_interval_s", "must be > 0 and < lease_s")
        if self.aws.scheme not in LB_SCHEMES:
            raise ConfigError("aws.scheme", f"must be one of {', '.join(LB_SCHEMES)}")

    def _port_overflows(self) -> list[tuple[str, str | None]]:
        """Base ports that partition `kafka.partitions - 1` would push over MAX_PORT (the
        proxy refuses them at bind, `slot_port`; known here only when `partitions` is)."""
        if self.kafka.partitions is None:
            return []
        last = self.kafka.partitions - 1
        return [
            (key, _overflow(key, base, last))
            for key, base in (
                ("server.port", self.server.port),
                ("server.http_port", self.server.http_port),
            )
        ]

    def listen_address(self, partition: int) -> str:
        """host:port the proxy for `partition` binds (port 0 picks a free one)."""
        return f"{self.server.host}:{slot_port('server.port', self.server.port, partition)}"


@functools.cache
def numeric_settings() -> dict[str, tuple[type, Bounds]]:
    """Every numeric setting as "section.key" -> (int or float, Bounds), found by walking
    the Settings dataclasses, so a new numeric field is validated without being listed.
    A numeric field declared without bounds (`_bounded`, `_duration`) is a bug: TypeError,
    raised at import (see the end of this module)."""
    found: dict[str, tuple[type, Bounds]] = {}
    for section in dataclasses.fields(Settings):
        cls = typing.get_type_hints(Settings)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue  # `push`, a list of tables, checks its own numbers (config/push.py)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _numeric_kind(hints[f.name])
            if kind is None:
                continue
            bounds = f.metadata.get("bounds")
            if not isinstance(bounds, Bounds):
                raise TypeError(f"{section.name}.{f.name} is numeric but has no Bounds")
            found[f"{section.name}.{f.name}"] = (kind, bounds)
    return found


def _numeric_kind(hint: Any) -> type | None:
    """int or float for `int`, `float` and their `| None` forms; None for anything else."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    return hint if hint in (int, float) else None


def _number(key: str, value: object, kind: type, bounds: Bounds) -> None:
    """The one numeric check: right type (a bool is no number), finite, within bounds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and isinstance(value, float))
    ):
        raise ConfigError(key, f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    if not bounds.holds(value):
        raise ConfigError(key, f"must be {bounds.describe(kind)}, got {value}")


MIN_TOKEN_CHARS = 16


def token_problem(token: str) -> str | None:
    """Why `token` cannot be a bearer token, or None. It travels as gRPC metadata
    (`authorization: Bearer <token>`), which holds printable ASCII only: a token with
    another character is refused by every client (INTERNAL "Invalid metadata"), and one
    of spaces is no secret. The message never quotes the token."""
    if len(token) < MIN_TOKEN_CHARS:
        return f"must be at least {MIN_TOKEN_CHARS} characters"
    if not all("!" <= c <= "~" for c in token):
        return (
            "must be printable ASCII without spaces ('!'..'~'): gRPC metadata cannot carry "
            "other characters, so no client could send it"
        )
    return None


MAX_TOPIC_CHARS = 249
"""Kafka's longest topic name."""


def topic_problem(topic: str) -> str | None:
    """Why `topic` is not a Kafka topic name, or None. Kafka allows letters, digits, '.',
    '_' and '-' (1..249 of them, not '.' or '..'); so never '#', which separates the parts
    of the dead-letter table's keys (`<topic>#<partition>`, store/items.py)."""
    allowed = all(c.isascii() and (c.isalnum() or c in "._-") for c in topic)
    if not topic or len(topic) > MAX_TOPIC_CHARS or not allowed or topic in (".", ".."):
        return (
            f"{topic!r} is not a Kafka topic name: 1..{MAX_TOPIC_CHARS} letters, digits, "
            "'.', '_' or '-' (so never '#', which the dead-letter table's keys use)"
        )
    return None


MAX_GROUP_BYTES = 255
"""Longest group id (UTF-8 bytes): the table's keys hold it (store/items.py), and with a
249-byte topic it keeps a partition key far below DynamoDB's 2048 bytes and the S3
payload key below 1024. Kafka's own limit (a protocol string, 32767 bytes) is higher."""


def group_problem(group: str) -> str | None:
    """Why `group` cannot be this deployment's group id, or None."""
    if not group:
        return 'must not be empty: it names the deployment (e.g. group_id = "orders-app")'
    size = len(group.encode("utf-8", "surrogatepass"))
    if size > MAX_GROUP_BYTES:
        return f"is {size} bytes; the table's keys hold at most {MAX_GROUP_BYTES}: shorten it"
    return None


def table_problem(table: str) -> str | None:
    """Why `table` is not a DynamoDB table name (3..255 of [a-zA-Z0-9_.-]), or None."""
    allowed = all(c.isascii() and (c.isalnum() or c in "._-") for c in table)
    if 3 <= len(table) <= 255 and allowed:
        return None
    return f"{table!r} is not a DynamoDB table name: 3..255 letters, digits, '.', '_' or '-'"


_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]{1,2}")
"""An AWS region name: us-east-1, eu-central-2, us-gov-west-1, cn-north-1, ..."""


def region_problem(region: str) -> str | None:
    """Why `region` is not an AWS region name, or None (whether the region exists is
    known only by asking AWS: `config check --connect`)."""
    if _REGION.fullmatch(region):
        return None
    return f"{region!r} is not an AWS region name (like us-east-1 or eu-west-2)"


_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[0-9A-Za-z_.:-]+")
"""A host name or IP address as a dialler takes it (an IPv6 literal bare or in brackets)."""


def host_problem(host: str | None) -> str | None:
    """Why `host` cannot be dialled as written, or None (None: not set)."""
    if host is None or (_HOST.fullmatch(host) and len(host) <= 253):
        return None
    return (
        f"{host!r} is not a host name or IP address: letters, digits, '.', '-', '_', ':' "
        "(no spaces), at most 253 characters"
    )


def bootstrap_problem(servers: str) -> str | None:
    """Why `servers` is not a comma-separated host[:port] list librdkafka can dial, or
    None. librdkafka skips what it cannot parse and retries forever, so a typo here
    would look like a broker that never answers."""
    entries = [s.strip() for s in servers.split(",")]
    if not any(entries):
        return 'is empty: give the brokers as "host:port,host:port"'
    for entry in entries:
        address = entry.split("://", 1)[-1]  # librdkafka takes "PLAINTEXT://host:port"
        host, port = address, ""
        if address.startswith("["):
            host, _, rest = address.partition("]")
            host += "]"
            port = rest.removeprefix(":")
        elif address.count(":") == 1:
            host, _, port = address.partition(":")
        if not host or host_problem(host) is not None:
            return f'{entry!r} is not a broker address: give "host:port,host:port"'
        if port and not (port.isdigit() and 1 <= int(port) <= MAX_PORT):
            return f"{entry!r}: the port must be 1..{MAX_PORT}"
    return None


def url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) endpoint (boto3 and the webhook need one), or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {url!r}"
    if port == 0:
        return f"port 0 cannot be dialled, got {url!r}"
    return None


def client_key(name: str) -> str:
    """The config key of a `[kafka.client]` property, as TOML spells it."""
    return f'kafka.client."{name}"'


def is_secret_property(name: str) -> bool:
    """Whether librdkafka property `name` holds a secret (see SECRET_PROPERTY_WORDS)."""
    return any(word in name for word in SECRET_PROPERTY_WORDS)


def _check_client(client: Mapping[str, str | int | bool]) -> None:
    """Refuse what `[kafka.client]` may not set, and a secret given inline."""
    for name, value in client.items():
        why = RESERVED_CLIENT_PROPERTIES.get(name)
        if why is not None:
            raise ConfigError(client_key(name), f"cannot be set in kafka.client: {why}")
        if is_secret_property(name) and (
            not isinstance(value, str) or secret_reference(value) is None
        ):
            raise ConfigError(
                client_key(name),
                'a secret: must reference it ("env:VAR" or "secret:NAME"), never hold it',
            )


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
    "tls": TlsSettings,
    "ownership": OwnershipSettings,
    "rate_limit": RateLimitSettings,
    "aws": AwsSettings,
}


def load_settings(
    path: str | Path,
    env: Mapping[str, str] | None = None,
    *,
    fetch_secret: SecretFetcher | None = None,
) -> Settings:
    """Read and validate a TOML config; every problem names the offending key.
    `fetch_secret` reads "secret:NAME" references (`store.aws.read_secret`; without it
    such a reference is a ConfigError when resolved)."""
    text = read_text_file("<file>", path)  # a FIFO, a directory, not UTF-8: ConfigError
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{path} is not valid TOML: {exc}") from None
    return settings_from_dict(raw, os.environ if env is None else env, fetch_secret=fetch_secret)


def settings_from_dict(
    raw: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    fetch_secret: SecretFetcher | None = None,
) -> Settings:
    """Build Settings from parsed TOML, resolving `auth.token_env` through `env` and the
    tokens' references through `env` and `fetch_secret`. Kafka's references resolve when
    a client is built: from the process environment then, and through `fetch_secret`."""
    secrets = Secrets(env, fetch_secret)
    for name in raw:
        if name not in _SECTIONS and name != "push":
            raise ConfigError.unknown(name, "section", (*_SECTIONS, "push"))
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        if name == "auth":
            table = _resolve_token(table, env, secrets)
        if name in raw or name in ("kafka", "auth", "dead_letters"):
            sections[name] = _build(name, cls, table)
    sections["kafka"] = dataclasses.replace(sections["kafka"], secrets=Secrets(None, fetch_secret))
    sections["push"] = push_targets(raw.get("push"), Secrets(None, fetch_secret))
    return Settings(**sections)


def _resolve_token(
    table: dict[str, Any], env: Mapping[str, str], secrets: Secrets
) -> dict[str, Any]:
    table = dict(table)
    var = table.pop("token_env", None)
    if var is None:
        return _resolve_named_tokens(table, secrets)
    if "token" in table:
        raise ConfigError("auth.token_env", "give either token or token_env, not both")
    if not isinstance(var, str):
        raise ConfigError("auth.token_env", "must be a string naming an environment variable")
    if not env.get(var):
        raise ConfigError("auth.token_env", f"environment variable {var} is not set")
    table["token"] = env[var]
    return _resolve_named_tokens(table, secrets)


def _resolve_named_tokens(table: dict[str, Any], secrets: Secrets) -> dict[str, Any]:
    tokens = table.get("tokens")
    if tokens is None:
        return table
    if not isinstance(tokens, dict) or not all(isinstance(v, str) for v in tokens.values()):
        raise ConfigError("auth.tokens", "must be a table of name = token strings")
    resolved = {name: secrets(f"auth.tokens.{name}", value) for name, value in tokens.items()}
    return {**table, "tokens": resolved}


def _build(section: str, cls: type[Any], table: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("config_key", True)}
    for key in table:
        if key not in known:
            raise ConfigError.unknown(f"{section}.{key}", "key", list(known))
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
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, "must be a list of strings")
        return tuple(value)
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
    shown = "(value hidden)" if key in _SECRET_KEYS else repr(value)  # errors get printed
    raise ConfigError(key, f"must be {hint.__name__}, got {type(value).__name__} {shown}")


_SECRET_KEYS = frozenset({"auth.token", "kafka.sasl_password"})
"""Keys whose values an error message must not quote."""


numeric_settings()  # a numeric field declared without Bounds fails here, at import
