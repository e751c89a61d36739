"""docs/getting-started.md as a newcomer follows it, against the embedded stack it starts.

Every command the page shows is taken from the page's own text (a command that is not on
the page fails here before it runs) and run in a fresh folder whose `.venv` is this
interpreter's, with the environment `triage dev` prints for the next terminal; the code
blocks are the files under docs/snippets/ that the page includes. So a stale snippet, a
renamed option or a wrong printed line fails CI. What the page says comes back is
checked: where the record landed, what the handler printed, the dead letter.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.test_typescript_client import build_once
from tests.runlock import TS_PACKAGE_LOCK, shared_lock

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
SNIPPETS = ROOT / "docs" / "snippets"
TS_PACKAGE = ROOT / "clients" / "typescript"
WAIT_S = 120.0
"""Bound on each wait for a line (a stack starting on a loaded 2-core machine)."""


def page_commands() -> list[str]:
    """Every line of the page's ```sh blocks."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def page_sample() -> list[str]:
    """The lines of the page's sample of what `triage dev` prints (its ```text block)."""
    blocks: list[str] = re.findall(r"```text\n(.*?)```", PAGE.read_text(), re.DOTALL)
    (block,) = blocks
    return block.splitlines()


def sample_shape(lines: list[str]) -> list[str]:
    """What a sample of `triage dev`'s output must share with it: the table's row names,
    then each line below the table with its ports, token and paths left out."""
    rows = [line.split("│")[1].rstrip() for line in lines if line.startswith("│")]
    end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    values = r"(127\.0\.0\.1:\d+|/tmp/triage-dev-[^/ ]+|TRIAGE_TOKEN=\S+)"
    return rows + [re.sub(values, "...", line) for line in lines[end + 1 :]]


def shown(command: str) -> str:
    """`command`, which must be on the page as written."""
    assert command in page_commands(), f"docs/getting-started.md no longer shows: {command}"
    return command


