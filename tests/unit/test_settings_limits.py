"""Every numeric setting is refused when NaN, infinite, a bool or out of its range, and
`[kafka.client]` cannot set what the proxy's guarantees rest on.

The field list is generated from the Settings dataclasses, so a new numeric field is walked
without being listed here (and cannot be declared without bounds at all)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import UINT32_MAX
from triage_proxy.config.bounds import MIN_FRAME_BYTES, Bounds
from triage_proxy.config.loader import load_settings, settings_from_dict
from triage_proxy.config.sections import KafkaSettings
from triage_proxy.config.settings import Settings, numeric_settings
from triage_proxy.config.validation import RESERVED_CLIENT_PROPERTIES
from triage_proxy.errors import ConfigError
from triage_proxy.kafka.assignment import STRATEGY, Assignment
from triage_proxy.kafka.client import ConfluentPartition
from triage_proxy.pipeline.dispatch import FRAME_OVERHEAD_BYTES

MINIMAL: dict[str, dict[str, Any]] = {
    "kafka": {"bootstrap_servers": "b:9092", "topic": "orders", "group_id": "g"},
    "auth": {"token": "unit-test-token-0123"},
    "dead_letters": {"table": "dlq"},
}


def raw_with(key: str, value: object, **companions: object) -> dict[str, dict[str, Any]]:
    """MINIMAL plus `section.name = value` (and other keys of the same section)."""
    section, name = key.split(".")
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    raw.setdefault(section, {}).update({name: value, **companions})
    return raw


def numeric_fields_by_type() -> set[str]:
    """Every int or float field (optional or not) of every section, by its type alone."""
    found = set()
    for section in dataclasses.fields(Settings):
        cls = typing.get_type_hints(Settings)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue  # [[push]] tables check their own numbers (test_push_settings.py)
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) in (types.UnionType, typing.Union):
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            if hint in (int, float):
                found.add(f"{section.name}.{name}")
    return found


NUMERIC = numeric_settings()


def test_every_numeric_field_is_walked() -> None:
    assert set(NUMERIC) == numeric_fields_by_type()
    assert len(NUMERIC) >= 26  # a floor: removing a numeric setting should be deliberate


def too_large(kind: type, bounds: Bounds) -> float:
    return bounds.hi + 1 if kind is int else math.nextafter(bounds.hi, math.inf)


def below(kind: type, bounds: Bounds) -> float:
    if bounds.above:
        return bounds.lo
    return bounds.lo - 1 if kind is int else math.nextafter(bounds.lo, -math.inf)


def bad_values(kind: type, bounds: Bounds) -> list[object]:
    values: list[object] = [math.nan, math.inf, -math.inf, -1, True, too_large(kind, bounds)]
    values.append(below(kind, bounds))
    if not bounds.holds(0):
        values.append(0)
    return list({(type(v), repr(v)): v for v in values}.values())  # True == 1, yet both


BAD = [
    pytest.param(key, value, id=f"{key}={value!r}")
    for key, (kind, bounds) in NUMERIC.items()
    for value in bad_values(kind, bounds)
]


@pytest.mark.parametrize(("key", "value"), BAD)
def test_bad_number_is_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(raw_with(key, value), {})
    assert info.value.key == key
    assert key in str(info.value)


def valid_edges(key: str, kind: type, bounds: Bounds) -> list[tuple[float, dict[str, object]]]:
    """(value, other keys of its section) at each end of the range, and 0 when allowed."""
    lo = math.nextafter(bounds.lo, math.inf) if bounds.above else bounds.lo
    edges: list[tuple[float, dict[str, object]]] = [(kind(lo), {}), (kind(bounds.hi), {})]
    if key == "ownership.renew_interval_s":  # must stay below lease_s
        edges[1] = (math.nextafter(bounds.hi, 0), {"lease_s": bounds.hi})
    if bounds.holds(0):
        edges.append((kind(0), {}))
    return edges


EDGES = [
    pytest.param(key, value, extra, id=f"{key}={value!r}")
    for key, (kind, bounds) in NUMERIC.items()
    for value, extra in valid_edges(key, kind, bounds)
]


@pytest.mark.parametrize(("key", "value", "extra"), EDGES)
def test_edge_values_load(key: str, value: float, extra: dict[str, object]) -> None:
    raw = raw_with(key, value, **extra)
    if key == "kafka.partitions":  # port + partition must stay a port: free ports
        raw["server"] = {"port": 0, "http_port": 0}
    settings = settings_from_dict(raw, {})
    section, name = key.split(".")
    assert getattr(getattr(settings, section), name) == value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("delivery.ack_deadline_s", math.nan),
        ("delivery.ack_deadline_s", math.inf),
        ("delivery.ack_deadline_s", 5000000.0),
        ("delivery.max_attempts", 4294967296),
        ("retry.multiplier", math.nan),
        ("commit.interval_s", math.nan),
        ("rate_limit.messages_per_s", math.nan),
        ("server.max_frame_bytes", 3000000000),
        ("server.max_frame_bytes", 64 * 1024),
        ("server.max_frame_bytes", 1000),
        ("dead_letters.flush_interval_ms", -5),
        ("dead_letters.retry_max_s", -1.0),
        ("dead_letters.ttl_days", -7.0),
        ("dead_letters.notify_interval_s", 0),
    ],
)
def test_the_reported_values_are_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        settings_from_dict(raw_with(key, value), {})


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf", "+nan"])
def test_toml_nan_and_inf_literals_are_refused(tmp_path: Path, literal: str) -> None:
    path = tmp_path / "triage.toml"
    path.write_text(
        '[kafka]\nbootstrap_servers = "b"\ntopic = "t"\ngroup_id = "g"\n'
        '[auth]\ntoken = "unit-test-token-0123"\n[dead_letters]\ntable = "dlq"\n'
        f"[delivery]\nack_deadline_s = {literal}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.key == "delivery.ack_deadline_s"
    assert "finite" in info.value.problem


def test_the_wire_fields_hold_the_largest_values() -> None:
    """The bounds are the wire's: at the top of the range the Welcome frame still encodes."""
    top = settings_from_dict(
        raw_with(
            "delivery.ack_deadline_s",
            NUMERIC["delivery.ack_deadline_s"][1].hi,
            max_attempts=NUMERIC["delivery.max_attempts"][1].hi,
        ),
        {},
    )
    welcome = pb.Welcome(
        ack_deadline_ms=int(top.delivery.ack_deadline_s * 1000),
        max_attempts=top.delivery.max_attempts,
    )
    assert pb.Welcome.FromString(welcome.SerializeToString()).max_attempts == UINT32_MAX
    with pytest.raises(ValueError, match="out of range"):
        pb.Welcome(max_attempts=UINT32_MAX + 1)
    lowest = settings_from_dict(raw_with("delivery.ack_deadline_s", 0.001), {})
    assert int(lowest.delivery.ack_deadline_s * 1000) == 1  # never 0 ms on the wire


