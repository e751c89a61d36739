"""The address an ECS task advertises: its own, read from the task metadata endpoint.

In a fleet on ECS every task is reached at its own address inside the VPC (as a Kafka
client reaches each broker), and no task knows that address before it starts: one task
definition serves every task. So the containers' config names a kind of address instead
of a host, and `triage proxy` asks ECS which one it has, once, at start:

    server.advertised_host = "ecs-task-dns"   the task's private DNS name
                                               (ip-10-0-1-5.ec2.internal): what a TLS
                                               certificate can name (*.ec2.internal)
    server.advertised_host = "ecs-task-ip"    the task's private IPv4 address

Both come from `${ECS_CONTAINER_METADATA_URI_V4}` (the container's metadata, Fargate
platform 1.4.0 and later): `Networks[0].PrivateDNSName` and `Networks[0].IPv4Addresses[0]`.
Anything else in `advertised_host` is used as written. A lookup that fails (not on ECS,
the endpoint does not answer, no such field) is a ConfigError naming the key: the task
exits 2 and says why, rather than advertise an address nobody can dial.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

from triage_proxy.config.sections import ServerSettings
from triage_proxy.errors import ConfigError

logger = logging.getLogger(__name__)

ECS_TASK_DNS = "ecs-task-dns"
"""`server.advertised_host` value: advertise the task's private DNS name."""
ECS_TASK_IP = "ecs-task-ip"
"""`server.advertised_host` value: advertise the task's private IPv4 address."""
ECS_ADDRESS_KINDS = (ECS_TASK_DNS, ECS_TASK_IP)
METADATA_ENV = "ECS_CONTAINER_METADATA_URI_V4"
"""Set by ECS in every container (Fargate platform 1.4.0+, EC2 agent 1.39+)."""
LOOKUP_TIMEOUT_S = 2.0
LOOKUP_ATTEMPTS = 3
"""The endpoint is local to the task; a few tries cover a container started early."""
RETRY_DELAY_S = 0.5
_KEY = "server.advertised_host"


def resolve_advertised_host(
    server: ServerSettings, env: Mapping[str, str], *, delay_s: float = RETRY_DELAY_S
) -> ServerSettings:
    """`server` with an ECS address kind in advertised_host replaced by the address;
    unchanged when advertised_host is anything else."""
    kind = server.advertised_host
    if kind not in ECS_ADDRESS_KINDS:
        return server
    address = task_address(kind, env, delay_s=delay_s)
    logger.info("advertising %s (%s from the ECS task metadata)", address, kind)
    return dataclasses.replace(server, advertised_host=address)


def task_address(kind: str, env: Mapping[str, str], *, delay_s: float = RETRY_DELAY_S) -> str:
    """This task's private DNS name (ECS_TASK_DNS) or IPv4 address (ECS_TASK_IP)."""
    base = env.get(METADATA_ENV)
    if not base:
        raise ConfigError(
            _KEY,
            f"{kind!r} needs the ECS task metadata endpoint, but {METADATA_ENV} is not set "
            "(not an ECS task, or Fargate below platform 1.4.0)",
        )
    network = _first_network(_container_metadata(base, kind, delay_s))
    if kind == ECS_TASK_DNS:
        name = network.get("PrivateDNSName")
        if not isinstance(name, str) or not name:
            raise ConfigError(
                _KEY,
                "the task metadata has no PrivateDNSName (the VPC needs DNS hostnames and "
                f"DNS support on); use {ECS_TASK_IP!r} instead",
            )
        return name
    addresses = network.get("IPv4Addresses")
    if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
        raise ConfigError(_KEY, "the task metadata lists no IPv4 address")
    return addresses[0]


def _container_metadata(base: str, kind: str, delay_s: float) -> dict[str, Any]:
    """GET the container's metadata document, retried a few times."""
    problem = ""
    for attempt in range(LOOKUP_ATTEMPTS):
        if attempt:
            time.sleep(delay_s)
        try:
            with urllib.request.urlopen(base, timeout=LOOKUP_TIMEOUT_S) as response:
                doc = json.loads(response.read())
        except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, bad JSON
            problem = str(getattr(exc, "reason", None) or exc)
            continue
        if isinstance(doc, dict):
            return doc
        problem = "not a JSON object"
    raise ConfigError(
        _KEY, f"{kind!r}: the ECS task metadata endpoint did not answer usefully: {problem}"
    )


def _first_network(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    networks = doc.get("Networks")
    if not isinstance(networks, list) or not networks or not isinstance(networks[0], dict):
        raise ConfigError(_KEY, "the task metadata lists no network (awsvpc mode is needed)")
    return networks[0]
