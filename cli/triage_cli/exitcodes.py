"""What every `triage` command's exit status means, for scripts and supervisors, and the
one place that turns an error into that status."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import typer


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1
    """The command ran but some of its work failed (e.g. items that did not replay)."""
    BAD_INPUT = 2
    """A malformed config, flag or argument; the message names it."""
    UNAVAILABLE = 3
    """A dependency (broker, DynamoDB) could not be reached."""
    NOT_FOUND = 4
    """The table or item asked for does not exist."""
    CONFLICT = 5
    """Something already exists that the command will not replace (a config file without
    --force, a live deployment)."""
    INTERRUPTED = 130


class CommandFailed(Exception):
    """Ends a command with an exit code and a message for stderr."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def say_error(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)


@contextlib.contextmanager
def exit_on_errors() -> Iterator[None]:
    """Turn what a command meets into a message on stderr and a named exit code, most
    specific first, so every command maps the same error to the same status."""
    from triage_proxy.errors import ConfigError, NotFoundError, TriageError, UnavailableError

    code: ExitCode
    try:
        yield
        return
    except CommandFailed as exc:
        code, message = exc.code, str(exc)
    except ConfigError as exc:
        code, message = ExitCode.BAD_INPUT, str(exc)
    except NotFoundError as exc:
        code, message = ExitCode.NOT_FOUND, str(exc)
    except UnavailableError as exc:
        code, message = ExitCode.UNAVAILABLE, str(exc)
    except TriageError as exc:
        code, message = ExitCode.FAILURE, str(exc)
    except (KeyboardInterrupt, typer.Abort):
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    say_error(message)
    raise typer.Exit(int(code))
