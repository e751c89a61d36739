"""`triage deploy` and `triage destroy`: run Triage on this machine or on AWS.

    triage deploy  --target local --config F [--proxies N | --pinned] [--state-dir D]
                   [--timeout S]
    triage destroy --target local --config F [--state-dir D]
    triage deploy  --target aws   --config F [--image IMAGE]
    triage destroy --target aws   --config F [--yes] [--delete-data]

local: creates the dead-letter table (and overflow bucket) if missing, starts a detached
supervisor (`supervisor.py`) that keeps N fleet processes alive, which the deployment's
consumer group assigns the partitions to (`--proxies N`, default min(partitions, cores);
0 means that default too), or with `--pinned` one process pinned to each partition (the
layout before fleets), and returns once every proxy it started is ready (a fleet: every
process ready and every partition served; HTTP /readyz when the proxy serves it, else
its gRPC port accepts), counting only answers from a port that process holds: a port
answered by another deployment is not readiness. A proxy the supervisor gives up (e.g.
its port is in use) fails the deploy with the cause from its log, and stops and cleans
up what it started (pid files and state.json; the logs stay).
State lives in the project folder (default `.triage/` next to the config). A second
deploy is refused while the first one lives; a dead one's leftovers are cleaned up.
The token is never printed: deploy prints its NAME and the file that holds it (the
config, mode 0600), so it stays out of terminal scrollback and CI logs.

aws: `triage_cli.aws` (imported only then, so `triage --help` stays instant) builds the
stack and returns its outputs; destroy asks for confirmation unless `--yes` and keeps
the dead-letter data unless `--delete-data`.

Each acts only on its own config's deployment: a state folder that records another
config (state.json's `config`, or a live process's `--config`) is refused, exit 5,
touching nothing (deploy: only while that deployment is live).

Exit codes (`exitcodes.ExitCode`): 2 bad config or flag, also a proxy given up because it
exited 2 itself (its config is bad: e.g. its port is in use, a TLS file is missing); 3
broker/AWS unreachable, or a proxy failed otherwise or never became ready; 5 a live local
deployment already exists, or the state folder is another deployment's; 1 other failures.
"""

from __future__ import annotations

import enum
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.init import DEFAULT_CONFIG
from triage_cli.supervisor import (
    STOP_MARGIN_S,
    ProjectDir,
    listening_ports,
    pid_alive,
    run_supervisor,
    signal_pid,
    supervisor_command,
    wait_gone,
)

if TYPE_CHECKING:
    from rich.console import Console

    from triage_proxy.config.settings import Settings

READY_TIMEOUT_S = 60.0
"""Plus ownership.lease_s: a proxy may wait out a dead predecessor's lease first."""
FALLBACK_DRAIN_S = 30.0


class Target(enum.StrEnum):
    local = "local"
    aws = "aws"


ConfigOption = Annotated[
    Path, typer.Option("--config", "-c", help="The TOML config (`triage init` writes one).")
]
TargetOption = Annotated[Target, typer.Option("--target", "-t", help="Where to run.")]
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        help="local: project folder for pids, logs, state (default: .triage/ by the config)."
    ),
]


def _console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


# --- commands -----------------------------------------------------------------------------


def deploy(
    target: TargetOption = Target.local,
    config: ConfigOption = DEFAULT_CONFIG,
    state_dir: StateDirOption = None,
    image: Annotated[
        str | None, typer.Option(help="aws: container image (default: the one infra/ builds).")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(help="local: seconds to wait for every proxy (default 60 + lease_s)."),
    ] = None,
    proxies: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="local: run N fleet processes sharing the partitions (assigned by the "
            "consumer group). Default (or 0): min(partitions, cores).",
            show_default=False,
        ),
    ] = None,
    pinned: Annotated[
        bool,
        typer.Option(
            "--pinned",
            help="local: one process pinned to each partition instead of a fleet.",
        ),
    ] = False,
) -> None:
    """Run the proxies (local processes, or ECS on AWS); print the endpoints."""
    with exit_on_errors():
        if target is Target.aws:
            from triage_cli.aws import deploy_aws  # boto3 and the template: only here

            outputs = deploy_aws(config, image=image, console=_console())
            typer.echo("Deployed. Stack outputs:")
            for key, value in dict(outputs).items():
                typer.echo(f"  {key}: {value}")
            return
        if pinned and proxies is not None:
            raise CommandFailed(ExitCode.BAD_INPUT, "--pinned and --proxies do not go together")
        deploy_local(config, state_dir, timeout, None if pinned else (proxies or 0))


