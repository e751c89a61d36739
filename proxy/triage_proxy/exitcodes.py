"""What a Triage process's exit status means, for scripts and supervisors, and the one
mapping from an error to that status.

Every entry point uses it: the `triage` commands (through `triage_cli.exitcodes`), the
proxy, and the Spark replay job (`python -m triage_replay.job`), which must not import
the CLI. Pure: no I/O, and nothing heavy is imported (`triage --help` stays instant).
"""

from __future__ import annotations

import enum


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
    """Stopped by SIGINT or SIGTERM before the work was done."""


def exit_code_for(exc: BaseException) -> ExitCode:
    """The status a process ends with because of `exc`, most specific class first.

    Errors Triage raises on purpose map by their group (errors.py); an interrupt is 130;
    anything else is a plain failure."""
    from triage_proxy.errors import BadInput, ConfigError, NotFoundError, UnavailableError

    if isinstance(exc, ConfigError | BadInput):
        return ExitCode.BAD_INPUT
    if isinstance(exc, NotFoundError):
        return ExitCode.NOT_FOUND
    if isinstance(exc, UnavailableError):
        return ExitCode.UNAVAILABLE
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    return ExitCode.FAILURE
