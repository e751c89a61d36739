"""`triage init --push URL`: the file it writes has a `[[push]]` table the proxy loads and
`triage config check` passes; a bad flag is exit 2 naming it, before any question."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from triage_cli import init as init_module
from triage_cli.main import app
from triage_proxy.config.loader import load_settings


@pytest.fixture(autouse=True)
def no_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker would say the topic has 3 partitions."""

    def discover(kafka: dict[str, Any], timeout_s: float = 0) -> int:
        return 3

    monkeypatch.setattr(init_module, "discover_partitions", discover)
    # the group question needs a broker: tests/integration/test_group_fence.py asks one
    monkeypatch.setattr(init_module, "warn_group_in_use", lambda config: None)


def init(tmp_path: Path, *extra: str) -> tuple[Path, Any]:
    config = tmp_path / "triage.toml"
    args = ["init", "--non-interactive", "--config", str(config)]
    args += ["--bootstrap-servers", "127.0.0.1:1", "--topic", "orders", "--overflow-bucket", ""]
    result = CliRunner().invoke(app, [*args, *extra])
    return config, result


def test_push_writes_a_table_that_loads_and_passes_config_check(tmp_path: Path) -> None:
    url = "https://orders.internal:8443/kafka"
    config, result = init(tmp_path, "--push", url, "--push-batch", "100", "--app-name", "orders")
    assert result.exit_code == 0, result.output
    raw = tomllib.loads(config.read_text())
    assert raw["push"] == [{"name": "orders", "url": url, "batch": 100}]
    (target,) = load_settings(config).push
    assert (target.name, target.url, target.batch, target.mode) == ("orders", url, 100, "http")
    assert f"POST the records to {url}" in result.stdout
    assert "triage status --config" in result.stdout
    check = CliRunner().invoke(app, ["config", "check", "--config", str(config)])
    assert check.exit_code == 0, check.output
    assert f"orders: {url} (batch 100)" in check.stdout


def test_without_push_there_is_no_push_table(tmp_path: Path) -> None:
    config, result = init(tmp_path)
    assert result.exit_code == 0, result.output
    assert "push" not in tomllib.loads(config.read_text())
    assert "POST the records" not in result.stdout


def test_the_next_steps_fit_a_fleet_and_come_in_an_order_that_works(tmp_path: Path) -> None:
    """`config check --connect` fails until deploy creates the table, so init does not send
    the user there first; a fleet serves every partition behind any process's port, so
    the consumer hint is not "port + p"."""
    _, result = init(tmp_path, "--port", "7000")
    assert result.exit_code == 0, result.output
    steps = result.stdout.split("Next:", 1)[1]
    assert "--connect" not in steps
    assert steps.index("triage config check") < steps.index("triage deploy")
    assert "+ p" not in steps
    assert "Any proxy's address will do" in steps
    assert "127.0.0.1:7000" in steps


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--push", "ftp://orders.internal/"], "'--push': must be an http:// or https:// URL"),
        (["--push", "http://h:70000/"], "'--push': has a port outside 1-65535"),
        (["--push", "orders.internal"], "'--push'"),
        (["--push", "http://h/", "--push-batch", "20000"], "'--push-batch'"),
        (["--push-batch", "5"], "--push-batch needs --push URL"),
    ],
)
def test_a_bad_push_flag_is_exit_2_naming_it_and_writes_nothing(
    tmp_path: Path, flags: list[str], names: str
) -> None:
    config, result = init(tmp_path, *flags)
    assert result.exit_code == 2, result.output
    assert names in result.stderr
    assert "Traceback" not in result.output
    assert not config.exists()
