"""Reading the files a config names (the config itself, TLS files) distrustfully.

A path can name something that is not a file: a FIFO (an open for reading blocks until a
writer comes, so `config check` would hang), a device (`/dev/zero` never ends), a
directory, or a socket. `read_regular_file` opens without blocking, asks the open file
what it is, and reads only a regular file, up to a bound; anything else is a ConfigError
naming the key (exit 2) that says what the path is and what to give instead.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from triage_proxy.errors import ConfigError

MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest config or PEM file read: far above any real one, far below what hurts."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_regular_file(key: str, path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of regular file `path`; ConfigError naming `key` for anything else (see
    the module docstring). O_NONBLOCK makes opening a FIFO return at once; the mode is
    read from the opened descriptor, so what is read is what was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise ConfigError(key, f"{path} does not exist") from None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
        raise ConfigError(key, f"{path} is {kind}: give the path of a regular file")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(max_bytes + 1)
        except OSError as exc:
            raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise ConfigError(key, f"{path} is over {max_bytes} bytes: is it the right file?")
    return data


def read_text_file(key: str, path: str | Path) -> str:
    """`read_regular_file` decoded as UTF-8 (TOML is UTF-8); another encoding is a
    ConfigError that says where the first bad byte is, never quoting the content."""
    data = read_regular_file(key, path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            key,
            f"{path} is not UTF-8 (byte {exc.start} is not): save it as UTF-8 "
            "(e.g. `iconv -f LATIN1 -t UTF-8`)",
        ) from None
