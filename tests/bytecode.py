"""Compile once, before xdist's workers start, what every process of the run would
otherwise compile again: the project's own modules, pytest's rewritten test modules, and
the installed modules every worker imports at collection.

Where `PYTHONDONTWRITEBYTECODE` is set (as on the development machine, and in many CI
images), Python never writes a `.pyc` itself, and pytest, which rewrites the asserts of
test modules, conftests and plugins (all of hypothesis) and caches the result in
`__pycache__`, writes no cache either. Every process the run starts (hundreds: proxies,
CLI calls, moto servers, the workers) then compiled every module it imported from
source. Compiling all of site-packages at install instead (`uv pip install
--compile-bytecode`) costs 15-18 s before the first test, most of it for modules no test
imports (sympy, pip, moto's 150 other services).

So the run writes what it imports: `allow_writes` lets the controller and every process
it starts write the `.pyc` of what they import, into the run's own `.venv` and checkout,
once. What would otherwise be compiled by all the workers at the same moment, at the
start of the run, `compile_ahead` writes first, in one process per core: the project's
own modules, pytest's rewrites, and the imports of collection and of a session's moto
server. A `.pyc` stays valid while its source's mtime and size are unchanged, as always.

    python -m tests.bytecode plain FILE...     (one process's share)
    python -m tests.bytecode rewrite FILE...
    python -m tests.bytecode imports MODULE...
"""

from __future__ import annotations

import compileall
import contextlib
import importlib
import os
import struct
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib.machinery import SourceFileLoader
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "proxy/triage_proxy",
    "cli/triage_cli",
    "client_lib/triage_client",
    "proto/triage_protocol",
    "replay/triage_replay",
    "conformance",
    "tests",
)
"""The project's own modules (editable installs and test helpers), relative to ROOT."""

SERVER_IMPORTS = (
    "triage_cli.motoserver",
    "moto.server",
    "moto.dynamodb.models",
    "moto.dynamodb.responses",
    "werkzeug.serving",
    "triage_cli.main",
    "triage_proxy.app",
)
"""Besides collection's: what each worker's session moto server (the launcher, its first
DynamoDB request) and a proxy process import, at about the same time in every worker."""


