"""What every `triage` command's exit status means, for scripts and supervisors."""

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
