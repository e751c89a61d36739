"""One frozen, validated settings object, built once at the edge from a TOML file.

`Settings` holds one frozen dataclass per section (config/sections.py, which lists
every key) and the `[[push]]` targets (config/push.py); the loader (config/loader.py)
builds it from a file, the environment and the secrets it references.

Every number is checked here, once, for its type (a TOML `true` is not a number), for
finiteness and for a range whose upper bound is what the field feeds can hold (a uint32
on the wire, a C int in gRPC, ...): each numeric field carries its `Bounds`
(config/bounds.py), and a numeric field without them fails at import. `kafka.client` may
not set what the proxy's guarantees rest on (`RESERVED_CLIENT_PROPERTIES`,
config/validation.py), and holds secrets only by reference.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from triage_proxy.config.bounds import Bounds, check_number, numeric_kind
from triage_proxy.config.push import PushTargetSettings
from triage_proxy.config.secrets import secret_reference
from triage_proxy.config.sections import (
    LB_SCHEMES,
    ORDERINGS,
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    AuthSettings,
    AwsSettings,
    CommitSettings,
    DeadLetterSettings,
    DeliverySettings,
    KafkaSettings,
    OwnershipSettings,
    RateLimitSettings,
    RetrySettings,
    ServerSettings,
    ShutdownSettings,
    TlsSettings,
    WindowSettings,
)
from triage_proxy.config.validation import (
    bootstrap_problem,
    check_client,
    group_problem,
    host_problem,
    port_overflow,
    region_problem,
    slot_port,
    table_problem,
    token_problem,
    topic_problem,
    url_problem,
)
from triage_proxy.errors import ConfigError


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
                check_number(key, value, kind, bounds)
        check_client(self.kafka.client)
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
            (key, port_overflow(key, base, last))
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
    A numeric field declared without bounds (`bounded`, `duration`) is a bug: TypeError,
    raised at import (see the end of this module)."""
    found: dict[str, tuple[type, Bounds]] = {}
    for section in dataclasses.fields(Settings):
        cls = typing.get_type_hints(Settings)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue  # `push`, a list of tables, checks its own numbers (config/push.py)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = numeric_kind(hints[f.name])
            if kind is None:
                continue
            bounds = f.metadata.get("bounds")
            if not isinstance(bounds, Bounds):
                raise TypeError(f"{section.name}.{f.name} is numeric but has no Bounds")
            found[f"{section.name}.{f.name}"] = (kind, bounds)
    return found


numeric_settings()  # a numeric field declared without Bounds fails here, at import
