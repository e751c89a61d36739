"""`[[push]]`: the endpoints the proxy delivers to itself, one table per target.

    [[push]]
    name = "orders-http"                 # unique; in logs, status and metrics
    url = "https://orders.internal/kafka"
    batch = 500                          # records per request (1: CloudEvents binary mode)
    max_batch_bytes = 1048576
    timeout_s = 10                       # a request's deadline (its records' ack deadline)
    min_concurrency = 1                  # the adaptive limit's floor ...
    max_concurrency = 64                 # ... and ceiling
    nack_statuses = [400, 422]           # answers that dead-letter at once
    token = "env:ORDERS_PUSH_TOKEN"      # Authorization: Bearer <token>, by reference
    signing_secret = "secret:orders-hmac"  # triage-signature, by reference
    ca_file = "ca.pem"                   # https: trust this CA (and cert_file/key_file:
                                         # present a client certificate)

    [[push]]
    name = "go-consumers"
    mode = "grpc"                        # the original Triage's consumers register ...
    registration = true                  # ... with GET /consumers on the HTTP port
    allow = ["10.0.0.0/8"]               # who may register (default: loopback, private)

Everything is checked here, once, with a message that names `push.<name>.<key>`; secrets
are references (`env:VAR`, `secret:NAME`) resolved by the loader like every other.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from triage_proxy.config.secrets import Secrets, secret_reference
from triage_proxy.errors import ConfigError

__all__ = ["MODES", "PushTargetSettings", "push_targets"]

MODES = ("http", "grpc")
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BATCH_BYTES = 1024 * 1024
MAX_BATCH_BYTES = 64 * 1024 * 1024
"""A request body's ceiling: what a receiver can be asked to hold at once."""
MAX_BATCH = 10_000
MIN_EVENT_BYTES = 100
"""The smallest a record's CloudEvent is in a batch (its attributes alone)."""
DEFAULT_MIN_CONCURRENCY = 1
DEFAULT_MAX_CONCURRENCY = 64
MAX_CONCURRENCY = 10_000
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_TIMEOUT_S = 3600.0
DEFAULT_NACK_STATUSES = (400, 422)
DEFAULT_ALLOW = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