def destroy(
    target: TargetOption = Target.local,
    config: ConfigOption = DEFAULT_CONFIG,
    state_dir: StateDirOption = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="aws: do not ask to confirm.")] = False,
    delete_data: Annotated[
        bool,
        typer.Option("--delete-data", help="aws: also delete the dead-letter table and bucket."),
    ] = False,
) -> None:
    """Stop what deploy started (local: every proxy and the supervisor, by pid)."""
    with exit_on_errors():
        if target is Target.aws:
            what = "the stack AND its dead-letter data" if delete_data else "the stack"
            if not yes and not typer.confirm(f"Delete {what} deployed from {config}?", err=True):
                raise CommandFailed(ExitCode.FAILURE, "not confirmed; nothing was deleted")
            from triage_cli.aws import destroy_aws

            destroy_aws(config, delete_data=delete_data, console=_console())
            typer.echo("Destroyed." + ("" if delete_data else " Dead-letter data kept."))
            return
        destroy_local(config, state_dir)


def supervise(
    config: ConfigOption,
    state_dir: Annotated[Path, typer.Option(help="Project folder.")],
    partitions: Annotated[int, typer.Option(min=1)],
    proxies: Annotated[int | None, typer.Option(min=1)] = None,
) -> None:
    """(internal) The detached supervisor that `deploy --target local` starts."""
    import logging
    import sys

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    with exit_on_errors():
        code = run_supervisor(config, ProjectDir(state_dir), partitions, proxies)
    raise typer.Exit(code)


# --- local --------------------------------------------------------------------------------


def default_proxies(partitions: int, cores: int | None) -> int:
    """Fleet processes by default: one per core, never more than partitions (pure)."""
    return max(1, min(partitions, cores or 1))


def deploy_local(
    config: Path, state_dir: Path | None, timeout: float | None, proxies: int | None = 0
) -> None:
    """`proxies`: fleet processes (0: default_proxies); None: pinned, one per partition."""
    from triage_proxy.config.loader import load_settings
    from triage_proxy.errors import ConfigError
    from triage_proxy.store.aws import read_secret
    from triage_proxy.store.provisioning import create_bucket, create_table

    config = config.resolve()
    settings = load_settings(config, fetch_secret=read_secret)
    if settings.server.port == 0:
        raise ConfigError("server.port", "deploy needs a fixed base port (consumers dial it)")
    partitions = settings.kafka.partitions or _ask_partitions(settings)
    if proxies == 0:
        import os

        proxies = default_proxies(partitions, os.cpu_count())
    project = ProjectDir.for_config(config, state_dir)
    if project.root.exists() and not project.root.is_dir():
        raise CommandFailed(
            ExitCode.BAD_INPUT,
            f"--state-dir {project.root} is not a folder: give a folder (created if missing)",
        )
    project.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = str(config)
    _refuse_foreign(project, config, "deploy", live_only=True)
    pid = project.read_pid(project.supervisor_pid_file)
    if pid is not None and pid_alive(pid, marker):
        raise CommandFailed(
            ExitCode.CONFLICT,
            f"a local deployment of {config} is running (supervisor pid {pid}, state in "
            f"{project.root}); run `triage destroy --target local --config {config}` first",
        )
    if pid is not None or project.proxy_pid_files():
        typer.echo(f"cleaning up a previous deployment that is no longer running ({project.root})")
        _stop_local(project, marker, FALLBACK_DRAIN_S)

    from triage_proxy.kafka.groups import group_in_use

    # Ours is not running (checked above): live members are someone else's. Committed
    # offsets may be our own earlier deployment's, so they are init's warning only.
    problem = group_in_use(settings.kafka, offsets=False)
    if problem is not None:
        typer.secho(f"warning: {problem}", err=True, fg=typer.colors.YELLOW)
    create_table(settings.dead_letters)
    create_bucket(settings.dead_letters)
    project.state_file.unlink(missing_ok=True)
    with open(project.supervisor_log, "ab") as log:
        proc = subprocess.Popen(
            supervisor_command(config, project, partitions, proxies),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # detached: a Ctrl-C here must not reach it
        )
    project.write_pid(project.supervisor_pid_file, proc.pid)
    limit = timeout if timeout is not None else READY_TIMEOUT_S + _lease_s(settings)
    try:
        if proxies is None:
            pids = _wait_ready(settings, project, proc, partitions, limit)
        else:
            served = _wait_fleet_ready(settings, project, proc, partitions, proxies, limit)
    except BaseException:
        _stop_local(project, marker, settings.shutdown.drain_timeout_s)
        raise
    if proxies is None:
        _print_deployment(config, settings, project, pids)
    else:
        _print_fleet(config, settings, project, served)


