"""Every committed file generated from the contract (the Python modules and stubs in
proto/triage_protocol/, the TypeScript client's src/generated/) must match what
proto/generate.py makes from proto/triage/v1 and triage_protocol/constants.py now."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import triage_protocol
from triage_protocol import constants

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("triage_generate", ROOT / "proto" / "generate.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["triage_generate"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_fresh() -> None:
    generate = _generator()
    wanted: dict[Path, str] = generate.outputs()
    fix = "run `python proto/generate.py` and commit the result"
    assert {p.name for p in wanted} >= {"triage_pb2.py", "messages.ts", "constants.ts"}
    leftover = generate.generated_files() - set(wanted)
    assert not leftover, f"no longer generated: {sorted(map(str, leftover))}: {fix}"
    for path, text in wanted.items():
        name = path.relative_to(ROOT)
        assert path.exists(), f"{name} is missing: {fix}"
        assert path.read_text() == text, f"{name} is stale: {fix}"


def test_the_installed_package_is_this_checkout() -> None:
    # An older triage-protocol installed beside the checkout would make the test above
    # compare one contract and the tests run another.
    assert Path(triage_protocol.__file__).parent == ROOT / "proto" / "triage_protocol"


def test_constants_import_neither_grpc_nor_protobuf() -> None:
    code = (
        "import sys, triage_protocol.constants; "
        "print('grpc' in sys.modules, 'google' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_every_constant_is_exported_once() -> None:
    public = sorted(n for n in vars(constants) if n.isupper() and not n.startswith("_"))
    assert sorted(constants.__all__) == public


def test_installed_packages_do_not_provide_top_level_proto(tmp_path: Path) -> None:
    # Run outside the checkout so only installed distributions are importable.
    code = "import importlib.util as u; print(u.find_spec('proto'), u.find_spec('triage'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["None", "None"]
