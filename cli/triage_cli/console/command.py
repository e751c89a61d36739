"""`triage console`: serve the web console for a config's deployment.

    triage console --config F [--host 127.0.0.1] [--port 9800] [--interval 3]
                   [--proxy-host H]

Prints one URL holding a fresh login token (`auth.py`) and serves until Ctrl-C or
SIGTERM (both stop it gracefully: running bulk jobs finish their chunk). Reads the same
config as every other command; the broker, the proxies and the table need not be up
(the pages say what is missing and recover when it comes back).

Exit codes: 0 stopped by a signal; 2 bad config or flags; 3 the address cannot be bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.status.command import DeploymentDirOption

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9800
URL_PREFIX = "console: "
"""What the line with the login URL starts with (scripts and `triage dev` read it)."""
START_TIMEOUT_S = 30.0


def console_url(host: str, port: int, token: str) -> str:
    """The login URL (a wildcard host is shown as loopback, an IPv6 one in brackets)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/?token={token}"


def console(
    config: Annotated[Path, typer.Option("--config", "-c", help="The proxies' TOML config file.")],
    host: Annotated[str, typer.Option(help="Address to serve on.")] = DEFAULT_HOST,
    port: Annotated[
        int, typer.Option(help="Port to serve on (0: any free port).", min=0, max=65535)
    ] = DEFAULT_PORT,
    interval: Annotated[
        float, typer.Option(help="Seconds between samples of the fleet (the plots).", min=0.5)
    ] = 3.0,
    proxy_host: Annotated[
        str | None, typer.Option(help="Ask the proxies on this host instead of server.http_host.")
    ] = None,
    state_dir: DeploymentDirOption = None,
) -> None:
    """Serve the web console: lag and what blocks each partition's commit, plots, dead
    letters to browse, replay and discard, and the fleet. Prints a URL with a login token."""
    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.aws import read_secret

    with exit_on_errors():
        settings = load_settings(config, fetch_secret=read_secret)
        with contextlib.suppress(KeyboardInterrupt):  # a second signal while stopping
            asyncio.run(_serve(settings, host, port, interval, proxy_host, str(config), state_dir))


async def _serve(
    settings: object,
    host: str,
    port: int,
    interval: float,
    proxy_host: str | None,
    config: str,
    state_dir: Path | None = None,
) -> None:
    from aiohttp import web

    from triage_cli.console.auth import Auth
    from triage_cli.console.server import make_app
    from triage_cli.signals import on_stop_signals

    auth = Auth()
    app = make_app(
        settings,  # type: ignore[arg-type]
        auth,
        interval_s=interval,
        proxy_host=proxy_host,
        config=config,
        state_dir=state_dir,
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise CommandFailed(
                ExitCode.UNAVAILABLE,
                f"cannot serve on {host}:{port}: {exc.strerror or exc} "
                "(pick another with --port, or 0 for any free port)",
            ) from None
        bound = port
        for address in runner.addresses:
            if isinstance(address, tuple):
                bound = int(address[1])
                break
        print(f"{URL_PREFIX}{console_url(host, bound, auth.token)}", flush=True)
        print("Open it in a browser (it logs you in); Ctrl-C stops.", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        with on_stop_signals(stop.set, asyncio.get_running_loop()):
            await stop.wait()
    finally:
        await runner.cleanup()


def spawn_console(
    config: Path, port: int = DEFAULT_PORT, log: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`triage console` for `config` as a child process (for `triage dev --console`);
    returns it and its login URL once it serves. The caller stops it by PID."""
    import select
    import time

    from triage_proxy.errors import UnavailableError

    errors = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "triage_cli.main", "console", "-c", str(config),
             "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )  # fmt: skip
    finally:
        if log is not None:
            errors.close()  # type: ignore[union-attr]
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(URL_PREFIX):
                return proc, line[len(URL_PREFIX) :].strip()
            if not line and proc.poll() is not None:
                break
    proc.kill()
    proc.wait()
    where = f"; see {log}" if log is not None else ""
    raise UnavailableError(f"the console did not start (exit {proc.returncode}){where}")