def _lease_s(settings: Settings) -> float:
    return settings.ownership.lease_s if settings.ownership.enabled else 0.0


def _ask_partitions(settings: Settings) -> int:
    """kafka.partitions unset: ask the broker (what `triage init` does)."""
    import dataclasses

    from triage_cli.init import discover_partitions

    fields = dataclasses.fields(settings.kafka)
    return discover_partitions({f.name: getattr(settings.kafka, f.name) for f in fields})


def _wait_ready(
    settings: Settings,
    project: ProjectDir,
    proc: subprocess.Popen[bytes],
    partitions: int,
    timeout_s: float,
) -> dict[int, int]:
    """Wait until the proxy that supervisor `proc` runs for every partition is ready;
    return their pids. A proxy it restarted must be ready again under its new pid."""
    deadline = time.monotonic() + timeout_s
    ready: dict[int, int] = {}
    while True:
        exited = proc.poll()
        running = _running_pids(project, proc.pid)
        if exited is not None:
            raise CommandFailed(
                ExitCode.UNAVAILABLE,
                f"the supervisor exited with {exited}; see {project.supervisor_log}",
            )
        for p in range(partitions):
            pid = running.get(p)
            if pid is not None and ready.get(p) == pid:
                continue
            ready.pop(p, None)  # not running, or restarted under a new pid
            if pid is not None and proxy_ready(settings, p, pid):
                ready[p] = pid
        if len(ready) == partitions:
            return ready
        if time.monotonic() > deadline:
            pending = sorted(set(range(partitions)) - set(ready))
            logs = ", ".join(str(project.proxy_log(p)) for p in pending)
            raise CommandFailed(
                ExitCode.UNAVAILABLE,
                f"partition(s) {pending} not ready after {timeout_s:g}s; see {logs}",
            )
        time.sleep(0.2)