def test_the_smallest_frame_leaves_room_for_a_record() -> None:
    assert MIN_FRAME_BYTES - FRAME_OVERHEAD_BYTES >= 64 * 1024


def test_a_settings_built_in_code_is_checked_too() -> None:
    """The checks live in Settings itself, not only in the TOML path."""
    base = settings_from_dict(MINIMAL, {})
    with pytest.raises(ConfigError, match=r"delivery\.max_attempts"):
        dataclasses.replace(
            base, delivery=dataclasses.replace(base.delivery, max_attempts=UINT32_MAX + 1)
        )
    with pytest.raises(ConfigError, match=r"retry\.multiplier"):
        dataclasses.replace(base, retry=dataclasses.replace(base.retry, multiplier=math.nan))
    with pytest.raises(ConfigError, match=r"window\.max_messages"):
        dataclasses.replace(base, window=dataclasses.replace(base.window, max_messages=True))


# [kafka.client]


def client(**props: object) -> dict[str, dict[str, Any]]:
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    raw["kafka"]["client"] = props
    return raw


def test_auto_commit_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(client(**{"enable.auto.commit": True}), {})
    assert info.value.key == 'kafka.client."enable.auto.commit"'
    assert 'kafka.client."enable.auto.commit"' in str(info.value)
    assert "commit.interval_s" in str(info.value)


