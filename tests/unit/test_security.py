"""Security pieces that need no network: TLS files, token identification, secret-free errors."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import trustme

from triage_client import Consumer
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import TlsSettings
from triage_proxy.errors import AuthError, ConfigError, FrameError, ShuttingDown
from triage_proxy.server.service import TokenInterceptor, server_credentials
from triage_proxy.server.status import grpc_status

BASE: dict[str, dict[str, object]] = {
    "kafka": {"bootstrap_servers": "b", "topic": "t", "group_id": "g"},
    "auth": {"token": "unit-test-token-0123"},
    "dead_letters": {"table": "dlq"},
}


@pytest.fixture
def pem_files(tmp_path: Path) -> dict[str, Path]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    files = {"cert": tmp_path / "c.pem", "key": tmp_path / "k.pem", "ca": tmp_path / "ca.pem"}
    leaf.cert_chain_pems[0].write_to_path(str(files["cert"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    return files


def test_no_tls_settings_means_plaintext() -> None:
    assert server_credentials(TlsSettings()) is None


def test_tls_and_mtls_credentials_load(pem_files: dict[str, Path]) -> None:
    tls = TlsSettings(str(pem_files["cert"]), str(pem_files["key"]))
    assert server_credentials(tls) is not None
    mtls = TlsSettings(str(pem_files["cert"]), str(pem_files["key"]), str(pem_files["ca"]))
    assert server_credentials(mtls) is not None


@pytest.mark.parametrize("which", ["cert_file", "key_file", "client_ca_file"])
def test_missing_tls_file_names_its_key(pem_files: dict[str, Path], which: str) -> None:
    paths = {
        "cert_file": str(pem_files["cert"]),
        "key_file": str(pem_files["key"]),
        "client_ca_file": str(pem_files["ca"]),
    }
    paths[which] = str(pem_files["ca"].parent / "absent.pem")
    with pytest.raises(ConfigError, match=f"tls.{which}.*absent.pem"):
        server_credentials(TlsSettings(**paths))


@pytest.mark.parametrize("which", ["cert_file", "key_file", "client_ca_file"])
def test_non_pem_tls_file_names_its_key_without_quoting_it(
    pem_files: dict[str, Path], which: str, tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a certificate: secret-ish bytes")
    paths = {
        "cert_file": str(pem_files["cert"]),
        "key_file": str(pem_files["key"]),
        "client_ca_file": str(pem_files["ca"]),
    }
    paths[which] = str(junk)
    with pytest.raises(ConfigError, match=f"tls.{which}.*not a PEM file") as info:
        server_credentials(TlsSettings(**paths))
    assert "secret-ish" not in str(info.value)


def test_a_certificate_is_not_a_key(pem_files: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"tls\.key_file"):
        server_credentials(TlsSettings(str(pem_files["cert"]), str(pem_files["cert"])))


def test_interceptor_names_the_app_and_follows_replacements() -> None:
    auth = TokenInterceptor({"orders": "orders-token-0123456789", "billing": "billing-0123456789"})
    assert auth.identify([("authorization", "Bearer orders-token-0123456789")]) == "orders"
    assert auth.identify([("authorization", b"Bearer billing-0123456789")]) == "billing"
    assert auth.identify([("authorization", "Bearer nope")]) is None
    assert auth.identify([("authorization", "orders-token-0123456789")]) is None
    assert auth.identify([]) is None
    assert auth.identify(None) is None
    auth.replace({"billing": "billing-0123456789"})
    assert auth.identify([("authorization", "Bearer orders-token-0123456789")]) is None
    assert auth.identify([("authorization", "Bearer billing-0123456789")]) == "billing"


def test_revoked_names_are_not_active() -> None:
    raw: dict[str, dict[str, object]] = {
        **BASE,
        "auth": {"tokens": {"a": "a-token-0123456789ab", "b": "b-token-0123456789ab"}},
    }
    assert set(settings_from_dict(raw, {}).auth.active()) == {"a", "b"}
    raw["auth"]["revoked"] = ["a"]
    assert set(settings_from_dict(raw, {}).auth.active()) == {"b"}


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("auth", "token", 12345678901234567890), ("kafka", "sasl_password", 987654321)],
)
def test_a_secret_of_the_wrong_type_is_not_quoted(section: str, key: str, value: int) -> None:
    raw: dict[str, dict[str, object]] = {name: dict(table) for name, table in BASE.items()}
    raw[section][key] = value
    with pytest.raises(ConfigError, match=f"{section}.{key}") as info:
        settings_from_dict(raw, {})
    assert str(value) not in str(info.value)


def test_client_tls_options() -> None:
    def handler(message: object) -> None:
        pass

    with pytest.raises(ValueError, match="together"):
        Consumer("h:1", "t", handler, certificate_chain=b"pem")
    # Plaintext by default; any TLS option turns TLS on.
    assert Consumer("h:1", "t", handler)._channels.credentials is None
    assert Consumer("h:1", "t", handler, root_certificates=b"ca")._channels.credentials is not None
    assert Consumer("h:1", "t", handler, secure=True)._channels.credentials is not None


def test_service_errors_map_to_the_status_codes_clients_see() -> None:
    assert grpc_status(AuthError("token revoked")) is grpc.StatusCode.UNAUTHENTICATED
    assert grpc_status(FrameError("first frame must be Hello")) is grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status(ShuttingDown("proxy is shutting down")) is grpc.StatusCode.UNAVAILABLE
    assert grpc_status(RuntimeError("a bug")) is grpc.StatusCode.INTERNAL
