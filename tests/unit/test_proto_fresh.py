"""The committed gRPC modules must match what proto/triage/v1 generates now."""

from __future__ import annotations

import filecmp
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "client_lib" / "triage_client" / "_proto"


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("triage_generate", ROOT / "proto" / "generate.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["triage_generate"] = module
    spec.loader.exec_module(module)
    written = module.generate(tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(p.name for p in COMMITTED.iterdir() if p.is_file()), (
        "generated file set differs: run `python proto/generate.py`"
    )
    for name in names:
        assert filecmp.cmp(tmp_path / name, COMMITTED / name, shallow=False), (
            f"{name} is stale: run `python proto/generate.py` and commit the result"
        )


def test_installed_packages_do_not_provide_top_level_proto(tmp_path: Path) -> None:
    # Run outside the checkout so only installed distributions are importable.
    code = "import importlib.util as u; print(u.find_spec('proto'), u.find_spec('triage'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["None", "None"]