def allow_writes() -> None:
    """Let this process, and every process it starts from now on, write the `.pyc` of
    what it imports (see the module's docstring)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def collected_modules(root: Path = ROOT) -> list[str]:
    """The dotted names of the modules collection imports (every module pytest
    rewrites is under `tests`, a package)."""
    return [
        ".".join(path.relative_to(root).with_suffix("").parts) for path in modules_to_rewrite(root)
    ]


def import_all(names: Iterable[str]) -> None:
    """Import each module, writing the `.pyc` of everything it imports; one that fails
    to import is left to the test that imports it, which reports the error."""
    allow_writes()
    for name in names:
        with contextlib.suppress(BaseException):  # pytest's Skipped is a BaseException
            importlib.import_module(name)


def plain_sources(root: Path = ROOT) -> list[Path]:
    """Every .py file of PACKAGES (test modules too: harmless, and cheap)."""
    found: list[Path] = []
    for package in PACKAGES:
        found.extend(sorted((root / package).rglob("*.py")))
    return [path for path in found if "node_modules" not in path.parts]


def modules_to_rewrite(root: Path = ROOT) -> list[Path]:
    """What pytest rewrites under tests/ with the default `python_files`: test_*.py,
    *_test.py and conftest.py."""
    tests = root / "tests"
    found = {
        *tests.rglob("test_*.py"),
        *tests.rglob("*_test.py"),
        *tests.rglob("conftest.py"),
    }
    return sorted(found)


def rewritten_here() -> list[Path]:
    """The files of the modules this process loaded through pytest's assert rewriting
    (the conftests and the plugins, e.g. hypothesis): workers load them the same way."""
    from _pytest.assertion.rewrite import AssertionRewritingHook

    return _loaded_here(AssertionRewritingHook)


def imported_here() -> list[Path]:
    """The source files of the modules this process imported the ordinary way (pytest,
    its plugins and what the conftests import): workers import them too."""
    return _loaded_here(SourceFileLoader)


def _loaded_here(loader: type) -> list[Path]:
    """The files of the modules in sys.modules that a `loader` loaded."""
    found = set()
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        if spec is not None and isinstance(spec.loader, loader) and spec.origin:
            found.add(Path(spec.origin))
    return sorted(found)


def compile_plain(paths: Iterable[Path]) -> None:
    """A standard `.pyc` for each file (what `import` reads), unless it is current."""
    for path in paths:
        # A file that cannot be compiled here is compiled by the import that needs it,
        # which also reports its error where the test that imports it can show it.
        with contextlib.suppress(Exception):
            compileall.compile_file(path, quiet=2)


def _current(pyc: Path, source: Path) -> bool:
    """Whether `pyc` holds the code of `source` as it is now (pytest's test: the mtime
    and size in its header)."""
    try:
        with open(pyc, "rb") as handle:
            header = handle.read(16)
        stat = source.stat()
    except OSError:
        return False
    return len(header) == 16 and header[8:16] == struct.pack(
        "<LL", int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF
    )


def rewrite(paths: Iterable[Path]) -> None:
    """pytest's rewritten `.pyc` for each file, where pytest reads it (its own cache
    name, its own format), written atomically as pytest writes it."""
    from _pytest.assertion.rewrite import (
        PYC_TAIL,
        _rewrite_test,
        _write_pyc_fp,
        get_cache_dir,
    )

    for path in paths:
        cache = get_cache_dir(path)
        pyc = cache / (path.name[:-3] + PYC_TAIL)
        if _current(pyc, path):
            continue
        try:
            # config=None: the rewrite without the experimental assertion-pass hook,
            # which is what pytest does when the ini option is off (compile_ahead checks).
            stat, code = _rewrite_test(path, None)  # type: ignore[arg-type]
            cache.mkdir(exist_ok=True)
            partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
            with open(partial, "wb") as handle:
                _write_pyc_fp(handle, stat, code)
            os.replace(partial, pyc)
        except (SyntaxError, OSError):
            continue  # pytest rewrites it itself at import, and reports the error there


def _shares(paths: Sequence[Path], count: int) -> list[list[Path]]:
    """`paths` dealt round-robin into `count` lists (biggest first, so shares even out)."""
    ordered = sorted(paths, key=lambda p: p.stat().st_size, reverse=True)
    return [ordered[i::count] for i in range(count)]


def compile_ahead(pytest_rewrites: bool, root: Path = ROOT) -> None:
    """Write the `.pyc` of the project's modules split over one child process per core,
    and of collection's imports in one more; wait for them. `pytest_rewrites`: also
    pytest's (only where its rewrite is the default one)."""
    jobs = [("plain", sorted({*plain_sources(root), *imported_here()}))]
    if pytest_rewrites:
        jobs.append(("rewrite", sorted({*modules_to_rewrite(root), *rewritten_here()})))
    count = os.cpu_count() or 1
    imports = [*collected_modules(root), *SERVER_IMPORTS]
    children = [
        # One process: importing is not split without importing the shared part twice.
        subprocess.Popen(
            [sys.executable, "-m", "tests.bytecode", "imports", *imports],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    for kind, paths in jobs:
        for share in _shares(paths, count):
            if share:
                children.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.bytecode", kind, *map(str, share)],
                        cwd=root,
                        stdin=subprocess.DEVNULL,
                    )
                )
    for child in children:
        child.wait()


def main(argv: Sequence[str]) -> None:
    kind, *files = argv
    paths = [Path(f) for f in files]
    if kind == "imports":
        import_all(files)
    elif kind == "plain":
        compile_plain(paths)
    elif kind == "rewrite":
        rewrite(paths)
    else:
        raise SystemExit(f"unknown kind {kind!r}: plain, rewrite or imports")


if __name__ == "__main__":
    main(sys.argv[1:])