def _wait_fleet_ready(
    settings: Settings,
    project: ProjectDir,
    proc: subprocess.Popen[bytes],
    partitions: int,
    proxies: int,
    timeout_s: float,
) -> dict[int, tuple[int, list[int]]]:
    """Wait until every fleet process supervisor `proc` runs is ready and together they
    serve every partition; return slot -> (pid, partitions it serves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        exited = proc.poll()
        # First: a process it gave up is named with its cause (raised here), which says
        # more than the supervisor's own exit after giving every process up.
        running = _running_pids(project, proc.pid, key="proxies", what="proxy in slot")
        if exited is not None:
            raise CommandFailed(
                ExitCode.UNAVAILABLE,
                f"the supervisor exited with {exited}; see {project.supervisor_log}",
            )
        served: dict[int, tuple[int, list[int]]] = {}
        for slot, pid in running.items():
            if proxy_ready(settings, slot, pid):
                served[slot] = (pid, fleet_served(settings, slot))
        covered = sorted({p for _, parts in served.values() for p in parts})
        if len(served) == proxies and covered == list(range(partitions)):
            return served
        if time.monotonic() > deadline:
            missing = sorted(set(range(partitions)) - set(covered))
            docs = {slot: fleet_status(settings, slot) for slot in sorted(running)}
            raise CommandFailed(
                ExitCode.UNAVAILABLE,
                f"fleet not ready after {timeout_s:g}s: {len(served)} of {proxies} processes "
                f"ready, partition(s) {missing} not served "
                f"({fleet_not_ready_detail(docs, settings.kafka.group_id)}); "
                f"see {project.root}",
            )
        time.sleep(0.2)


def fleet_status(settings: Settings, slot: int) -> dict[str, Any] | None:
    """Fleet process `slot`'s /status document; None when it does not answer."""
    import json

    http = settings.server.http_address(slot)
    if http is None or not http[1]:
        return None
    try:
        url = f"http://{_dialable(http[0])}:{http[1]}/status"
        with urllib.request.urlopen(url, timeout=1) as response:
            doc = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def fleet_served(settings: Settings, slot: int) -> list[int]:
    """The partitions fleet process `slot` serves now, from its /status ([] if none)."""
    doc = fleet_status(settings, slot)
    return [] if doc is None else [int(p) for p in doc.get("served", [])]


def fleet_not_ready_detail(docs: Mapping[int, Mapping[str, Any] | None], group: str) -> str:
    """What each fleet process says of itself, for deploy's not-ready error (pure). A
    process that never got an assignment from the group coordinator (`member` false) is
    waiting on the broker's group, not on Triage: when none has one, that is said
    plainly (a broker whose group state is stuck shows so)."""
    parts = []
    for slot, doc in sorted(docs.items()):
        if doc is None:
            parts.append(f"slot {slot}: no /status answer")
        elif doc.get("member") is False:
            parts.append(f"slot {slot}: {doc.get('state')}, no assignment from the group yet")
        else:
            parts.append(
                f"slot {slot}: {doc.get('state')}, assigned {list(doc.get('assigned') or [])}, "
                f"serving {list(doc.get('served') or [])}"
            )
    detail = "; ".join(parts) or "no process running"
    if docs and all(doc is not None and doc.get("member") is False for doc in docs.values()):
        detail += (
            f"; no process was given partitions by consumer group {group!r}'s coordinator: "
            "check that the broker answers group requests (`triage status`, the proxies' "
            "logs say `joining group`). On the embedded broker (Tansu 0.6) a group whose "
            "processes all stopped at once (`triage destroy`) is never assigned again: "
            "restart the broker or set a new kafka.group_id (docs/guides/deploy-local.md)"
        )
    return detail


def _print_fleet(
    config: Path, settings: Settings, project: ProjectDir, served: dict[int, tuple[int, list[int]]]
) -> None:
    typer.echo(
        f"Deployed {settings.kafka.topic!r}: a fleet of {len(served)} proxies "
        f"(group {settings.kafka.group_id!r}; state in {project.root})"
    )
    for slot in sorted(served):
        pid, parts = served[slot]
        http = settings.server.http_address(slot)
        extra = f"  http {_dialable(http[0])}:{http[1]}" if http else ""
        typer.echo(
            f"  proxy {slot}: {_dialable(settings.server.host)}:{settings.server.port + slot}"
            f"{extra}  pid {pid}  partitions {', '.join(map(str, parts)) or '-'}"
        )
    names = ", ".join(sorted(settings.auth.active()))
    typer.echo(
        f"Consumers: give any proxy's endpoint (Topology names the rest)\n"
        f"Token(s): {names} (in {config}, [auth] section; never printed)\n"
        f"TLS: {'on' if settings.tls.enabled else 'off'}\n"
        f"Stop: triage destroy --target local --config {config}"
    )