@pytest.mark.parametrize("name", sorted(RESERVED_CLIENT_PROPERTIES))
def test_every_reserved_property_is_refused(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(client(**{name: "x"}), {})
    assert info.value.key == f'kafka.client."{name}"'


def test_every_property_the_proxy_sets_is_reserved() -> None:
    """One list: whatever kafka/client.py sets on its consumer, [kafka.client] cannot override."""
    settings = settings_from_dict(MINIMAL, {})
    own = ConfluentPartition(settings.kafka, 0)._config()
    assert set(own) <= set(RESERVED_CLIENT_PROPERTIES), set(own) - set(RESERVED_CLIENT_PROPERTIES)


def test_fetch_wait_is_a_setting_of_its_own() -> None:
    """kafka.fetch_wait_ms reaches librdkafka (default 100 ms); [kafka.client] is pointed
    to it; a wait outside librdkafka's range is refused at load."""
    assert (
        ConfluentPartition(settings_from_dict(MINIMAL, {}).kafka, 0)._config()["fetch.wait.max.ms"]
        == 100
    )
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    raw["kafka"]["fetch_wait_ms"] = 5
    config = ConfluentPartition(settings_from_dict(raw, {}).kafka, 0)._config()
    assert config["fetch.wait.max.ms"] == 5
    with pytest.raises(ConfigError) as info:
        settings_from_dict(client(**{"fetch.wait.max.ms": 5}), {})
    assert "kafka.fetch_wait_ms" in str(info.value)
    raw["kafka"]["fetch_wait_ms"] = 0
    with pytest.raises(ConfigError, match=r"kafka\.fetch_wait_ms"):
        settings_from_dict(raw, {})


def test_extras_never_override_the_proxy_even_unvalidated() -> None:
    """A KafkaSettings built in code skips the loader; the merge order still protects."""
    kafka = KafkaSettings(
        "b:9092",
        "orders",
        "g",
        client={"enable.auto.commit": True, "bootstrap.servers": "evil:1", "group.id": "x"},
    )
    config = ConfluentPartition(kafka, 0)._config()
    assert config["enable.auto.commit"] is False
    assert config["bootstrap.servers"] == "b:9092"
    assert config["group.id"] == "g"


def test_the_membership_strategy_is_the_proxys_own_even_unvalidated() -> None:
    """`partition.assignment.strategy` is refused at load, and a KafkaSettings built in
    code cannot set it either: the membership's callbacks take whole assignments with
    assign(), which librdkafka refuses under a cooperative strategy. The session timeout
    and heartbeat are the group properties [kafka.client] may set, and its client.id
    prefixes the member's."""
    with pytest.raises(ConfigError, match="assigns its partitions itself"):
        settings_from_dict(client(**{"partition.assignment.strategy": "cooperative-sticky"}), {})
    kafka = KafkaSettings(
        "b:9092",
        "orders",
        "g",
        client={"partition.assignment.strategy": "cooperative-sticky", "session.timeout.ms": 30000},
    )
    config = Assignment(kafka, "member")._config()
    assert config["partition.assignment.strategy"] == STRATEGY == "roundrobin"
    assert config["session.timeout.ms"] == 30000
    named = KafkaSettings(
        "b:9092",
        "orders",
        "g",
        client={"client.id": "orders-svc", "heartbeat.interval.ms": 3000, "linger.ms": 7},
    )
    config = Assignment(named, "m1")._config()
    assert config["client.id"] == "orders-svc-m1"  # still one id per fleet process
    assert config["heartbeat.interval.ms"] == 3000
    assert config["linger.ms"] == 7
    assert Assignment(kafka, "m1")._config()["client.id"] == "triage-proxy-m1"
    own = Assignment(settings_from_dict(MINIMAL, {}).kafka, "member")._config()
    # The session timeout is [kafka.client]'s to set; these two the proxy applies last.
    unreserved = {"session.timeout.ms", "client.id", "heartbeat.interval.ms"}
    assert set(own) - unreserved <= set(RESERVED_CLIENT_PROPERTIES)


def test_inline_sasl_password_is_refused_pointing_to_its_key() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(client(**{"sasl.password": "hunter2"}), {})
    assert info.value.key == 'kafka.client."sasl.password"'
    assert "kafka.sasl_password" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "ssl.key.password",
        "ssl.keystore.password",
        "ssl.key.pem",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.passphrase",
    ],
)
def test_other_secrets_only_by_reference(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(client(**{name: "hunter2"}), {})
    assert info.value.key == f'kafka.client."{name}"'
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError):
        settings_from_dict(client(**{name: 1234}), {})
    settings = settings_from_dict(client(**{name: "env:KAFKA_SECRET"}), {})
    assert settings.kafka.client[name] == "env:KAFKA_SECRET"  # resolved only for the client
    config = settings.kafka.librdkafka_config(lambda key, ref: f"{key}={ref}")
    assert config[name] == f'kafka.client."{name}"=env:KAFKA_SECRET'


