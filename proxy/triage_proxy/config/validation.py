"""The checks of single values the settings hold, each a pure function: the `*_problem`
functions say why a name, host or URL is not one (or None), the `[kafka.client]` rules
refuse what the proxy's guarantees rest on (`RESERVED_CLIENT_PROPERTIES`) and secrets
given inline, and the port helpers compute the port of one slot.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from triage_proxy.config.bounds import MAX_PORT
from triage_proxy.config.secrets import secret_reference
from triage_proxy.errors import ConfigError

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


def slot_port(key: str, base: int, slot: int) -> int:
    """`base + slot`, the port of one slot (0 stays 0: a free port). Over MAX_PORT is a
    ConfigError naming `key`: the OS would bind another port than the one configured."""
    problem = port_overflow(key, base, slot)
    if problem is not None:
        raise ConfigError(key, problem)
    return base + slot if base else 0


def port_overflow(key: str, base: int, slot: int) -> str | None:
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


def check_client(client: Mapping[str, str | int | bool]) -> None:
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
