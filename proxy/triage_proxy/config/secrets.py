"""Secret references in a config, and how one process resolves them.

A config never holds a secret: it holds a reference, "env:VAR" (the process environment)
or "secret:NAME" (AWS Secrets Manager). Auth tokens are resolved when the config is
loaded; Kafka's password and secret `[kafka.client]` properties when a Kafka client is
built, so a command that never talks to Kafka never reads them.

Why the fetcher is injected: reading Secrets Manager goes through the one AWS edge
(`store/aws.py`'s `read_secret`), and `config/` sits below `store/`, so it must not import
it. Whoever loads the config (the CLI, the replay job) hands the loader that fetcher; the
loader binds it, with the environment, into a `Secrets` that the settings carry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from triage_proxy.errors import ConfigError

SecretResolver = Callable[[str, str], str]
"""(config key, reference) -> secret value; raises ConfigError naming the key."""
SecretFetcher = Callable[[str, str], str]
"""(config key, Secrets Manager name) -> the secret's value; raises ConfigError naming
the key (`store/aws.py`'s `read_secret`)."""


def secret_reference(value: str) -> tuple[str, str] | None:
    """("env" | "secret", name) when `value` references a secret, else None."""
    kind, _, name = value.partition(":")
    return (kind, name) if kind in ("env", "secret") and name else None


@dataclass(frozen=True, eq=False)
class Secrets:
    """How this process resolves references: a `SecretResolver` (call it)."""

    env: Mapping[str, str] | None = None
    """Where "env:VAR" is looked up; None: the process environment, when resolved."""
    fetch: SecretFetcher | None = None
    """Reads "secret:NAME"; None: this process was given no access, and such a
    reference is a ConfigError."""

    def __call__(self, key: str, reference: str) -> str:
        """The value `reference` names ("env:VAR", "secret:NAME"); anything else as is."""
        kind, name = secret_reference(reference) or ("", "")
        if kind == "env":
            value = (os.environ if self.env is None else self.env).get(name)
            if not value:
                raise ConfigError(key, f"environment variable {name} is not set")
            return value
        if kind == "secret":
            if self.fetch is None:
                raise ConfigError(key, f"cannot read secret {name!r}: no Secrets Manager here")
            return self.fetch(key, name)
        return reference
