"""`[[push]]` tables: every bad input is a ConfigError naming push.<name>.<key>."""

from __future__ import annotations

from typing import Any

import pytest

from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import ConfigError
from triage_proxy.push.targets import http_target

BASE: dict[str, Any] = {
    "kafka": {"bootstrap_servers": "127.0.0.1:9092", "topic": "orders", "group_id": "g"},
    "auth": {"token": "a-token-of-sixteen-chars"},
    "dead_letters": {"table": "dlq"},
}


def load(*targets: dict[str, Any]) -> Any:
    return settings_from_dict({**BASE, "push": list(targets)}, {"PUSH_TOKEN": "x" * 20})


def test_a_good_table_loads_with_its_defaults() -> None:
    (target,) = load({"name": "orders", "url": "https://example.internal/in"}).push
    assert (target.batch, target.min_concurrency, target.max_concurrency) == (1, 1, 64)
    assert target.initial_limit == 8
    assert target.nack_statuses == (400, 422)


def test_secrets_are_references_resolved_when_asked() -> None:
    table = {"name": "o", "url": "http://h/", "token": "env:PUSH_TOKEN"}
    (target,) = settings_from_dict({**BASE, "push": [table]}, {}).push
    assert target.token == "env:PUSH_TOKEN"


def test_a_resolved_secret_is_in_no_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a target is built with shows neither the token nor the signing key, should an
    error message or a debugger print it."""
    monkeypatch.setenv("TRIAGE_TEST_PUSH_T", "bearer-secret-1")
    monkeypatch.setenv("TRIAGE_TEST_PUSH_S", "hmac-secret-2")
    table = {
        "name": "o",
        "url": "http://h/",
        "token": "env:TRIAGE_TEST_PUSH_T",
        "signing_secret": "env:TRIAGE_TEST_PUSH_S",
    }
    settings = settings_from_dict({**BASE, "push": [table]}, {})
    target = http_target(settings, settings.push[0])
    assert target.endpoint.authorization == "Bearer bearer-secret-1"
    assert target.endpoint.signing_secret == b"hmac-secret-2"
    for shown in (repr(target.endpoint), repr(settings.push[0]), repr(target.shape)):
        assert "bearer-secret-1" not in shown
        assert "hmac-secret-2" not in shown


@pytest.mark.parametrize(
    ("table", "key", "says"),
    [
        ({"url": "http://h/"}, "push[0].name", "required"),
        ({"name": "a b", "url": "http://h/"}, "push.name", "letters"),
        ({"name": "o", "url": "ftp://h/"}, "push.o.url", "http:// or https://"),
        ({"name": "o", "url": "http:///x"}, "push.o.url", "with a host"),
        ({"name": "o", "url": "http://h:70000/"}, "push.o.url", "1-65535"),
        ({"name": "o"}, "push.o.url", "required"),
        ({"name": "o", "url": "http://h/", "mode": "kafka"}, "push.o.mode", "http, grpc"),
        (
            {"name": "o", "url": "http://h/", "min_concurrency": 9, "max_concurrency": 4},
            "push.o.min_concurrency",
            "above max_concurrency",
        ),
        (
            {"name": "o", "url": "http://h/", "batch": 500, "max_batch_bytes": 4096},
            "push.o.batch",
            "never fit",
        ),
        ({"name": "o", "url": "http://h/", "batch": 0}, "push.o.batch", "from 1"),
        ({"name": "o", "url": "http://h/", "timeout_s": 0}, "push.o.timeout_s", "> 0"),
        ({"name": "o", "url": "http://h/", "timeout_s": True}, "push.o.timeout_s", "boolean"),
        (
            {"name": "o", "url": "http://h/", "nack_statuses": [503]},
            "push.o.nack_statuses",
            "overload",
        ),
        ({"name": "o", "url": "http://h/", "token": "inline-secret"}, "push.o.token", "reference"),
        ({"name": "o", "url": "http://h/", "cert_file": "c.pem"}, "push.o.key_file", "together"),
        ({"name": "o", "url": "http://h/", "colour": "red"}, "push.o.colour", "unknown key"),
        ({"name": "o", "url": "http://h/", "batchh": 5}, "push.o.batchh", "did you mean 'batch'?"),
        ({"name": "g", "mode": "grpc"}, "push.g.registration", "registration = true"),
        (
            {"name": "g", "mode": "grpc", "registration": True, "url": "http://h/"},
            "push.g.url",
            "give no url",
        ),
        (
            {"name": "g", "mode": "grpc", "registration": True, "allow": ["nowhere"]},
            "push.g.allow",
            "not a network",
        ),
    ],
)
def test_bad_tables_name_the_key(table: dict[str, Any], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(table)
    assert caught.value.key == key
    assert says in str(caught.value)


def test_push_must_be_an_array_of_tables_with_unique_names() -> None:
    with pytest.raises(ConfigError, match=r"\[\[push\]\]"):
        settings_from_dict({**BASE, "push": {"name": "o"}}, {})
    with pytest.raises(ConfigError, match="two"):
        load({"name": "o", "url": "http://h/"}, {"name": "o", "url": "http://i/"})
