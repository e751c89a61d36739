"""How a `triage` command ends: one error -> exit code mapping, and SIGINT and SIGTERM
taken the same way (signals.py), for every command and for the Spark replay job."""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from triage_cli.deploy import last_error
from triage_cli.exitcodes import CommandFailed, exit_on_errors
from triage_cli.signals import on_stop_signals, stop_on_signals
from triage_cli.supervisor import listening_ports
from triage_proxy.errors import (
    BrokerUnavailable,
    ConfigError,
    DeadLetterUnavailable,
    OwnershipLost,
    StateError,
    TriageError,
)
from triage_proxy.exitcodes import ExitCode, exit_code_for
from triage_proxy.store.query import TableNotFound

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("server.port", "not a number"), ExitCode.BAD_INPUT),
        (TableNotFound("dlq"), ExitCode.NOT_FOUND),
        (BrokerUnavailable("down"), ExitCode.UNAVAILABLE),
        (OwnershipLost("lease taken"), ExitCode.UNAVAILABLE),
        (StateError("twice"), ExitCode.FAILURE),
        (TriageError("other"), ExitCode.FAILURE),
        (KeyboardInterrupt(), ExitCode.INTERRUPTED),
        (ValueError("not ours"), ExitCode.FAILURE),
    ],
)
def test_one_mapping_from_error_to_exit_code(exc: BaseException, code: ExitCode) -> None:
    assert exit_code_for(exc) is code


def _command(body: object) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def run() -> None:
        with exit_on_errors():
            if isinstance(body, BaseException):
                raise body
            assert callable(body)
            body()

    return app


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("kafka.topic", "missing"), 2),
        (TableNotFound("dlq"), 4),
        (BrokerUnavailable("broker down"), 3),
        (StateError("a bug"), 1),
        (CommandFailed(ExitCode.CONFLICT, "already there"), 5),
    ],
)
def test_a_command_ends_with_the_mapped_code_and_says_why(exc: Exception, code: int) -> None:
    result = CliRunner().invoke(_command(exc))
    assert result.exit_code == code
    assert f"error: {exc}" in result.output


def test_an_interrupt_ends_with_130_and_no_message() -> None:
    result = CliRunner().invoke(_command(KeyboardInterrupt()))
    assert result.exit_code == 130
    assert "error" not in result.output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigterm_ends_a_command_the_way_ctrl_c_does(signum: int) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def body() -> None:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler interrupts this
        raise AssertionError("not interrupted")

    result = CliRunner().invoke(_command(body))
    assert result.exit_code == 130, result.output
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_on_signals_sets_an_event_then_restores_the_handlers(signum: int) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signum)
        assert stop.wait(5)
    assert {s: signal.getsignal(s) for s in before} == before


def test_outside_the_main_thread_no_handler_is_installed() -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with stop_on_signals() as stop:
                assert not stop.is_set()
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []


def test_in_an_event_loop_either_signal_calls_back_on_the_loop() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        called: list[str] = []
        done = asyncio.Event()

        def stop() -> None:
            called.append("stop")
            done.set()

        with on_stop_signals(stop, loop):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(done.wait(), 5)
        return called

    assert asyncio.run(main()) == ["stop"]


def test_the_replay_job_imports_nothing_from_the_cli() -> None:
    for path in (ROOT / "replay").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] == "triage_cli"], path


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (TableNotFound("dlq"), ExitCode.NOT_FOUND),
        (DeadLetterUnavailable("DynamoDB down"), ExitCode.UNAVAILABLE),
        (ConfigError("spark.speculation", "must be off to replay"), ExitCode.BAD_INPUT),
        (StateError("a bug"), ExitCode.FAILURE),
        (KeyboardInterrupt(), ExitCode.INTERRUPTED),
    ],
)
def test_the_replay_job_ends_with_the_codes_triage_uses(
    exc: BaseException, code: ExitCode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triage_replay import job

    def run_replay(options: object) -> None:
        raise exc

    monkeypatch.setattr(job, "run_replay", run_replay)
    for name in ("triage_replay", job.__name__):  # main() turns these up to INFO
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    assert job.main(["--table", "t", "--group", "g", "--bootstrap", "127.0.0.1:1"]) == code


# --- deploy: whose port answers, and why a proxy exited -----------------------------------


def test_listening_ports_are_the_ones_this_process_holds() -> None:
    with socket.socket() as listening, socket.socket() as bound_only:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound_only.bind(("127.0.0.1", 0))
        ports = listening_ports(os.getpid())
        if ports is None:
            pytest.skip("no /proc on this system")
        assert listening.getsockname()[1] in ports
        assert bound_only.getsockname()[1] not in ports
    assert listening_ports(2**22 + 1) == set()  # above pid_max: no such process


def test_last_error_names_the_cause_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "proxy-0.log"
    assert last_error(log) is None  # no log yet
    log.write_text(
        "2025-01-01 INFO triage_proxy.app: starting\n"
        "error: config key 'server.http_port': cannot listen on 127.0.0.1:9700: "
        "address already in use\n"
    )
    assert last_error(log) == (
        "config key 'server.http_port': cannot listen on 127.0.0.1:9700: address already in use"
    )
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "OSError: cannot listen on 127.0.0.1:7700\n"
    )
    assert last_error(log) == "OSError: cannot listen on 127.0.0.1:7700"
    log.write_text("INFO: nothing went wrong\n")
    assert last_error(log) is None
