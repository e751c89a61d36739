"""A lock the xdist workers of one test run share: a file they all can open.

Each worker is a process of its own, so a threading lock cannot order them; `flock` on a
file in the folder they share (`shared_dir` in tests/conftest.py) can, and the kernel
releases it if the worker holding it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def shared_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold the run-wide lock `name` (the file `folder/name.lock`): one worker at a time."""
    with open(folder / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


TS_PACKAGE_LOCK = "typescript-package"
"""Held while clients/typescript/node_modules or dist/ is written (`npm ci`, the build):
once per run, before any test runs what they hold."""

TS_INSTALLED = "typescript-installed"
"""A file in the shared folder: node_modules is complete for this run (written under the
lock once `npm ci` ended or was not needed), so a worker that sees it takes no lock."""
