"""The local supervisor with real child processes (stand-ins for `triage proxy` that
record the signals they get), and how deploy reads a proxy it gave up. The proxy's own
SIGHUP reload is tested against a real proxy in tests/integration/test_security.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from triage_cli.deploy import _running_pids, fleet_not_ready_detail, given_up_code
from triage_cli.exitcodes import CommandFailed, ExitCode
from triage_cli.supervisor import ProjectDir, RestartPolicy, Supervisor
from triage_proxy.config.loader import settings_from_dict

RAW: dict[str, Any] = {
    "kafka": {"bootstrap_servers": "b:9092", "topic": "orders", "group_id": "g", "partitions": 2},
    "auth": {"tokens": {"billing": "a-token-of-sixteen-chars-or-more"}},
    "dead_letters": {"table": "dlq"},
    "shutdown": {"drain_timeout_s": 1},
}

CHILD = """
import pathlib, signal, sys
out = pathlib.Path(sys.argv[1])
def record(what):
    with out.open("a") as f:
        f.write(what + "\\n")
if sys.argv[2] == "reloads":  # a proxy that has installed its SIGHUP handler
    signal.signal(signal.SIGHUP, lambda signum, frame: record("HUP"))
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
record("ready")
while True:
    signal.pause()
"""

SUPERVISOR = """
import logging, sys
from pathlib import Path
from triage_cli.supervisor import ProjectDir, Supervisor, serve
from triage_proxy.config.loader import settings_from_dict

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
root, child, fleet = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "fleet"

def command(config, index):
    # child 0 reloads on SIGHUP; child 1 is still starting (no handler yet)
    return [sys.executable, child, str(root / f"signals-{index}"), ("reloads", "starting")[index]]

raw = {"kafka": {"bootstrap_servers": "b:9092", "topic": "t", "group_id": "g"},
       "auth": {"token": "a-token-of-sixteen-chars-or-more"},
       "dead_letters": {"table": "dlq"}, "shutdown": {"drain_timeout_s": 1}}
supervisor = Supervisor(
    root / "triage.toml", ProjectDir(root), settings_from_dict(raw, {}), 2,
    proxies=2 if fleet else None, command=command,
)
sys.exit(serve(supervisor))
"""


def wait_for(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def sighup_ignored(pid: int) -> bool:
    """Whether process `pid` ignores SIGHUP (its SigIgn mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & (1 << (signal.SIGHUP - 1)))


