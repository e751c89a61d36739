"""What the proxy would refuse at start, found before anything starts: the one list that
`triage proxy` walks before it binds a port or takes a lease, and `triage config check`
walks to say OK.

    ports           config/validation.py: server.port + slot and server.http_port + slot
                    fit in 65535
    TLS files       config/checks.py: each PEM parses, the key matches the certificate
    addresses       config/checks.py: server.host and server.http_host can be bound
    secrets         config/checks.py: every reference resolves ("secret:NAME" only with
                    `network`)
    librdkafka      kafka/properties.py: every `[kafka.client]` property is one librdkafka
                    takes (a client is built and closed, nothing is sent)

Each problem is a ConfigError naming its key (exit 2; the supervisor gives such a
partition up instead of restarting it). It sits above config/ and kafka/ because it
walks both.
"""

from __future__ import annotations

from triage_proxy.config.checks import check_bindable, check_secrets, check_tls
from triage_proxy.config.settings import Settings
from triage_proxy.kafka.properties import check_client_properties


def preflight(settings: Settings, *, network: bool, slot: int = 0) -> None:
    """Raise ConfigError for the first thing the proxy would refuse at start; `slot` is
    the process's (its ports are server.port + slot and server.http_port + slot)."""
    settings.listen_address(slot)  # a port over 65535 (`slot_port`)
    settings.server.http_address(slot)
    check_tls(settings.tls)
    check_bindable("server.host", settings.server.host)
    if settings.server.http_address(0) is not None:
        check_bindable("server.http_host", settings.server.http_host)
    check_secrets(settings, network=network)
    check_client_properties(settings)
