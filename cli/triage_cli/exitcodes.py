"""How every `triage` command ends: the one context manager that turns what a command
meets into a message on stderr and a named exit status, and SIGTERM into what Ctrl-C is.

The codes and the error -> code mapping live in `triage_proxy.exitcodes` (the Spark
replay job uses them too and must not import the CLI); this module adds what only a
typer command needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from triage_cli.signals import interrupt, on_stop_signals
from triage_proxy.exitcodes import ExitCode, exit_code_for

__all__ = ["CommandFailed", "ExitCode", "exit_on_errors", "say_error"]


class CommandFailed(Exception):
    """Ends a command with an exit code and a message for stderr."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def say_error(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)


@contextlib.contextmanager
def exit_on_errors() -> Iterator[None]:
    """Run a command's body: turn what it meets into a message on stderr and a named
    exit code (`exit_code_for`), so every command maps the same error to the same status.

    SIGINT and SIGTERM both raise KeyboardInterrupt in the body (a command that stops
    more gently installs its own handler inside, see `signals.py`) and end with 130, no
    message. An error Triage did not raise on purpose keeps its traceback."""
    from triage_proxy.errors import TriageError

    try:
        with on_stop_signals(interrupt):
            yield
        return
    except CommandFailed as exc:
        code, message = exc.code, str(exc)
    except TriageError as exc:
        code, message = exit_code_for(exc), str(exc)
    except (KeyboardInterrupt, typer.Abort):
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    say_error(message)
    raise typer.Exit(int(code))