class Lines:
    """A process's output, read by a thread, waited on line by line with a bound."""

    def __init__(self, stream: Iterable[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: Iterable[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = WAIT_S) -> re.Match[str]:
        for line in self.seen:
            match = re.search(pattern, line)
            if match:
                return match
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(
            f"no line matching {pattern!r} in {timeout} s:\n" + "\n".join(self.seen)
        )


@contextlib.contextmanager
def started(
    command: str, cwd: Path, env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[str], Lines, Lines]]:
    """`command` as the page writes it, as a process of its own (stopped by PID at exit)."""
    readers: list[threading.Thread] = []
    proc = subprocess.Popen(
        shlex.split(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        out, err = Lines(proc.stdout), Lines(proc.stderr)
        readers.extend((out.thread, err.thread))
        yield proc, out, err
    finally:
        if proc.poll() is None:
            # A test that failed midway: Ctrl-C first (triage dev then stops the broker,
            # moto and proxies it started in sessions of their own), then by PID.
            children = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        proc.wait()
        for reader in readers:
            reader.join()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def stop(proc: subprocess.Popen[str], err: Lines) -> None:
    """Ctrl-C, as the page says: the process must end by itself, with 0."""
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("did not stop on Ctrl-C:\n" + "\n".join(err.seen))
    assert code == 0, "\n".join(err.seen)


def shell(command: str, cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{command}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A newcomer's folder: `.venv` is this interpreter's virtualenv, the snippets saved."""
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    for snippet in ("consumer.py", "consumer.mts", "receiver.py"):
        shutil.copy(SNIPPETS / snippet, tmp_path / snippet)
    return tmp_path


@contextlib.contextmanager
def dev_stack(folder: Path, command: str) -> Iterator[dict[str, str]]:
    """`triage dev` as the page runs it; the environment its printed `export` line sets."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRIAGE_")}
    with started(command, folder, base) as (proc, _, err):
        export = err.wait_for(r"^\s+export (TRIAGE_ENDPOINT=.*)$").group(1)
        env = dict(base, **dict(item.split("=", 1) for item in shlex.split(export)))
        assert set(env) >= {"TRIAGE_ENDPOINT", "TRIAGE_TOKEN", "TRIAGE_CONFIG"}
        # The next lines it prints are the page's commands.
        # (They name this interpreter's folder, which is `.venv/bin` from the repo root.)
        bindir = str(Path(sys.executable).parent)
        push = "--push" in command  # the proxy delivers: no consumer to start
        consumer = r"^\s+(\S+ consumer\.py)$"
        for pattern in ([] if push else [consumer]) + [r"^\s+(\S+ produce .*)$"]:
            line = err.wait_for(pattern).group(1).replace(bindir, ".venv/bin")
            assert line in page_commands(), line
        err.wait_for(r"^Ctrl-C stops everything\.$")
        if push:
            assert not any(re.search(consumer, line) for line in err.seen), err.seen
        else:  # the page's sample of this output has its rows and lines
            printed = [line.replace(bindir, ".venv/bin") for line in err.seen]
            assert sample_shape(printed) == sample_shape(page_sample()), printed
        yield env
        stop(proc, err)


def test_the_python_path_works_as_written(folder: Path) -> None:
    with (
        dev_stack(folder, shown(".venv/bin/triage dev")) as env,
        started(shown(".venv/bin/python consumer.py"), folder, env) as (consumer, out, err),
    ):
        landed = shell(
            shown('.venv/bin/triage produce -c "$TRIAGE_CONFIG" --key order-1 --value hello'),
            folder,
            env,
        )
        assert re.fullmatch(r"triage-dev\[0\]@\d+\n", landed), landed
        offset = landed.split("@")[1].strip()
        out.wait_for(rf"^partition 0 offset {offset}: b'hello'$")

        several = shell(
            shown('seq 1 5 | .venv/bin/triage produce -c "$TRIAGE_CONFIG" --key order-2'),
            folder,
            env,
        )
        assert len(several.splitlines()) == 5, several
        for n in range(1, 6):
            out.wait_for(rf": b'{n}'$")

        shell(shown('.venv/bin/triage produce -c "$TRIAGE_CONFIG" --value poison'), folder, env)
        dead_letter_listed(folder, env, "ValueError: cannot handle this one")
        stop(consumer, err)


def dead_letter_listed(folder: Path, env: dict[str, str], reason: str) -> str:
    """`triage dlq list` as the page runs it, until it lists a dead letter for `reason`."""
    listing = shown('.venv/bin/triage dlq list -c "$TRIAGE_CONFIG"')
    wide = {**env, "COLUMNS": "200"}  # a terminal wide enough for the reason
    deadline = time.monotonic() + WAIT_S
    while reason not in (text := shell(listing, folder, wide)):
        assert time.monotonic() < deadline, f"no dead letter for {reason!r} listed:\n{text}"
        time.sleep(0.5)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_push_path_works_as_written(folder: Path) -> None:
    """The receiver and `triage dev --push` as shown, on a free port instead of 8080."""
    port = free_port()
    receiver = folder / "receiver.py"
    receiver.write_text(receiver.read_text().replace("8080", str(port)))
    command = shown(".venv/bin/triage dev --push http://127.0.0.1:8080/")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRIAGE_")}
    with (
        started(".venv/bin/python receiver.py", folder, base) as (_, got, _err),
        dev_stack(folder, command.replace("8080", str(port))) as env,
    ):
        landed = shell(
            shown('.venv/bin/triage produce -c "$TRIAGE_CONFIG" --key order-1 --value hello'),
            folder,
            env,
        )
        where = re.fullmatch(r"(.*)\[(\d+)\]@(\d+)\n", landed)
        assert where is not None, landed  # `triage produce` prints where it landed
        topic, partition, offset = where.groups()
        got.wait_for(rf"^{topic}/{partition}/{offset}: b'hello'$")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH: the TypeScript path needs Node.js 20 and npm")
    return path


def npm(*args: str, cwd: Path, timeout: float = 290) -> str:
    out = subprocess.run(
        [tool("npm"), *args, "--no-audit", "--no-fund"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TRIAGE_PYTHON": sys.executable},
    )
    assert out.returncode == 0, f"npm {' '.join(args)}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


# `npm ci && npm pack` rewrite clients/typescript's node_modules and dist: on the worker
# that runs the TypeScript client's tests, never beside them (--dist loadgroup).
@pytest.mark.xdist_group("typescript")
def test_the_typescript_path_works_as_written(folder: Path, shared_dir: Path) -> None:
    """The package installed from its tarball into another project, as the TypeScript
    guide says; the page's snippet compiled with --strict and run against the stack."""
    guide = (ROOT / "docs" / "guides" / "typescript-consumer.md").read_text()
    assert "cd clients/typescript && npm ci && npm pack" in guide
    # `npm ci` and the build (`npm pack`'s prepack script) once for the run, as the
    # TypeScript client's tests take them (build_once, under tests/runlock.py's lock): a
    # second `npm ci` or build would rewrite node_modules or dist/ while a test elsewhere
    # reads them (a run saw `tsc: not found`), and compiling again costs the CPU the rest of
    # the suite needs. So the pack runs without its prepack script, from that build.
    build_once(shared_dir)
    with shared_lock(shared_dir, TS_PACKAGE_LOCK):
        packed = npm("pack", "--ignore-scripts", "--pack-destination", str(folder), cwd=TS_PACKAGE)
        tarball = packed.strip().splitlines()[-1]
    assert f"npm install /path/to/triage/clients/typescript/{tarball}" in guide
    # The page's commands in a folder of one's own, the tarball's path made this one's.
    for line in (
        shown("npm init -y"),
        shown(f"npm install /path/to/triage/clients/typescript/{tarball}"),
        shown("npm install --save-dev typescript@5 @types/node@20"),
    ):
        args = shlex.split(line.replace("/path/to/triage/clients/typescript", str(folder)))
        npm(*args[1:], "--prefer-offline", cwd=folder)
    compile_and_run = shown(
        "npx tsc --strict --skipLibCheck --module nodenext --target es2022 --types node"
        " consumer.mts && node consumer.mjs"
    )
    compile_only, run = compile_and_run.split(" && ")
    npx, *args = shlex.split(compile_only)  # the project's own TypeScript, just installed
    compiled = subprocess.run(
        [tool(npx), *args], cwd=folder, capture_output=True, text=True, timeout=180
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    with (
        dev_stack(folder, shown(".venv/bin/triage dev")) as env,
        started(run, folder, env) as (consumer, out, err),
    ):
        landed = shell(
            shown('.venv/bin/triage produce -c "$TRIAGE_CONFIG" --key order-1 --value hello'),
            folder,
            env,
        )
        offset = landed.split("@")[1].strip()
        out.wait_for(rf"^partition 0 offset {offset}: hello$")
        shell('.venv/bin/triage produce -c "$TRIAGE_CONFIG" --value poison', folder, env)
        listed = dead_letter_listed(folder, env, "Error: cannot handle this one")
        assert "poison" not in "\n".join(out.seen), listed  # nacked, never printed
        stop(consumer, err)
