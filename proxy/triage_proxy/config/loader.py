"""The loader: a TOML file (or its parsed tables) and the environment in, one validated
`Settings` out.

Nothing below the CLI reads files or the environment: `load_settings` resolves
`token_env` and friends here and hands the proxy a complete `Settings`. Every problem is
a ConfigError naming the offending key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triage_proxy.config.files import read_text_file
from triage_proxy.config.push import push_targets
from triage_proxy.config.secrets import SecretFetcher, Secrets
from triage_proxy.config.sections import SECTIONS
from triage_proxy.config.settings import Settings
from triage_proxy.errors import ConfigError


def load_settings(
    path: str | Path,
    env: Mapping[str, str] | None = None,
    *,
    fetch_secret: SecretFetcher | None = None,
) -> Settings:
    """Read and validate a TOML config; every problem names the offending key.
    `fetch_secret` reads "secret:NAME" references (`store.aws.read_secret`; without it
    such a reference is a ConfigError when resolved)."""
    text = read_text_file("<file>", path)  # a FIFO, a directory, not UTF-8: ConfigError
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{path} is not valid TOML: {exc}") from None
    return settings_from_dict(raw, os.environ if env is None else env, fetch_secret=fetch_secret)


def settings_from_dict(
    raw: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    fetch_secret: SecretFetcher | None = None,
) -> Settings:
    """Build Settings from parsed TOML, resolving `auth.token_env` through `env` and the
    tokens' references through `env` and `fetch_secret`. Kafka's references resolve when
    a client is built: from the process environment then, and through `fetch_secret`."""
    secrets = Secrets(env, fetch_secret)
    for name in raw:
        if name not in SECTIONS and name != "push":
            raise ConfigError.unknown(name, "section", (*SECTIONS, "push"))
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        if name == "auth":
            table = _resolve_token(table, env, secrets)
        if name in raw or name in ("kafka", "auth", "dead_letters"):
            sections[name] = _build(name, cls, table)
    sections["kafka"] = dataclasses.replace(sections["kafka"], secrets=Secrets(None, fetch_secret))
    sections["push"] = push_targets(raw.get("push"), Secrets(None, fetch_secret))
    return Settings(**sections)


def _resolve_token(
    table: dict[str, Any], env: Mapping[str, str], secrets: Secrets
) -> dict[str, Any]:
    table = dict(table)
    var = table.pop("token_env", None)
    if var is None:
        return _resolve_named_tokens(table, secrets)
    if "token" in table:
        raise ConfigError("auth.token_env", "give either token or token_env, not both")
    if not isinstance(var, str):
        raise ConfigError("auth.token_env", "must be a string naming an environment variable")
    if not env.get(var):
        raise ConfigError("auth.token_env", f"environment variable {var} is not set")
    table["token"] = env[var]
    return _resolve_named_tokens(table, secrets)


def _resolve_named_tokens(table: dict[str, Any], secrets: Secrets) -> dict[str, Any]:
    tokens = table.get("tokens")
    if tokens is None:
        return table
    if not isinstance(tokens, dict) or not all(isinstance(v, str) for v in tokens.values()):
        raise ConfigError("auth.tokens", "must be a table of name = token strings")
    resolved = {name: secrets(f"auth.tokens.{name}", value) for name, value in tokens.items()}
    return {**table, "tokens": resolved}


def _build(section: str, cls: type[Any], table: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("config_key", True)}
    for key in table:
        if key not in known:
            raise ConfigError.unknown(f"{section}.{key}", "key", list(known))
    values: dict[str, Any] = {}
    for name, f in known.items():
        dotted = f"{section}.{name}"
        if name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(dotted, "is required")
            continue
        values[name] = _check_type(dotted, table[name], hints[name])
    return cls(**values)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check_type(key, value, options[0])
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, "must be a list of strings")
        return tuple(value)
    if origin is not None and issubclass(origin, Mapping):
        if not isinstance(value, dict) or not all(
            isinstance(v, str | int | bool) for v in value.values()
        ):
            raise ConfigError(key, "must be a table of strings, numbers or booleans")
        return dict(value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str):
        return value
    if hint is bool and isinstance(value, bool):
        return value
    shown = "(value hidden)" if key in _SECRET_KEYS else repr(value)  # errors get printed
    raise ConfigError(key, f"must be {hint.__name__}, got {type(value).__name__} {shown}")


_SECRET_KEYS = frozenset({"auth.token", "kafka.sasl_password"})
"""Keys whose values an error message must not quote."""
