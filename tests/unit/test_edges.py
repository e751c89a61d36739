"""One edge per dependency: each external library is reached through one module, and code
that never needs a library does not load it.

These checks read the source (and import modules in a fresh interpreter), so a new
caller that goes past an edge fails here rather than in a review.
"""

from __future__ import annotations

import ast
import concurrent.futures
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import KafkaSettings
from triage_proxy.errors import BrokerUnavailable, ConfigError, UnavailableError
from triage_proxy.kafka.errors import (
    admin_answer,
    client_config_errors,
    kafka_errors,
    kafka_warnings,
    opening_errors,
)
from triage_proxy.kafka.producer import NOT_SENT_ERRORS, never_written
from triage_proxy.store.aws import read_secret

ROOT = Path(__file__).resolve().parents[2]

REPLAY_EXECUTOR_MODULES = ("triage_replay.segment", "triage_replay.options", "triage_replay.job")
"""What a Spark executor imports to run a segment (the partition function and its job)."""


def loaded_after_import(*modules: str) -> set[str]:
    """Top-level package names in sys.modules of a fresh interpreter that imported `modules`."""
    code = (
        f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(out.stdout.split())


def test_the_replay_executors_load_neither_grpc_nor_kafka_on_import() -> None:
    """The executors produce with confluent-kafka (imported by the segment that produces,
    not at import) and never serve or call gRPC."""
    loaded = loaded_after_import(*REPLAY_EXECUTOR_MODULES)
    assert "grpc" not in loaded
    assert "confluent_kafka" not in loaded


def test_the_error_tree_loads_no_client_library() -> None:
    loaded = loaded_after_import("triage_proxy.errors")
    assert {"grpc", "confluent_kafka", "boto3", "botocore"} & loaded == set()


# --- Kafka: kafka/errors.py is the one place librdkafka's errors are caught ---------------

SOURCES = ("proxy/triage_proxy", "cli/triage_cli", "replay/triage_replay", "conformance")
KAFKA_EDGE = "proxy/triage_proxy/kafka/errors.py"
KAFKA_ERROR_TYPES = {"KafkaException", "KafkaError"}


def python_files() -> Iterator[tuple[str, ast.Module]]:
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def test_only_the_kafka_edge_imports_librdkafka_error_types() -> None:
    importers = sorted(
        name
        for name, tree in python_files()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("confluent_kafka")
        and {alias.name for alias in node.names} & KAFKA_ERROR_TYPES
    )
    assert importers == [KAFKA_EDGE]


def test_kafka_errors_become_the_proxys_own() -> None:
    down = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
    expected = r"^commit of offset 7 failed: broker down$"
    with (
        pytest.raises(BrokerUnavailable, match=expected),
        kafka_errors("commit of offset 7 failed"),
    ):
        raise down
    with pytest.raises(UnavailableError) as info, kafka_errors("listing", UnavailableError):
        raise down
    assert info.value.__cause__ is down
    with kafka_errors("not raised"):
        pass


def test_an_admin_answer_is_its_result_or_the_proxys_own_error() -> None:
    answered: concurrent.futures.Future[str] = concurrent.futures.Future()
    answered.set_result("stable")
    assert admin_answer(answered, "describing group 'g'", 1.0) == "stable"

    down = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    failed.set_exception(down)
    with pytest.raises(BrokerUnavailable, match=r"^describing group 'g': broker down$") as info:
        admin_answer(failed, "describing group 'g'", 1.0)
    assert info.value.__cause__ is down

    silent: concurrent.futures.Future[str] = concurrent.futures.Future()  # never answered
    with pytest.raises(BrokerUnavailable, match=r"^describing group 'g': no answer in 0.05s$"):
        admin_answer(silent, "describing group 'g'", 0.05)


def test_only_delivery_errors_that_prove_nothing_was_written_release_a_replay_claim() -> None:
    for name in NOT_SENT_ERRORS:  # real librdkafka names, spelled as KafkaError.name() does
        assert KafkaError(getattr(KafkaError, name)).name() == name
        assert never_written(KafkaError(getattr(KafkaError, name)))
    for code in (KafkaError._MSG_TIMED_OUT, KafkaError._PURGE_INFLIGHT, KafkaError._TIMED_OUT):
        assert not never_written(KafkaError(code))  # maybe written: keep the claim
    assert not never_written(KafkaError(KafkaError.REQUEST_TIMED_OUT))
    for code in (KafkaError.UNKNOWN, KafkaError._FAIL, KafkaError.NOT_ENOUGH_REPLICAS):
        assert not never_written(KafkaError(code))  # unknown: may have been written too
    assert not never_written("SOMETHING_NEWER")
    assert never_written("_PURGE_QUEUE")  # without name(), its text is read as the name


def test_kafka_warnings_log_and_carry_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), kafka_warnings("pausing partition %d", 3):
        raise KafkaException(KafkaError(KafkaError._STATE, "not assigned"))
    assert caplog.messages == ["pausing partition 3: not assigned"]
    with pytest.raises(ValueError, match="ours"), kafka_warnings("other errors pass"):
        raise ValueError("ours")