def _running_pids(
    project: ProjectDir,
    supervisor_pid: int,
    *,
    key: str = "partitions",
    what: str = "proxy for partition",
) -> dict[int, int]:
    """Pid per partition of the proxies supervisor `supervisor_pid` runs now, from
    state.json; raises naming the cause when it gave one up (exit 2 when the proxy itself
    exited 2, a config error, so scripts can tell it from an outage; else 3)."""
    state = project.read_state() or {}
    if state.get("supervisor_pid") != supervisor_pid:
        return {}  # not written yet by the supervisor just started
    running: dict[int, int] = {}
    index = "partition" if key == "partitions" else "slot"
    for entry in state.get(key, []):
        if entry.get("status") == "failed":
            log = Path(entry["log"])
            cause = last_error(log)
            raise CommandFailed(
                given_up_code(entry.get("last_exit")),
                f"the {what} {entry[index]} was given up (last exit "
                f"status {entry.get('last_exit')})"
                + (f": {cause}" if cause else "")
                + f"; see {log}",
            )
        if entry.get("status") == "running" and entry.get("pid"):
            running[int(entry[index])] = int(entry["pid"])
    return running


def given_up_code(last_exit: object) -> ExitCode:
    """Deploy's exit code for a proxy the supervisor gave up: BAD_INPUT when the proxy
    itself exited BAD_INPUT (its config is bad, which the deployer must fix), else
    UNAVAILABLE (it kept crashing)."""
    return ExitCode.BAD_INPUT if last_exit == ExitCode.BAD_INPUT else ExitCode.UNAVAILABLE


LOG_TAIL_BYTES = 16384


def last_error(log: Path) -> str | None:
    """Why a proxy exited, from the end of its log: its `error:` line (exit_on_errors),
    else the last line of a traceback."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - LOG_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("error: "):
            return line.removeprefix("error: ").strip()
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line.strip()
    return None


def proxy_ready(settings: Settings, partition: int, pid: int) -> bool:
    """Whether proxy `pid` is ready: GET /readyz when the proxy serves HTTP; else whether
    its gRPC port accepts. An answer counts only from a port `pid` listens on (where the
    OS tells, see `listening_ports`): a port another process holds says nothing of it."""
    http = settings.server.http_address(partition)
    if http is not None and http[1]:
        url = f"http://{_dialable(http[0])}:{http[1]}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return int(response.status) == 200 and _holds(pid, http[1])
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code != 404:
                return False  # it answers: not ready yet (e.g. a standby waiting for a lease)
        except OSError:
            pass  # no HTTP endpoint (turned off, or a proxy without one): fall back to gRPC
    port = settings.server.port + partition
    try:
        with socket.create_connection((_dialable(settings.server.host), port), 0.5):
            return _holds(pid, port)
    except OSError:
        return False


def _holds(pid: int, port: int) -> bool:
    """Whether `pid` listens on `port` (True when the OS cannot tell)."""
    ports = listening_ports(pid)
    return ports is None or port in ports


def _dialable(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _print_deployment(
    config: Path, settings: Settings, project: ProjectDir, pids: dict[int, int]
) -> None:
    partitions = len(pids)
    typer.echo(f"Deployed {settings.kafka.topic!r}: {partitions} proxies (state in {project.root})")
    for p in range(partitions):
        http = settings.server.http_address(p)
        extra = f"  http {_dialable(http[0])}:{http[1]}" if http else ""
        typer.echo(
            f"  partition {p}: {_dialable(settings.server.host)}:{settings.server.port + p}"
            f"{extra}  pid {pids.get(p)}"
        )
    names = ", ".join(sorted(settings.auth.active()))
    typer.echo(
        f"Token(s): {names} (in {config}, [auth] section; never printed)\n"
        f"TLS: {'on' if settings.tls.enabled else 'off'}\n"
        f"Stop: triage destroy --target local --config {config}"
    )


def destroy_local(config: Path, state_dir: Path | None) -> None:
    from triage_proxy.config.loader import load_settings
    from triage_proxy.errors import ConfigError
    from triage_proxy.store.aws import read_secret

    config = config.resolve()
    project = ProjectDir.for_config(config, state_dir)
    has_state = project.state_file.exists() or project.supervisor_pid_file.exists()
    if not has_state and not (project.root.exists() and project.proxy_pid_files()):
        typer.echo(f"nothing deployed from {config} (no state in {project.root})")
        return
    try:
        drain_s = load_settings(config, fetch_secret=read_secret).shutdown.drain_timeout_s
    except ConfigError:
        drain_s = FALLBACK_DRAIN_S  # a broken config must not keep processes alive
    _refuse_foreign(project, config, "destroy", live_only=False)
    stopped = _stop_local(project, str(config), drain_s)
    typer.echo(
        f"Destroyed: stopped {len(stopped)} process(es){_pids(stopped)}; "
        f"logs kept in {project.root}"
    )


def _refuse_foreign(project: ProjectDir, config: Path, command: str, *, live_only: bool) -> None:
    """Refuse (exit 5, touching nothing) when the state folder holds another config's
    deployment: state.json records another config, or a live process its pid files name
    runs with another `--config`. Deploy (`live_only`) minds only live ones: a dead
    deployment's leftovers are cleaned up as usual; destroy minds any."""
    others = sorted(project.owners() - {config})
    if not others:
        return
    if live_only and not any(
        (pid := project.read_pid(path)) is not None and pid_alive(pid, str(other))
        for path in [project.supervisor_pid_file, *project.proxy_pid_files()]
        for other in others
    ):
        return
    what = project.describe_owner() or f"config {', '.join(map(str, others))}"
    default = ProjectDir.for_config(config).root
    raise CommandFailed(
        ExitCode.CONFLICT,
        f"{project.root} holds another deployment ({what}), not one of {config}; "
        f"{command} stopped nothing and deleted nothing. To stop that one: `triage destroy "
        f"--target local --config {others[0]} --state-dir {project.root}`. This config's "
        f"state is in its own folder (default {default}); give it with --state-dir"
        + ("" if command == "destroy" else ", or another folder for a second deployment"),
    )


