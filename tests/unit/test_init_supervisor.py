"""Pure parts of `triage init` and the local supervisor: file writing and restart policy."""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triage_cli.exitcodes import CommandFailed, ExitCode
from triage_cli.init import render_config, summary, write_private
from triage_cli.supervisor import RestartPolicy, pid_alive, restart_decision
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.secrets import secret_reference
from triage_proxy.errors import ConfigError

RAW: dict[str, Any] = {
    "kafka": {"bootstrap_servers": "b:9092", "topic": "orders", "group_id": "g", "partitions": 2},
    "auth": {"tokens": {"billing": "a-token-of-sixteen-chars-or-more"}},
    "dead_letters": {"table": "dlq"},
}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_config_is_0600_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "triage.toml"
    assert write_private(path, render_config(RAW), force=False) is None
    assert _mode(path) == 0o600
    assert tomllib.loads(path.read_text()) == RAW
    assert not list(tmp_path.glob(".*.tmp"))


def test_existing_file_refused_then_forced_with_a_0600_backup(tmp_path: Path) -> None:
    path = tmp_path / "triage.toml"
    path.write_text("old = 1\n")
    with pytest.raises(CommandFailed) as refused:
        write_private(path, render_config(RAW), force=False)
    assert refused.value.code == ExitCode.CONFLICT
    assert path.read_text() == "old = 1\n"
    backup = write_private(path, render_config(RAW), force=True)
    assert backup == tmp_path / "triage.toml.bak"
    assert backup.read_text() == "old = 1\n"
    assert _mode(backup) == 0o600
    assert _mode(path) == 0o600


def test_render_refuses_an_invalid_config_naming_the_key() -> None:
    bad = {**RAW, "kafka": {**RAW["kafka"], "sasl_password": "hunter2"}}
    with pytest.raises(ConfigError) as err:
        render_config(bad)
    assert err.value.key == "kafka.sasl_password"


def test_references() -> None:
    assert secret_reference("env:KAFKA_PASSWORD") == ("env", "KAFKA_PASSWORD")
    assert secret_reference("secret:prod/kafka") == ("secret", "prod/kafka")
    assert secret_reference("env:") is None
    assert secret_reference("hunter2") is None


def test_summary_names_tokens_never_values() -> None:
    raw = {**RAW, "auth": {**RAW["auth"], "revoked": ["billing"], "token": "x" * 20}}
    text = "\n".join(f"{k} {v}" for k, v in summary(settings_from_dict(raw, {})))
    assert "default" in text
    assert "revoked: billing" in text
    assert "a-token-of" not in text
    assert "x" * 20 not in text


POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4, fast_crash_s=10, max_fast_crashes=3)


def test_backoff_grows_then_gives_up_after_fast_crashes() -> None:
    crashes, delays = 0, []
    for _ in range(4):
        decision = restart_decision(POLICY, crashes, ran_s=1.0, returncode=-9)
        crashes = decision.fast_crashes
        delays.append(decision.delay_s)
    assert delays == [0.5, 1.0, 2.0, None]


def test_a_long_run_resets_the_count() -> None:
    decision = restart_decision(POLICY, 3, ran_s=60.0, returncode=1)
    assert decision == restart_decision(POLICY, 0, ran_s=0.0, returncode=1)
    assert decision.delay_s == 0.5


def test_a_config_error_is_not_retried() -> None:
    assert restart_decision(POLICY, 0, ran_s=60.0, returncode=ExitCode.BAD_INPUT).delay_s is None


@given(
    crashes=st.integers(0, 50),
    ran_s=st.floats(0, 1e6, allow_nan=False),
    returncode=st.integers(-15, 255),
)
def test_delay_is_bounded_and_positive(crashes: int, ran_s: float, returncode: int) -> None:
    decision = restart_decision(POLICY, crashes, ran_s, returncode)
    assert decision.fast_crashes >= 1
    if decision.delay_s is not None:
        assert 0 < decision.delay_s <= POLICY.max_backoff_s
        assert decision.fast_crashes <= POLICY.max_fast_crashes


def test_pid_alive_checks_the_command_line() -> None:
    import os

    assert pid_alive(os.getpid())
    assert pid_alive(os.getpid(), marker="python")
    assert not pid_alive(os.getpid(), marker="no-such-command-line-marker")
