"""The checks of what a config points at (files, addresses, secrets), run by the proxy's
preflight (`triage_proxy/preflight.py`) before anything starts.

`settings.py` (with `validation.py`) checks what the file says; these check what it points at:

    TLS files       each PEM parses, the key is not encrypted and matches the certificate,
                    the client CA parses (OpenSSL through `ssl`, as the listener will)
    addresses       server.host and server.http_host are addresses this machine can bind
    secrets         every reference resolves: "env:VAR" here, "secret:NAME" (Secrets
                    Manager) only with `network` (config check --connect; the proxy itself)

Each problem is a ConfigError naming its key (exit 2; the supervisor gives such a
partition up instead of restarting it). `file_warnings` is advice, not refusal: a file
holding inline tokens that others may read.

Never quoted in a message: a file's content, a token, a secret.
"""

from __future__ import annotations

import errno
import socket
import ssl
import stat
import tomllib
from pathlib import Path

from triage_proxy.config.files import read_regular_file, read_text_file
from triage_proxy.config.secrets import secret_reference
from triage_proxy.config.sections import TlsSettings
from triage_proxy.config.settings import Settings
from triage_proxy.config.validation import client_key, is_secret_property
from triage_proxy.errors import ConfigError

# --- TLS ---------------------------------------------------------------------------------


def check_tls(tls: TlsSettings) -> None:
    """Load the TLS files as the listener will, naming the key of the one at fault."""
    if tls.cert_file is None or tls.key_file is None:
        return
    _readable("tls.cert_file", tls.cert_file)
    _readable("tls.key_file", tls.key_file)
    _certificates("tls.cert_file", tls.cert_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def no_password() -> str:
        raise ConfigError(
            "tls.key_file",
            f"{tls.key_file} is encrypted (a passphrase is needed): the listener needs an "
            "unencrypted PEM key (e.g. `openssl pkey -in KEY -out KEY.plain`)",
        )

    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ConfigError(
                "tls.key_file", f"{tls.key_file} is not the key of the certificate in tls.cert_file"
            ) from None
        raise ConfigError(
            "tls.key_file",
            f"{tls.key_file} holds no usable PEM private key ({_why(exc)})",
        ) from None
    if tls.client_ca_file is not None:
        _readable("tls.client_ca_file", tls.client_ca_file)
        _certificates("tls.client_ca_file", tls.client_ca_file)


def _readable(key: str, path: str) -> None:
    data = read_regular_file(key, path)
    if b"-----BEGIN " not in data:
        raise ConfigError(key, f"{path} is not a PEM file")


def _certificates(key: str, path: str) -> None:
    """The file parses as PEM certificates (loaded as trust anchors: OpenSSL reads every
    certificate in it and refuses garbage)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(
            key,
            f"{path} holds no valid PEM certificate ({exc.reason or 'OpenSSL cannot parse it'})",
        ) from None
    if not context.get_ca_certs() and context.cert_store_stats().get("x509", 0) == 0:
        raise ConfigError(key, f"{path} holds no PEM certificate")


def _why(exc: ssl.SSLError) -> str:
    return str(exc.reason or "OpenSSL cannot parse it")


# --- addresses ---------------------------------------------------------------------------


def check_bindable(key: str, host: str) -> None:
    """`host` resolves to an address this machine has (bound on a free port, then
    closed). A port in use is not checked here: the proxy names it when it binds."""
    try:
        infos = socket.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(key, f"{host!r} does not resolve: {exc}") from None
    problem: OSError | None = None
    for family, kind, proto, _name, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind(address)
            return
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return
            problem = exc
    raise ConfigError(key, f"cannot listen on {host!r}: {problem}")


def bind_error(address: str, exc: BaseException | None) -> ConfigError:
    """The gRPC listener could not bind `address` (host:port): name the key at fault. The
    host was checked by `check_bindable`, so the port is taken (or not allowed)."""
    host = address.rpartition(":")[0]
    try:
        check_bindable("server.host", host.strip("[]"))
    except ConfigError as host_error:
        return host_error
    why = f" ({exc})" if exc is not None else ""
    return ConfigError(
        "server.port", f"cannot listen on {address}: the port is in use or not allowed{why}"
    )


# --- secrets -----------------------------------------------------------------------------


def check_secrets(settings: Settings, *, network: bool) -> None:
    """Every secret reference resolves ("secret:NAME" only with `network`)."""
    references: list[tuple[str, str]] = []
    if settings.kafka.sasl_password is not None:
        references.append(("kafka.sasl_password", settings.kafka.sasl_password))
    for name, value in settings.kafka.client.items():
        if is_secret_property(name) and isinstance(value, str):
            references.append((client_key(name), value))
    for key, reference in references:
        kind, _ = secret_reference(reference) or ("", "")
        if kind == "env" or (kind == "secret" and network):
            settings.kafka.secrets(key, reference)


# --- advice ------------------------------------------------------------------------------


def file_warnings(path: str | Path) -> list[str]:
    """Advice about the config file itself: inline tokens in a file others can read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = tomllib.loads(read_text_file("<file>", path))
    except (OSError, ConfigError, tomllib.TOMLDecodeError):
        return []  # load_settings reports it
    if not mode & (stat.S_IRGRP | stat.S_IROTH):
        return []
    auth = raw.get("auth", {})
    if not isinstance(auth, dict):
        return []
    tokens = auth.get("tokens", {})
    inline = isinstance(auth.get("token"), str) or (
        isinstance(tokens, dict)
        and any(isinstance(v, str) and secret_reference(v) is None for v in tokens.values())
    )
    if not inline:
        return []
    return [
        f"{path} holds inline tokens and is readable by others (mode "
        f"{stat.S_IMODE(mode):04o}): chmod 600 {path}, or give the tokens as "
        '"env:VAR" / "secret:NAME"'
    ]
