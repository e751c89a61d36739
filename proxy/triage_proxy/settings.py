"""One frozen, validated settings object, built once at the edge from a TOML file.

Nothing below the CLI reads files or the environment: `load_settings` resolves
`token_env` and friends here and hands the proxy a complete `Settings`.

    [kafka]        bootstrap_servers, topic, group_id, fetch_batch, partitions, security_protocol,
                   sasl_mechanism, sasl_username, sasl_password (a reference: "env:VAR" or
                   "secret:NAME", never inline), client (librdkafka extras)
    [server]       host, port (partition p listens on port + p), max_frame_bytes,
                   http_port (metrics/health/status; partition p on http_port + p)
    [auth]         token | token_env, tokens (name -> token or "env:VAR"/"secret:NAME"),
                   revoked (names refused even though listed)
    [tls]          cert_file, key_file, client_ca_file (set: client certificates required)
    [ownership]    enabled, lease_s, renew_interval_s
    [rate_limit]   messages_per_s, bytes_per_s
    [aws]          image, certificate_arn, vpc_id, subnet_ids, scheme, client_cidr,
                   assign_public_ip, cpu, memory_mb, log_retention_days, stack_name,
                   tls_listeners
                   (read only by `triage deploy --target aws`)
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
from collections.abc import Callable, Mapping
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
DEFAULT_HTTP_PORT = 9700
DEFAULT_LEASE_S = 10.0
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
DEFAULT_TOKEN_NAME = "default"
DEFAULT_AWS_CPU = 512
DEFAULT_AWS_MEMORY_MB = 1024
DEFAULT_LOG_RETENTION_DAYS = 30
LB_SCHEMES = ("internal", "internet-facing")


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
    partitions: int | None = None
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
    """Extra librdkafka properties, passed through."""

    def librdkafka_config(self, resolve: SecretResolver | None = None) -> dict[str, Any]:
        """Connection properties for a confluent-kafka client, secrets resolved now."""
        config: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol.lower(),
        }
        if self.sasl_mechanism:
            config["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            config["sasl.username"] = self.sasl_username
        if self.sasl_password:
            config["sasl.password"] = (resolve or resolve_secret)(
                "kafka.sasl_password", self.sasl_password
            )
        config.update(self.client)
        return config


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    """Interface the gRPC listener binds."""
    port: int = DEFAULT_PORT
    """Base port: the proxy for partition p listens on port + p."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest gRPC frame either side may send; bounds one oversized message."""
    http_port: int | None = DEFAULT_HTTP_PORT
    """Base port of the HTTP endpoint (/metrics, /healthz, /readyz, /status): partition p
    serves on http_port + p; 0 picks a free port; None turns it off."""

    def http_address(self, partition: int) -> tuple[str, int] | None:
        """(host, port) the HTTP endpoint for `partition` binds, or None when off."""
        if self.http_port is None:
            return None
        return self.host, self.http_port + partition if self.http_port else 0


@dataclass(frozen=True)
class AuthSettings:
    token: str | None = None
    """The unnamed token (named "default"), resolved from token_env if given."""
    tokens: Mapping[str, str] = field(default_factory=dict)
    """Named tokens, one per consumer app, so one can be revoked alone. Values are the
    token or a reference ("env:VAR", "secret:NAME"), resolved at load."""
    revoked: tuple[str, ...] = ()
    """Names whose tokens are refused (keeps the entry, documents the revocation)."""

    def active(self) -> dict[str, str]:
        """name -> token for every token a call may present."""
        named = dict(self.tokens)
        if self.token:
            named.setdefault(DEFAULT_TOKEN_NAME, self.token)
        return {name: tok for name, tok in named.items() if name not in self.revoked}


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
    lease_s: float = DEFAULT_LEASE_S
    """How long a lease lives without renewal; a standby takes over after it lapses."""
    renew_interval_s: float | None = None
    """How often the holder renews (default: lease_s / 3)."""

    @property
    def renew_every_s(self) -> float:
        return self.renew_interval_s or self.lease_s / 3


@dataclass(frozen=True)
class AwsSettings:
    """How `triage deploy --target aws` lays out the stack; the proxy never reads it."""

    image: str | None = None
    """Container image of the proxy (built from infra/Dockerfile); --image overrides."""
    certificate_arn: str | None = None
    """ACM certificate the TLS listener presents (required to deploy)."""
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
    cpu: int = DEFAULT_AWS_CPU
    """Fargate CPU units per proxy task (256, 512, 1024, ...)."""
    memory_mb: int = DEFAULT_AWS_MEMORY_MB
    """Fargate memory per proxy task, MiB (must suit cpu)."""
    log_retention_days: int = DEFAULT_LOG_RETENTION_DAYS
    """How long CloudWatch keeps the proxies' logs."""
    stack_name: str | None = None
    """CloudFormation stack name (None: derived from the topic and group)."""
    tls_listeners: bool = True
    """False leaves the NLB's TLS listeners out: only for an endpoint whose CloudFormation
    cannot create them (moto server, in the tests); a real deployment needs them."""