def _pids(pids: list[int]) -> str:
    return f" (pids {', '.join(map(str, pids))})" if pids else ""


def _stop_local(project: ProjectDir, marker: str, drain_s: float) -> list[int]:
    """Stop a local deployment by pid, live or half dead; return the pids stopped.

    Order: SIGTERM the supervisor (it drains its proxies) and wait -> SIGKILL it if it
    outlives the drain -> SIGTERM, wait, SIGKILL any proxy still alive (the supervisor was
    killed, or just did not finish) -> remove pid files and state.json (logs stay).
    """
    import signal

    stopped: list[int] = []
    wait_s = drain_s + STOP_MARGIN_S + 5
    pid = project.read_pid(project.supervisor_pid_file)
    if pid is not None and pid_alive(pid, marker):
        signal_pid(pid, signal.SIGTERM)
        if wait_gone([pid], wait_s, marker):
            typer.echo(
                f"warning: supervisor {pid} did not stop in {wait_s:g}s; killing it", err=True
            )
            signal_pid(pid, signal.SIGKILL)
            wait_gone([pid], 5.0, marker)
        stopped.append(pid)
    elif pid is not None:
        typer.echo(
            f"the supervisor (pid {pid}) is not running; cleaning up its leftovers", err=True
        )
    orphans = []
    for path in project.proxy_pid_files():
        proxy = project.read_pid(path)
        if proxy is not None and pid_alive(proxy, marker):
            signal_pid(proxy, signal.SIGTERM)
            orphans.append(proxy)
    for proxy in wait_gone(orphans, wait_s, marker):
        signal_pid(proxy, signal.SIGKILL)
    wait_gone(orphans, 5.0, marker)
    stopped.extend(orphans)
    for path in [*project.proxy_pid_files(), project.supervisor_pid_file, project.state_file]:
        path.unlink(missing_ok=True)
    return stopped