def test_a_client_secret_reference_resolves_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAFKA_KEY_PASSWORD", "s3cret")
    settings = settings_from_dict(client(**{"ssl.key.password": "env:KAFKA_KEY_PASSWORD"}), {})
    assert settings.kafka.librdkafka_config()["ssl.key.password"] == "s3cret"
    monkeypatch.delenv("KAFKA_KEY_PASSWORD")
    with pytest.raises(ConfigError, match=r'kafka\.client\."ssl\.key\.password"'):
        settings.kafka.librdkafka_config()


def test_ordinary_extras_pass_through() -> None:
    settings = settings_from_dict(
        client(**{"client.id": "triage-orders", "fetch.min.bytes": 1, "check.crcs": True}), {}
    )
    config = settings.kafka.librdkafka_config()
    assert config["client.id"] == "triage-orders"
    assert config["fetch.min.bytes"] == 1
    assert config["check.crcs"] is True


# `triage config check` and the proxy read through the same loader.


def test_config_check_exits_2_naming_a_nan_key(tmp_path: Path) -> None:
    from triage_cli.main import app

    path = tmp_path / "triage.toml"
    path.write_text(
        '[kafka]\nbootstrap_servers = "b"\ntopic = "t"\ngroup_id = "g"\n'
        '[auth]\ntoken = "unit-test-token-0123"\n[dead_letters]\ntable = "dlq"\n'
        "[retry]\nmultiplier = nan\n"
    )
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == 2
    assert "retry.multiplier" in result.stderr
    assert "finite" in result.stderr


def test_config_check_exits_2_naming_a_reserved_client_property(tmp_path: Path) -> None:
    from triage_cli.main import app

    path = tmp_path / "triage.toml"
    path.write_text(
        '[kafka]\nbootstrap_servers = "b"\ntopic = "t"\ngroup_id = "g"\n'
        '[kafka.client]\n"enable.auto.commit" = true\n"enable.auto.offset.store" = true\n'
        '[auth]\ntoken = "unit-test-token-0123"\n[dead_letters]\ntable = "dlq"\n'
    )
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == 2
    assert 'kafka.client."enable.auto.commit"' in result.stderr


def test_the_configuration_reference_states_every_range() -> None:
    """The configuration reference (generated, docs/reference/configuration.md) lists each
    numeric key with the range enforced here."""
    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"
    rows = {line.split(" | ")[0]: line for line in page.read_text().splitlines()}
    for key, (kind, bounds) in NUMERIC.items():
        in_words = bounds.describe(kind).partition(" (")[0]
        assert f" {in_words} " in rows.get(f"| `{key}`", ""), key