@pytest.fixture
def supervised(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str]]:
    """A supervisor (the real `serve`, so the real signal handlers) running two stand-in
    proxies, in `request.param` mode ("fleet" or "pinned"); stopped by pid at the end."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "supervisor.py").write_text(SUPERVISOR)
    log = (tmp_path / "supervisor.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "supervisor.py"),
            str(tmp_path),
            str(tmp_path / "child.py"),
            request.param,
        ],
        stdout=log,
        stderr=log,
        text=True,
    )
    try:
        yield proc
    finally:
        pids = [int(e["pid"]) for e in _entries(ProjectDir(tmp_path)) if e.get("pid")]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


def _entries(project: ProjectDir) -> list[dict[str, Any]]:
    state = project.read_state() or {}
    return [*state.get("partitions", []), *state.get("proxies", [])]


@pytest.mark.parametrize("supervised", ["fleet", "pinned"], indirect=True)
def test_sighup_to_the_supervisor_reaches_every_proxy_and_stops_nothing(
    supervised: subprocess.Popen[str], tmp_path: Path
) -> None:
    project = ProjectDir(tmp_path)
    assert wait_for(lambda: all("ready" in lines(tmp_path / f"signals-{i}") for i in (0, 1)))
    assert wait_for(lambda: len([e for e in _entries(project) if e["pid"]]) == 2)
    before = {e.get("slot", e.get("partition")): e["pid"] for e in _entries(project)}

    supervisor_pid = project.read_pid(project.supervisor_pid_file)
    assert supervisor_pid == supervised.pid  # the path the docs give
    os.kill(supervisor_pid, signal.SIGHUP)
    assert wait_for(lambda: "HUP" in lines(tmp_path / "signals-0")), lines(tmp_path / "signals-0")
    os.kill(supervisor_pid, signal.SIGHUP)  # a second one is passed on too
    assert wait_for(lambda: lines(tmp_path / "signals-0").count("HUP") == 2)

    assert wait_for(
        lambda: (tmp_path / "supervisor.log").read_text().count("SIGHUP passed on") == 2
    )
    log = (tmp_path / "supervisor.log").read_text()
    assert supervised.poll() is None, log
    # The proxy still starting (no handler yet) inherited SIGHUP ignored, so the signal
    # cannot kill it: read from its own mask, not from waiting to see it survive.
    assert sighup_ignored(before[1]), log
    assert all(alive(pid) for pid in before.values()), log
    after = {e.get("slot", e.get("partition")): e["pid"] for e in _entries(project)}
    assert after == before
    assert all(e["restarts"] == 0 and e["status"] == "running" for e in _entries(project))
    assert log.count("SIGHUP passed on to 2 proxies") == 2, log

    supervised.terminate()
    assert supervised.wait(15) == 0
    assert not any(alive(pid) for pid in before.values())
    log = (tmp_path / "supervisor.log").read_text()
    fleet = (project.read_state() or {}).get("mode") == "fleet"
    named = "proxy in slot" if fleet else "proxy for partition"
    assert f"{named} 0 started" in log, log
    assert f"{named} 1 started" in log, log
    wrong = "proxy for partition" if named == "proxy in slot" else "proxy in slot"
    assert wrong not in log


@pytest.mark.parametrize(
    ("fleet", "named"), [(True, "proxy in slot"), (False, "proxy for partition")]
)
def test_a_proxy_with_a_bad_config_is_given_up_at_first_start_and_state_json_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fleet: bool, named: str
) -> None:
    """What deploy reads (and the page promises): the first start's exit 2 is recorded in
    state.json as `failed` with its exit status before the supervisor exits."""
    project = ProjectDir(tmp_path)
    supervisor = Supervisor(
        tmp_path / "triage.toml",
        project,
        settings_from_dict(RAW, {}),
        1,
        RestartPolicy(),
        proxies=1 if fleet else None,
        command=lambda config, index: [sys.executable, "-c", "raise SystemExit(2)"],
    )
    with caplog.at_level(logging.INFO, logger="triage_cli.supervisor"):
        assert supervisor.run() == ExitCode.FAILURE
    state = project.read_state()
    assert state is not None
    assert state["status"] == "failed"
    [entry] = state["proxies" if fleet else "partitions"]
    assert entry["status"] == "failed"
    assert entry["last_exit"] == ExitCode.BAD_INPUT
    assert entry["restarts"] == 0
    assert f"{named} 0 exited with status 2" in caplog.text
    wrong = "proxy for partition" if fleet else "proxy in slot"
    assert wrong not in caplog.text
    assert not project.supervisor_pid_file.exists()


def _given_up_state(project: ProjectDir, last_exit: int, key: str) -> None:
    index = "slot" if key == "proxies" else "partition"
    entry = {index: 0, "pid": None, "status": "failed", "last_exit": last_exit}
    entry["log"] = str(project.proxy_log(0))
    project.proxy_log(0).write_text(
        "error: config key 'server.http_port': cannot listen on 127.0.0.1:9700: in use\n"
    )
    project.write_state({"supervisor_pid": 1234, key: [entry]})


@pytest.mark.parametrize("key", ["proxies", "partitions"])
@pytest.mark.parametrize(
    ("last_exit", "code"),
    [
        (ExitCode.BAD_INPUT, ExitCode.BAD_INPUT),
        (1, ExitCode.UNAVAILABLE),
        (-9, ExitCode.UNAVAILABLE),
    ],
)
def test_deploy_exits_2_when_the_proxy_it_gave_up_exited_2(
    tmp_path: Path, key: str, last_exit: int, code: ExitCode
) -> None:
    """A config error (the proxy's own exit 2) is deploy's exit 2, so a script can tell it
    from an outage (3)."""
    project = ProjectDir(tmp_path)
    _given_up_state(project, last_exit, key)
    with pytest.raises(CommandFailed) as failed:
        _running_pids(project, 1234, key=key)
    assert failed.value.code == code
    assert given_up_code(last_exit) == code
    assert "given up" in str(failed.value)
    assert "cannot listen on 127.0.0.1:9700" in str(failed.value)
    assert json.loads(project.state_file.read_text())[key][0]["status"] == "failed"


# --- deploy's not-ready error names what each fleet process says ---------------------------


def test_a_fleet_no_process_of_which_has_an_assignment_says_the_group_is_waited_on() -> None:
    """An operator's deploy after a stalled broker: both processes joined the group and
    were never assigned anything; the error said only "0 of 2 processes ready"."""
    waiting = {"state": "running", "member": False, "assigned": [], "served": []}
    detail = fleet_not_ready_detail({0: waiting, 1: waiting}, "orders-local")
    assert detail.startswith(
        "slot 0: running, no assignment from the group yet; "
        "slot 1: running, no assignment from the group yet; "
        "no process was given partitions by consumer group 'orders-local'"
    )
    # Seen on the embedded broker after `triage destroy` then `triage deploy`: the way out.
    assert "On the embedded broker (Tansu 0.6) a group whose processes all stopped" in detail
    assert "set a new kafka.group_id (docs/guides/deploy-local.md)" in detail


def test_a_fleet_partly_ready_says_what_each_process_serves() -> None:
    serving = {"state": "running", "member": True, "assigned": [0, 1], "served": [0]}
    detail = fleet_not_ready_detail({0: serving, 1: None}, "g")
    assert detail == "slot 0: running, assigned [0, 1], serving [0]; slot 1: no /status answer"
