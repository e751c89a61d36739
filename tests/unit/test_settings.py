from __future__ import annotations

from pathlib import Path

import pytest

from triage_proxy.config.loader import load_settings, settings_from_dict
from triage_proxy.config.sections import DEFAULT_WINDOW_MESSAGES
from triage_proxy.errors import ConfigError

MINIMAL = {
    "kafka": {"bootstrap_servers": "b:9092", "topic": "orders", "group_id": "g"},
    "auth": {"token": "unit-test-token-0123"},
    "dead_letters": {"table": "dlq"},
}


def with_(section: str, **values: object) -> dict[str, dict[str, object]]:
    raw: dict[str, dict[str, object]] = {k: dict(v) for k, v in MINIMAL.items()}
    raw.setdefault(section, {}).update(values)
    return raw


def test_minimal_config_gets_defaults() -> None:
    settings = settings_from_dict(MINIMAL, {})
    assert settings.kafka.topic == "orders"
    assert settings.window.max_messages == DEFAULT_WINDOW_MESSAGES
    assert settings.dead_letters.endpoint_url is None


def test_token_from_environment() -> None:
    raw = {**MINIMAL, "auth": {"token_env": "TRIAGE_TOKEN"}}
    assert (
        settings_from_dict(raw, {"TRIAGE_TOKEN": "t0k-0123456789abcdef"}).auth.token
        == "t0k-0123456789abcdef"
    )


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (with_("window", max_mesages=3), "window.max_mesages"),
        (with_("window", max_messages="10"), "window.max_messages"),
        (with_("window", max_messages=True), "window.max_messages"),
        (with_("window", max_messages=0), "window.max_messages"),
        (with_("server", port=70000), "server.port"),
        (with_("dead_letters", batch_size=26), "dead_letters.batch_size"),
        (with_("delivery", ack_deadline_s=-1), "delivery.ack_deadline_s"),
        ({**MINIMAL, "kafka": {"topic": "t", "group_id": "g"}}, "kafka.bootstrap_servers"),
        ({**MINIMAL, "extra": {}}, "extra"),
        ({**MINIMAL, "auth": {"token_env": "MISSING"}}, "auth.token_env"),
        ({**MINIMAL, "auth": {"token": "a", "token_env": "X"}}, "auth.token_env"),
        ({**MINIMAL, "window": 3}, "window"),
        ({**MINIMAL, "auth": {"token": "short"}}, "auth.tokens.default"),
        ({**MINIMAL, "auth": {"tokens": {"a": "env:NOPE"}}}, "auth.tokens.a"),
        ({**MINIMAL, "auth": {"tokens": {"a": 5}}}, "auth.tokens"),
        ({**MINIMAL, "auth": {"token": "t" * 20, "revoked": ["default"]}}, "auth.tokens"),
        ({**MINIMAL, "auth": {"token": "t" * 20, "revoked": "default"}}, "auth.revoked"),
        (with_("kafka", security_protocol="TLS"), "kafka.security_protocol"),
        (with_("kafka", sasl_mechanism="PLAIN"), "kafka.sasl_mechanism"),
        (with_("kafka", sasl_password="hunter2"), "kafka.sasl_password"),
        (with_("kafka", sasl_password="env:"), "kafka.sasl_password"),
        (with_("tls", cert_file="c.pem"), "tls.key_file"),
        (with_("tls", client_ca_file="ca.pem"), "tls.client_ca_file"),
        (with_("ownership", lease_s=0), "ownership.lease_s"),
        (with_("ownership", lease_s=3, renew_interval_s=3), "ownership.renew_interval_s"),
        (with_("rate_limit", messages_per_s=0), "rate_limit.messages_per_s"),
        (with_("server", http_port=-1), "server.http_port"),
    ],
)
def test_bad_values_name_the_key(raw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(raw, {})
    assert info.value.key == key
    assert key in str(info.value)


@pytest.mark.parametrize(
    ("raw", "key", "problem"),
    [
        (with_("kafka", group_idd="g"), "kafka.group_idd", "unknown key (did you mean 'group_id'?"),
        (with_("window", max_mesages=3), "window.max_mesages", "unknown key (did you mean 'max_m"),
        ({**MINIMAL, "kafak": {}}, "kafak", "unknown section (did you mean 'kafka'? known: kafka,"),
        (with_("kafka", colour="red"), "kafka.colour", "unknown key (known: bootstrap_servers,"),
        ({**MINIMAL, "extra": {}}, "extra", "unknown section (known: kafka, server,"),
    ],
)
def test_an_unknown_name_lists_the_known_ones_and_the_one_it_looks_like(
    raw: dict[str, object], key: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(raw, {})
    assert info.value.key == key
    assert info.value.problem.startswith(problem), info.value.problem


def test_malformed_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "triage.toml"
    path.write_text("[kafka\nbootstrap_servers = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_listen_address_per_partition() -> None:
    settings = settings_from_dict(with_("server", port=9000), {})
    assert settings.listen_address(3) == "127.0.0.1:9003"


def test_named_tokens_resolve_references_and_skip_revoked() -> None:
    raw = {
        **MINIMAL,
        "auth": {
            "tokens": {"orders": "orders-token-0123456789", "billing": "env:BILLING"},
            "revoked": ["orders"],
        },
    }
    settings = settings_from_dict(raw, {"BILLING": "billing-token-0123456789"})
    assert settings.auth.active() == {"billing": "billing-token-0123456789"}


def test_kafka_password_is_resolved_only_for_the_client() -> None:
    raw = with_(
        "kafka",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password="env:KAFKA_PASSWORD",
    )
    settings = settings_from_dict(raw, {})
    assert settings.kafka.sasl_password == "env:KAFKA_PASSWORD"
    config = settings.kafka.librdkafka_config(lambda key, ref: f"resolved({ref})")
    assert config["sasl.password"] == "resolved(env:KAFKA_PASSWORD)"
    assert config["security.protocol"] == "sasl_ssl"
    assert config["bootstrap.servers"] == "b:9092"


def test_http_address_per_partition() -> None:
    settings = settings_from_dict(with_("server", http_port=9800), {})
    assert settings.server.http_address(2) == ("127.0.0.1", 9802)
    assert settings_from_dict(with_("server", http_port=0), {}).server.http_address(2) == (
        "127.0.0.1",
        0,
    )