def test_a_refused_client_property_names_its_key() -> None:
    settings = KafkaSettings("b:9092", "t", "g", client={"socket.timeout.ms": "x"})
    refused = KafkaException(
        KafkaError(
            KafkaError._INVALID_ARG, 'Invalid value for configuration property "socket.timeout.ms"'
        )
    )
    with pytest.raises(ConfigError) as info, opening_errors(settings, 0):
        raise refused
    assert info.value.key == 'kafka.client."socket.timeout.ms"'
    with pytest.raises(ConfigError) as info, client_config_errors(settings.client):
        raise refused
    assert info.value.key == 'kafka.client."socket.timeout.ms"'
    opening = r"opening t\[2\]: no broker"
    with pytest.raises(BrokerUnavailable, match=opening), opening_errors(settings, 2):
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "no broker"))


# --- AWS: store/aws.py builds every client; config/ never reaches past it ----------------

AWS_EDGE = "proxy/triage_proxy/store/aws.py"


def test_only_the_aws_edge_builds_boto3_clients() -> None:
    """No `import boto3` or `botocore.session` and no `.client(...)` / `Session(...)` /
    `.create_client(...)` call outside store/aws.py."""
    found = []
    for name, tree in python_files():
        if name == AWS_EDGE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                imported = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                if any(m == "boto3" or m.startswith("boto3.") for m in imported):
                    found.append(f"{name}:{node.lineno} imports boto3")
                if any(m == "botocore.session" for m in imported) or (
                    isinstance(node, ast.ImportFrom)
                    and node.module == "botocore"
                    and any(a.name == "session" for a in node.names)
                ):
                    found.append(f"{name}:{node.lineno} imports botocore.session")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("client", "Session", "create_client")
            ):
                found.append(f"{name}:{node.lineno} calls .{node.func.attr}()")
    assert found == []


def test_config_imports_neither_the_store_nor_boto3() -> None:
    """Settings are data: config/ sits below store/ (function-local imports count too)."""
    found = [
        f"{name}:{node.lineno}"
        for name, tree in python_files()
        if name.startswith("proxy/triage_proxy/config/")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom | ast.Import)
        for module in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
        if module.startswith(("triage_proxy.store", "boto3", "botocore"))
    ]
    assert found == []
    assert {"boto3", "botocore"} & loaded_after_import("triage_proxy.config.loader") == set()


def test_every_loader_call_is_given_the_secrets_fetcher() -> None:
    """A config may reference "secret:NAME" anywhere it is loaded: a caller that forgot
    the fetcher would fail only for the users who do."""
    missing = [
        f"{name}:{node.lineno}"
        for name, tree in python_files()
        if not name.startswith("proxy/triage_proxy/config/")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", "")) in LOADERS
        and "fetch_secret" not in {k.arg for k in node.keywords}
    ]
    assert missing == []


LOADERS = {"load_settings", "settings_from_dict"}


def test_secret_references_resolve_through_the_injected_fetcher() -> None:
    asked: list[tuple[str, str]] = []

    def fetch(key: str, name: str) -> str:
        asked.append((key, name))
        return f"value-of-{name}"

    raw = {
        "kafka": {
            "bootstrap_servers": "b:9092",
            "topic": "t",
            "group_id": "g",
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "u",
            "sasl_password": "secret:kafka/pw",
        },
        "auth": {"tokens": {"app": "secret:tokens/app", "ops": "env:OPS_TOKEN"}},
        "dead_letters": {"table": "dlq"},
    }
    settings = settings_from_dict(raw, {"OPS_TOKEN": "o" * 32}, fetch_secret=fetch)
    assert settings.auth.active() == {"app": "value-of-tokens/app", "ops": "o" * 32}
    assert asked == [("auth.tokens.app", "tokens/app")]  # Kafka's only when a client is built
    assert settings.kafka.librdkafka_config()["sasl.password"] == "value-of-kafka/pw"
    assert asked[-1] == ("kafka.sasl_password", "kafka/pw")
    with pytest.raises(ConfigError, match="no Secrets Manager") as info:
        settings_from_dict(raw, {"OPS_TOKEN": "o" * 32})
    assert info.value.key == "auth.tokens.app"


def test_a_missing_secret_is_a_config_error_naming_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """read_secret goes through the AWS edge: a refused call names the config key."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    with pytest.raises(ConfigError, match="reading secret 'prod/pw' failed") as info:
        read_secret("kafka.sasl_password", "prod/pw")
    assert info.value.key == "kafka.sasl_password"
