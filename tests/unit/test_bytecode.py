"""The `.pyc` files tests/bytecode.py writes before xdist's workers start are the ones
pytest and Python read: a rewritten test module keeps pytest's assert explanations, a
changed source is rewritten again, and the modules pytest rewrote in this process (the
conftests, the plugins) are found. If a pytest upgrade changed its cache, these fail
instead of the run silently rewriting everything in every worker again."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, get_cache_dir

from tests import bytecode

TEST_SOURCE = "def test_it():\n    x = 2\n    assert x == 3\n"


def _pyc(source: Path) -> Path:
    return get_cache_dir(source) / (source.name[:-3] + PYC_TAIL)


def test_a_rewritten_module_is_read_by_pytest_and_explains_its_asserts(tmp_path: Path) -> None:
    source = tmp_path / "test_sample.py"
    source.write_text(TEST_SOURCE)
    bytecode.rewrite([source])
    code = _read_pyc(source, _pyc(source))
    assert code is not None
    namespace: dict[str, object] = {}
    exec(code, namespace)
    with pytest.raises(AssertionError, match=r"assert 2 == 3"):
        namespace["test_it"]()  # type: ignore[operator]


def test_a_changed_source_is_rewritten_again(tmp_path: Path) -> None:
    source = tmp_path / "test_sample.py"
    source.write_text(TEST_SOURCE)
    bytecode.rewrite([source])
    source.write_text(TEST_SOURCE.replace("3", "4"))
    os.utime(source, (1_000_000_000, 1_000_000_000))
    assert _read_pyc(source, _pyc(source)) is None  # pytest would not use the stale one
    bytecode.rewrite([source])
    code = _read_pyc(source, _pyc(source))
    assert code is not None
    namespace: dict[str, object] = {}
    exec(code, namespace)
    with pytest.raises(AssertionError, match=r"assert 2 == 4"):
        namespace["test_it"]()  # type: ignore[operator]


def test_a_plain_module_gets_the_pyc_import_reads(tmp_path: Path) -> None:
    source = tmp_path / "helper.py"
    source.write_text("VALUE = 1\n")
    bytecode.compile_plain([source])
    assert Path(importlib.util.cache_from_source(str(source))).is_file()


def test_the_modules_pytest_rewrote_in_this_process_are_found() -> None:
    found = bytecode.rewritten_here()
    assert bytecode.ROOT / "tests" / "conftest.py" in found
    assert Path(__file__) in found


def test_every_test_module_is_listed_for_rewriting() -> None:
    listed = bytecode.modules_to_rewrite()
    assert Path(__file__) in listed
    assert bytecode.ROOT / "tests" / "conftest.py" in listed
    assert all(p.name.startswith("test_") or p.name == "conftest.py" for p in listed)


def test_the_imports_job_writes_the_pyc_of_what_it_imports_where_writes_are_off(
    tmp_path: Path,
) -> None:
    """`python -m tests.bytecode imports` writes the `.pyc` of each module and of what it
    imports, with PYTHONDONTWRITEBYTECODE set; a module that fails to import (pytest's
    Skipped, an error) stops nothing after it."""
    (tmp_path / "skips.py").write_text(
        "import pytest\npytest.skip('no', allow_module_level=True)\n"
    )
    (tmp_path / "broken.py").write_text("raise RuntimeError('at import')\n")
    (tmp_path / "inner.py").write_text("VALUE = 1\n")
    (tmp_path / "outer.py").write_text("import inner\n")
    env = {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(bytecode.ROOT)]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.bytecode", "imports", "skips", "broken", "outer"],
        cwd=bytecode.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for name in ("outer", "inner"):
        assert Path(importlib.util.cache_from_source(str(tmp_path / f"{name}.py"))).is_file()


def test_the_modules_this_process_imported_are_found() -> None:
    found = bytecode.imported_here()
    assert Path(pytest.__file__) in found  # pytest itself, imported the ordinary way
    assert Path(__file__) not in found  # pytest rewrote this one: the rewrite job's


def test_allow_writes_reaches_the_processes_started_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    bytecode.allow_writes()
    assert not sys.dont_write_bytecode
    child = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.dont_write_bytecode)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == "False"


@pytest.mark.parametrize("name", bytecode.SERVER_IMPORTS)
def test_every_module_the_imports_job_warms_exists(name: str) -> None:
    """The imports job skips a module that fails to import: a renamed one would only
    cost CPU, silently."""
    assert importlib.util.find_spec(name) is not None