@dataclass(frozen=True)
class RateLimitSettings:
    messages_per_s: float | None = None
    """Most messages delivered per second by this proxy (None: no cap)."""
    bytes_per_s: float | None = None
    """Most payload bytes delivered per second by this proxy (None: no cap)."""


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
    tls: TlsSettings = field(default_factory=TlsSettings)
    ownership: OwnershipSettings = field(default_factory=OwnershipSettings)
    rate_limit: RateLimitSettings = field(default_factory=RateLimitSettings)
    aws: AwsSettings = field(default_factory=AwsSettings)

    def __post_init__(self) -> None:
        _positive("kafka.fetch_batch", self.kafka.fetch_batch)
        if self.kafka.partitions is not None:
            _positive("kafka.partitions", self.kafka.partitions)
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
        if not self.auth.active():
            raise ConfigError("auth.tokens", "no usable token: set auth.token or auth.tokens")
        for name, tok in self.auth.active().items():
            if len(tok) < 16:
                raise ConfigError(f"auth.tokens.{name}", "must be at least 16 characters")
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
        if self.server.http_port is not None and not 0 <= self.server.http_port <= 65535:
            raise ConfigError("server.http_port", "must be 0..65535")
        _positive("ownership.lease_s", self.ownership.lease_s)
        if not 0 < self.ownership.renew_every_s < self.ownership.lease_s:
            raise ConfigError("ownership.renew_interval_s", "must be > 0 and < lease_s")
        for key in ("messages_per_s", "bytes_per_s"):
            limit = getattr(self.rate_limit, key)
            if limit is not None:
                _positive(f"rate_limit.{key}", limit)
        if self.aws.scheme not in LB_SCHEMES:
            raise ConfigError("aws.scheme", f"must be one of {', '.join(LB_SCHEMES)}")
        _positive("aws.cpu", self.aws.cpu)
        _positive("aws.memory_mb", self.aws.memory_mb)
        _positive("aws.log_retention_days", self.aws.log_retention_days)

    def listen_address(self, partition: int) -> str:
        """host:port the proxy for `partition` binds (port 0 picks a free one)."""
        port = self.server.port + partition if self.server.port else 0
        return f"{self.server.host}:{port}"


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be > 0, got {value}")


SecretResolver = Callable[[str, str], str]
"""(config key, reference) -> secret value; raises ConfigError naming the key."""


def secret_reference(value: str) -> tuple[str, str] | None:
    """("env" | "secret", name) when `value` references a secret, else None."""
    kind, _, name = value.partition(":")
    return (kind, name) if kind in ("env", "secret") and name else None


def resolve_secret(key: str, reference: str, env: Mapping[str, str] | None = None) -> str:
    """Resolve "env:VAR" from the environment or "secret:NAME" from AWS Secrets Manager
    (standard credential chain and AWS_ENDPOINT_URL); anything else is returned as is."""
    kind, name = secret_reference(reference) or ("", "")
    if kind == "env":
        value = (os.environ if env is None else env).get(name)
        if not value:
            raise ConfigError(key, f"environment variable {name} is not set")
        return value
    if kind == "secret":
        import boto3

        from triage_proxy.table.aws import aws_errors

        with aws_errors(f"reading secret {name!r}", lambda why: ConfigError(key, why)):
            client = boto3.client("secretsmanager")
            found = client.get_secret_value(SecretId=name)
        return str(found["SecretString"])
    return reference


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
        return _resolve_named_tokens(table, env)
    if "token" in table:
        raise ConfigError("auth.token_env", "give either token or token_env, not both")
    if not isinstance(var, str):
        raise ConfigError("auth.token_env", "must be a string naming an environment variable")
    if not env.get(var):
        raise ConfigError("auth.token_env", f"environment variable {var} is not set")
    table["token"] = env[var]
    return _resolve_named_tokens(table, env)


def _resolve_named_tokens(table: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    tokens = table.get("tokens")
    if tokens is None:
        return table
    if not isinstance(tokens, dict) or not all(isinstance(v, str) for v in tokens.values()):
        raise ConfigError("auth.tokens", "must be a table of name = token strings")
    resolved = {
        name: resolve_secret(f"auth.tokens.{name}", value, env) for name, value in tokens.items()
    }
    return {**table, "tokens": resolved}


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
