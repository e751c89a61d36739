"""One edge per dependency: each external library is reached through one module, and code
that never needs a library does not load it.

These checks read the source (and import modules in a fresh interpreter), so a new
caller that goes past an edge fails here rather than in a review.
"""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from triage_proxy.config.settings import KafkaSettings
from triage_proxy.errors import BrokerUnavailable, ConfigError, UnavailableError
from triage_proxy.kafka.errors import (
    client_config_errors,
    kafka_errors,
    kafka_warnings,
    opening_errors,
)

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