@dataclass(frozen=True)
class PushTargetSettings:
    """One `[[push]]` table."""

    name: str
    """Unique name of the target: letters, digits, '-', '_', '.'."""
    url: str | None = None
    """http(s) URL the records are POSTed to (mode "http")."""
    mode: str = "http"
    """"http" (CloudEvents over HTTP) or "grpc" (the original Triage's consumers)."""
    batch: int = 1
    """Records per request at most; 1 sends one record per POST (binary mode)."""
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    """Bytes of a batched request's body at most (a larger record goes alone)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """A request's deadline; a timeout lowers the limit and uses an attempt of a lone record
    (a batch's records come back as suspects)."""
    min_concurrency: int = DEFAULT_MIN_CONCURRENCY
    """The adaptive limit never goes below this many requests in flight."""
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    """... nor above this many."""
    initial_concurrency: int | None = None
    """Where the limit starts (default: min(max_concurrency, max(min_concurrency, 8)))."""
    nack_statuses: tuple[int, ...] = DEFAULT_NACK_STATUSES
    """HTTP statuses that dead-letter the record at once."""
    content_type: str = "application/octet-stream"
    """The record value's media type (binary mode's Content-Type, a batch's datacontenttype)."""
    source: str | None = None
    """CloudEvents `source` (default: triage://<group>/<topic>)."""
    type: str = "dev.triage.kafka.record"
    """CloudEvents `type`."""
    token: str | None = None
    """Reference to the bearer token sent as Authorization (env:VAR or secret:NAME)."""
    signing_secret: str | None = None
    """Reference to the HMAC-SHA256 key of the triage-signature header."""
    ca_file: str | None = None
    """CA bundle that verifies an https endpoint (default: the system's)."""
    cert_file: str | None = None
    """Client certificate presented to an https endpoint (with key_file)."""
    key_file: str | None = None
    """Key of cert_file."""
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """Most bytes of a response body read; the connection is dropped past it."""
    registration: bool = False
    """mode "grpc": consumers register with GET /consumers on the HTTP port."""
    trust_forwarded_for: bool = False
    """mode "grpc": dial the first X-Forwarded-For address (behind a trusted proxy)."""
    allow: tuple[str, ...] = DEFAULT_ALLOW
    """mode "grpc": networks a consumer may register from."""
    secrets: Secrets = field(default=Secrets(), repr=False, compare=False)
    """How this process resolves `token` and `signing_secret` (set by the loader)."""

    def resolved(self, key: str) -> str | None:
        """The secret `token` or `signing_secret` references, read now (None: unset)."""
        reference = getattr(self, key)
        return None if reference is None else self.secrets(f"push.{self.name}.{key}", reference)

    @property
    def initial_limit(self) -> int:
        if self.initial_concurrency is not None:
            return self.initial_concurrency
        return min(self.max_concurrency, max(self.min_concurrency, 8))

    def __post_init__(self) -> None:
        key = f"push.{self.name}"
        if not self.name or not set(self.name) <= _NAME_CHARS or len(self.name) > 64:
            raise ConfigError("push.name", f"{self.name!r}: 1-64 letters, digits, '-', '_' or '.'")
        if self.mode not in MODES:
            raise ConfigError(
                f"{key}.mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}"
            )
        if self.mode == "http":
            if self.url is None:
                raise ConfigError(f"{key}.url", 'is required for mode "http"')
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(
                    f"{key}.url",
                    f"must be an http:// or https:// URL with a host, got {self.url!r}",
                )
            try:
                port = parts.port  # raises on a port over 65535
            except ValueError:
                port = -1
            if port is not None and not 1 <= port <= 65535:
                raise ConfigError(f"{key}.url", f"has a port outside 1-65535: {self.url!r}")
            if self.registration:
                raise ConfigError(f"{key}.registration", 'is for mode "grpc"')
        else:
            if self.url is not None:
                raise ConfigError(
                    f"{key}.url", 'mode "grpc" dials the consumers that register; give no url'
                )
            if not self.registration:
                raise ConfigError(
                    f"{key}.registration",
                    'mode "grpc" needs registration = true (consumers register themselves)',
                )
            if self.batch != 1:
                raise ConfigError(f"{key}.batch", 'mode "grpc" sends one record per call')
        _int_in(f"{key}.batch", self.batch, 1, MAX_BATCH)
        _int_in(f"{key}.max_batch_bytes", self.max_batch_bytes, 1024, MAX_BATCH_BYTES)
        _int_in(f"{key}.min_concurrency", self.min_concurrency, 1, MAX_CONCURRENCY)
        _int_in(f"{key}.max_concurrency", self.max_concurrency, 1, MAX_CONCURRENCY)
        _int_in(f"{key}.max_response_bytes", self.max_response_bytes, 1024, MAX_RESPONSE_BYTES)
        if self.batch * MIN_EVENT_BYTES > self.max_batch_bytes:
            raise ConfigError(
                f"{key}.batch",
                f"{self.batch} records never fit max_batch_bytes = {self.max_batch_bytes} (an "
                f"event takes at least {MIN_EVENT_BYTES} bytes): raise max_batch_bytes to "
                f"{self.batch * MIN_EVENT_BYTES} or more, or lower batch",
            )
        if self.min_concurrency > self.max_concurrency:
            raise ConfigError(
                f"{key}.min_concurrency",
                f"{self.min_concurrency} is above max_concurrency {self.max_concurrency}",
            )
        if self.initial_concurrency is not None and not (
            self.min_concurrency <= self.initial_concurrency <= self.max_concurrency
        ):
            raise ConfigError(
                f"{key}.initial_concurrency", "must be within [min_concurrency, max_concurrency]"
            )
        if not (0 < self.timeout_s <= MAX_TIMEOUT_S and math.isfinite(self.timeout_s)):
            raise ConfigError(f"{key}.timeout_s", f"must be > 0 and <= {MAX_TIMEOUT_S:g}")
        for status in self.nack_statuses:
            if not 400 <= status <= 599 or status in (429, 503):
                raise ConfigError(
                    f"{key}.nack_statuses",
                    f"{status}: only 4xx/5xx statuses, and not 429 or 503 (those mean overload)",
                )
        for secret_key in ("token", "signing_secret"):
            value = getattr(self, secret_key)
            if value is not None and secret_reference(value) is None:
                raise ConfigError(
                    f"{key}.{secret_key}",
                    'must reference the secret ("env:VAR" or "secret:NAME"), never hold it',
                )
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(f"{key}.key_file", "set cert_file and key_file together")
        for net in self.allow:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ConfigError(
                    f"{key}.allow", f"{net!r} is not a network (e.g. 10.0.0.0/8)"
                ) from None


def _int_in(key: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(key, f"must be a whole number from {lo} to {hi}, got {value!r}")


_KINDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "url": str,
    "mode": str,
    "batch": int,
    "max_batch_bytes": int,
    "timeout_s": (int, float),
    "min_concurrency": int,
    "max_concurrency": int,
    "initial_concurrency": int,
    "nack_statuses": list,
    "content_type": str,
    "source": str,
    "type": str,
    "token": str,
    "signing_secret": str,
    "ca_file": str,
    "cert_file": str,
    "key_file": str,
    "max_response_bytes": int,
    "registration": bool,
    "trust_forwarded_for": bool,
    "allow": list,
}


def push_targets(raw: object, secrets: Secrets) -> tuple[PushTargetSettings, ...]:
    """The `[[push]]` tables of a parsed config, checked; `secrets` resolves their
    references when a target is built."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError("push", "must be an array of tables: write [[push]] above each target")
    known = {f.name for f in fields(PushTargetSettings)} - {"secrets"}
    targets: list[PushTargetSettings] = []
    for index, table in enumerate(raw):
        targets.append(_target(index, table, known, secrets))
    names = [t.name for t in targets]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"push.{name}", "two [[push]] tables have this name")
    if sum(t.mode == "grpc" for t in targets) > 1:
        raise ConfigError("push", 'at most one [[push]] table may have mode "grpc"')
    return tuple(targets)


def _target(
    index: int, table: Mapping[str, Any], known: set[str], secrets: Secrets
) -> PushTargetSettings:
    name = table.get("name")
    label = f"push.{name}" if isinstance(name, str) and name else f"push[{index}]"
    if "name" not in table:
        raise ConfigError(f"{label}.name", "is required")
    values: dict[str, Any] = {}
    value: Any
    for key, value in table.items():
        if key not in known:
            raise ConfigError.unknown(f"{label}.{key}", "key", sorted(known))
        kind = _KINDS[key]
        if isinstance(value, bool) and kind is not bool:
            raise ConfigError(f"{label}.{key}", f"must be {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise ConfigError(
                f"{label}.{key}", f"must be {_kind_name(kind)}, got {type(value).__name__}"
            )
        value = table[key]  # as read (isinstance against a variable type narrows to object)
        if key == "nack_statuses":
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{label}.{key}", "must be a list of HTTP statuses")
            value = tuple(value)
        elif key == "allow":
            if not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{label}.{key}", "must be a list of networks")
            value = tuple(value)
        elif key == "timeout_s":
            value = float(value)
        values[key] = value
    return PushTargetSettings(**values, secrets=secrets)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if kind == (int, float):
        return "a number"
    return {str: "a string", int: "a whole number", bool: "true or false", list: "a list"}[
        kind  # type: ignore[index]
    ]
