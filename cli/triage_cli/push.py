"""`[[push]]` tables from command-line flags (`triage dev --push`, `triage init --push`).

Why here: the flags are one way to write a `[[push]]` table, and the proxy's loader
(`triage_proxy.config.push`) is the one judge of a table. Each table built here is checked
by that loader's rules at once, and a refusal names the flag the person typed (`--push`,
`--push-batch`) instead of a config key of a file that does not exist yet.
"""

from __future__ import annotations

from typing import Any

__all__ = ["http_table", "registration_table"]

FLAG_OF_KEY = {"url": "--push", "batch": "--push-batch", "max_batch_bytes": "--push-batch"}
"""The flag a person changes to fix the table key the loader refuses."""


def http_table(name: str, url: str, batch: int = 1) -> dict[str, Any]:
    """The `[[push]]` table that delivers to `url` (`batch` records per request), checked
    as the proxy checks it; ConfigError names the flag."""
    table: dict[str, Any] = {"name": name, "url": url}
    if batch != 1:
        table["batch"] = batch
    _check(table)
    return table


def registration_table(name: str) -> dict[str, Any]:
    """The mode "grpc" `[[push]]` table: the original Triage's consumers register at
    `GET /consumers` on each proxy's HTTP port and are called back."""
    table: dict[str, Any] = {"name": name, "mode": "grpc", "registration": True}
    _check(table)
    return table


def _check(table: dict[str, Any]) -> None:
    from triage_proxy.config.push import push_targets
    from triage_proxy.config.secrets import Secrets
    from triage_proxy.errors import ConfigError

    try:
        push_targets([table], Secrets())
    except ConfigError as exc:
        key = exc.key.rsplit(".", 1)[-1]
        raise ConfigError(FLAG_OF_KEY.get(key, exc.key), exc.problem) from None
