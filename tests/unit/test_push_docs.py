"""docs/guides/push.md against the code it describes: its receiver recipes and signature checks
(Python, and TypeScript compiled with the client package's `tsc` and run by `node`) run
on what the proxy really sends (push/cloudevents.py, push/signing.py) and recover every
byte, saved as the files the page names (a receiver imports its recover module); the
receivers bind loopback and answer what the proxy reads as ack, nack and retry; every
package a Python block imports beyond the standard library has its install command on
the page; its config examples load; its tables name every `[[push]]` key with its default,
every /status field and metric, and the verdicts responses.py gives; its links resolve.

A doc that drifts from the code fails here rather than in a receiver team's production.
Node.js 20 and npm are on every machine this suite runs on (as for the TypeScript
client's tests): a missing one fails with a clear message.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import hmac
import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import unicodedata
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.runlock import TS_INSTALLED, TS_PACKAGE_LOCK, shared_lock
from triage_proxy.config.push import PushTargetSettings, push_targets
from triage_proxy.config.secrets import Secrets
from triage_proxy.observe.metrics import push_families
from triage_proxy.observe.snapshot import PUSH_BUCKETS_S, LatencyHistogram, PushTargetSnapshot
from triage_proxy.push.cloudevents import (
    BATCH_CONTENT_TYPE,
    EventShape,
    batch_body,
    batch_event,
    binary_headers,
    event_id,
)
from triage_proxy.push.responses import Verdict, batch_failures, classify
from triage_proxy.push.signing import sign
from triage_proxy.push.signing import verify as proxy_verify
from triage_proxy.structs import Record

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "guides" / "push.md"
# The worker that runs the TypeScript client's tests runs these (--dist loadgroup): one
# `npm ci` (when node_modules is missing), one compile of the doc's TypeScript.
pytestmark = pytest.mark.xdist_group("typescript")

TS_PACKAGE = ROOT / "clients" / "typescript"

SHAPE = EventShape(source="triage://billing/orders", type="t.x", content_type="application/x")

# Every case a receiver must get right: null, empty and binary keys; a key that needs
# percent-encoding in a header; duplicate header names, null and empty header values; an
# empty value and a null one (a tombstone); a record without a timestamp.
RECORDS = [
    Record("orders", 0, 1, b"k", b"v", (), 1_700_000_000_123),
    Record("orders", 0, 2, None, b"no key", (), 0),
    Record("orders", 0, 3, b"", b"empty key", (("h", b"1"),), 5),
    Record(
        "orders",
        1,
        4,
        b"\xff\x00\n",
        b"\x00\xff binary",
        (("dup", b"a"), ("dup", b"\xfe"), ("none", None)),
        5,
    ),
    Record("orders", 1, 5, 'ü "%\n<'.encode(), b"", (("é", b""),), -1),
    Record("orders", 2, 6, b"tomb", None, (), 7),
    Record("orders", 2, 7, None, None, (("only", None),), 7),
]

Recovered = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes | None]]]


def expected(record: Record) -> Recovered:
    return event_id(record), record.key, record.value, list(record.headers)


# --- reading the doc ----------------------------------------------------------------------

FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)


def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def code_blocks(lang: str | None = None) -> list[str]:
    """The fenced blocks of the doc (of one language), their indentation removed."""
    out = []
    for match in FENCE.finditer(doc()):
        indent, block_lang, body = match.groups()
        if lang is None or block_lang == lang:
            out.append("".join(line[len(indent) :] for line in body.splitlines(keepends=True)))
    return out


def tagged(tag: str) -> str:
    """The one block whose first line is `# docs: <tag>` or `// docs: <tag>`."""
    found = [
        block
        for block in code_blocks()
        if block.split("\n", 1)[0].strip() in (f"# docs: {tag}", f"// docs: {tag}")
    ]
    assert len(found) == 1, f"docs/guides/push.md has {len(found)} blocks tagged {tag!r}, want 1"
    return found[0]


def section(title: str) -> str:
    """The text of the `## <title>` section, up to the next `## `."""
    text = doc()
    assert f"\n## {title}\n" in text, f"no section {title!r}"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in `text` (header and divider rows included)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def run_python(*tags: str) -> dict[str, Any]:
    """Execute the tagged Python blocks, in order, in one namespace (not as __main__)."""
    namespace: dict[str, Any] = {"__name__": "push_docs_recipe"}
    for tag in tags:
        exec(compile(tagged(tag), f"docs/guides/push.md[{tag}]", "exec"), namespace)
    return namespace


def run_python_receiver(name: str = "push_docs_recipe") -> dict[str, Any]:
    """The receiver as the page has a reader save it: python-recover as `recover.py`, and
    python-receiver (which imports `recover`) executed under `name`."""
    recover = ModuleType("recover")
    recover.__file__ = "recover.py"
    exec(
        compile(tagged("python-recover"), "docs/guides/push.md[python-recover]", "exec"),
        vars(recover),
    )
    saved = sys.modules.get("recover")
    sys.modules["recover"] = recover
    try:
        namespace: dict[str, Any] = {"__name__": name}
        receiver = tagged("python-receiver")
        exec(compile(receiver, "docs/guides/push.md[python-receiver]", "exec"), namespace)
    finally:
        if saved is None:
            del sys.modules["recover"]
        else:
            sys.modules["recover"] = saved
    return namespace


# --- the Python recipes -------------------------------------------------------------------


def test_every_package_a_python_block_needs_has_its_install_command() -> None:
    installs = " ".join(re.findall(r"`[^`\n]*pip install ([^`\n]+)`", doc()))
    local = {"recover"}  # the page's own file, beside the receiver
    for block in code_blocks("python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top in sys.stdlib_module_names or top in local:
                    continue
                assert top in installs, f"no `pip install {top}` on the page for:\n{block}"


def test_the_python_recipe_recovers_every_byte_in_binary_mode() -> None:
    from_binary = run_python("python-recover")["from_binary"]
    for record in RECORDS:
        headers = binary_headers(record, SHAPE)
        # As a web framework may hand them over: names in any case.
        headers = {name.title(): value for name, value in headers.items()}
        assert from_binary(headers, record.value or b"") == expected(record)


def test_the_python_recipe_recovers_every_byte_of_a_batch() -> None:
    from_batch = run_python("python-recover")["from_batch"]
    body = batch_body([batch_event(record, SHAPE) for record in RECORDS])
    assert from_batch(body) == [expected(record) for record in RECORDS]


def test_the_documented_batch_example_parses() -> None:
    from_batch = run_python("python-recover")["from_batch"]
    (example,) = [b for b in code_blocks("json") if '"specversion"' in b]
    first, second = from_batch(example.encode())
    assert first == ("orders/0/41", b"order-7", b'{"total": 12}', [])
    assert second == ("orders/0/42", b"order-7", None, [])


class Served:
    """The doc's Python receiver on a loopback port, with a handler that records what it
    was given: ValueError for a value of b"poison", RuntimeError for b"flaky"."""

    def __init__(self) -> None:
        namespace = run_python_receiver()
        self.seen: list[Recovered] = []

        def handle(record_id: str, key: Any, value: Any, headers: Any) -> None:
            if value == b"poison":
                raise ValueError("poison pill")
            if value == b"flaky":
                raise RuntimeError("try later")
            self.seen.append((record_id, key, value, headers))

        namespace["handle"] = handle  # the receiver calls the module's `handle`

        receiver = namespace["Receiver"]  # a class of this namespace alone: free to patch
        receiver.log_message = lambda *args: None  # the request log would clutter the output
        self.server = namespace["ThreadingHTTPServer"](("127.0.0.1", 0), receiver)
        # A short poll so that shutdown() returns at once rather than within 0.5 s.
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.connection = http.client.HTTPConnection("127.0.0.1", self.server.server_port)

    def post(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        # One connection for every request: the receiver keeps it alive, as the proxy expects.
        self.connection.request("POST", "/", body=body, headers=headers)
        response = self.connection.getresponse()
        answer = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, answer

    def close(self) -> None:
        self.connection.close()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def served() -> Iterator[Served]:
    receiver = Served()
    try:
        yield receiver
    finally:
        receiver.close()


POISON = Record("orders", 3, 8, b"p", b"poison", (), 9)
FLAKY = Record("orders", 3, 9, b"f", b"flaky", (), 9)


def test_the_python_receiver_answers_what_the_proxy_reads_as_ack_nack_retry(
    served: Served,
) -> None:
    verdicts = {}
    for record in [*RECORDS, POISON, FLAKY]:
        status, headers, body = served.post(binary_headers(record, SHAPE), record.value or b"")
        verdicts[record.offset] = classify(status, headers, body)
    assert served.seen == [expected(record) for record in RECORDS]
    assert {verdicts[r.offset].verdict for r in RECORDS} == {Verdict.ACK}
    assert verdicts[POISON.offset].verdict is Verdict.NACK
    assert verdicts[POISON.offset].reason == "HTTP 422: poison pill"
    assert verdicts[FLAKY.offset].verdict is Verdict.RETRY


def test_the_python_receiver_answers_a_batch_with_its_failures(served: Served) -> None:
    records = [*RECORDS, POISON, FLAKY]
    body = batch_body([batch_event(record, SHAPE) for record in records])
    status, headers, answer = served.post({"content-type": BATCH_CONTENT_TYPE}, body)
    assert classify(status, headers, answer).verdict is Verdict.ACK
    assert served.seen == [expected(record) for record in RECORDS]
    failures = batch_failures(answer, {event_id(r) for r in records})
    assert failures is not None
    assert {i: (o.verdict, o.reason) for i, o in failures.items()} == {
        event_id(POISON): (Verdict.NACK, "poison pill"),
        event_id(FLAKY): (Verdict.RETRY, "try later"),
    }


def test_the_python_receiver_run_as_a_script_binds_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bound: list[tuple[str, int]] = []

    class NotServing:
        def __init__(self, address: tuple[str, int], handler: type) -> None:
            bound.append(address)

        def serve_forever(self) -> None:
            pass

    monkeypatch.setattr(http.server, "ThreadingHTTPServer", NotServing)
    run_python_receiver("__main__")
    assert bound == [("127.0.0.1", 8080)]


# --- the signature ------------------------------------------------------------------------

NOW = 1_700_000_000
SECRET = "whsec-ü-0123"
BODY = b'{"a": 1}\x00\xff'


def signature_cases() -> list[tuple[str, bytes, str, bool]]:
    """(secret, body, header, whether a receiver must accept it) at NOW."""
    good = sign(SECRET.encode(), BODY, NOW)
    return [
        (SECRET, BODY, good, True),
        (SECRET, BODY + b" ", good, False),  # a tampered body
        ("another secret", BODY, good, False),
        (SECRET, BODY, sign(SECRET.encode(), BODY, NOW - 299), True),
        (SECRET, BODY, sign(SECRET.encode(), BODY, NOW - 301), False),  # a replay
        (SECRET, BODY, sign(SECRET.encode(), BODY, NOW + 301), False),
        (SECRET, b"", sign(SECRET.encode(), b"", NOW), True),  # a tombstone's empty body
        (SECRET, BODY, good + ",v0=future", True),  # fields a later version may add
        (SECRET, BODY, good.split(",")[1], False),  # no timestamp
        (SECRET, BODY, f"t=abc,{good.split(',')[1]}", False),
        (SECRET, BODY, f"t={NOW},v1=", False),
        (SECRET, BODY, f"t={NOW},v1=zz", False),
        (SECRET, BODY, "", False),
    ]


def test_the_python_verification_accepts_the_proxys_signature_and_refuses_the_rest() -> None:
    namespace = run_python("python-verify")
    namespace["time"] = SimpleNamespace(time=lambda: float(NOW))  # the recipe's clock
    verify = namespace["verify"]
    for secret, body, header, accepted in signature_cases():
        assert verify(secret.encode(), body, header) is accepted, (secret, body, header)
        # ...and agrees with the proxy's own reference check.
        assert proxy_verify(secret.encode(), body, header, NOW) is accepted, header


def test_the_signature_is_the_documented_hmac() -> None:
    header = sign(SECRET.encode(), BODY, NOW)
    mac = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert header == f"t={NOW},v1={mac}"
    assert "triage-signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret," in doc()


# --- the TypeScript recipes ---------------------------------------------------------------

HARNESS = """
import { readFileSync } from "node:fs";
import { createServer, request } from "node:http";
import { fromBatch, fromBinary } from "./recover.mjs";
import { verify } from "./verify.mjs";

const input = JSON.parse(readFileSync(0, "utf8"));
const b64 = (b) => (b === null ? null : b.toString("base64"));
const show = (r) => [r.id, b64(r.key), b64(r.value), r.headers.map(([n, v]) => [n, b64(v)])];

// Binary mode goes through node:http both ways, so the recipe sees the headers as a
// receiver's server parses them (lower-cased names, empty values kept).
const server = createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    res.end(JSON.stringify(show(fromBinary(req.headers, Buffer.concat(chunks)))));
  });
});
await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
const post = ({ headers, body }) =>
  new Promise((resolve, reject) => {
    const req = request(
      { port: server.address().port, host: "127.0.0.1", method: "POST", path: "/", headers },
      (res) => {
        let text = "";
        res.on("data", (c) => (text += c));
        res.on("end", () => resolve(JSON.parse(text)));
      },
    );
    req.on("error", reject);
    req.end(Buffer.from(body, "base64"));
  });
const binary = [];
for (const c of input.binary) binary.push(await post(c));
server.close();

process.stdout.write(
  JSON.stringify({
    binary,
    batch: fromBatch(Buffer.from(input.batch, "base64")).map(show),
    verify: input.verify.map(([secret, body, header, now]) =>
      verify(secret, Buffer.from(body, "base64"), header, now),
    ),
  }),
);
"""


# The page's receiver, run as `node receiver.mjs` would run it (PORT=0: a free port), with a
# `handle` that throws Poison for a value of "poison" and an Error for "flaky": it POSTs
# each case (given on stdin) to the address the receiver listens on.
RECEIVER_HARNESS = """
import { readFileSync } from "node:fs";
import { Server, request } from "node:http";

const input = JSON.parse(readFileSync(0, "utf8"));
let server;
const listen = Server.prototype.listen;
Server.prototype.listen = function (...args) {
  server = this;
  return listen.apply(this, args);
};
await import("./receiver_run.mjs");
if (!server.listening) await new Promise((resolve) => server.once("listening", resolve));
const { address, port } = server.address();
const post = ({ headers, body }) =>
  new Promise((resolve, reject) => {
    const req = request(
      { host: address, port, method: "POST", path: "/", headers, agent: false },
      (res) => {
        const chunks = [];
        res.on("data", (c) => chunks.push(c));
        res.on("end", () =>
          resolve([res.statusCode, res.headers, Buffer.concat(chunks).toString("base64")]),
        );
      },
    );
    req.on("error", reject);
    req.end(Buffer.from(body, "base64"));
  });
const answers = [];
for (const c of input) answers.push(await post(c));
server.close();
process.stdout.write(JSON.stringify({ address, answers }));
"""

YOUR_WORK = (
    "  // Your work: throw Poison to dead-letter the record, anything else to redeliver it.\n"
)
TEST_WORK = """  if (record.value?.toString() === "poison") throw new Poison("poison pill");
  if (record.value?.toString() === "flaky") throw new Error("try later");
"""


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH: docs/guides/push.md's TypeScript is checked with Node 20"
        )
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    """The doc's TypeScript blocks saved as the files the page names, type-checked (strict,
    against @types/node) and compiled with the client package's TypeScript, as the page's
    `npx tsc` line does: recover.mjs and verify.mjs, receiver.mjs (which imports
    ./recover.mjs), and receiver_run.mjs, the receiver with a `handle` to run it by."""
    node = tool("node")
    tsc = TS_PACKAGE / "node_modules" / "typescript" / "bin" / "tsc"
    installed = shared_dir / TS_INSTALLED
    if not installed.exists():
        with shared_lock(shared_dir, TS_PACKAGE_LOCK):  # one `npm ci` (tests/runlock.py)
            if not tsc.is_file():
                out = subprocess.run(
                    [tool("npm"), "ci", "--no-audit", "--no-fund"],
                    cwd=TS_PACKAGE,
                    capture_output=True,
                    text=True,
                    timeout=290,
                    check=False,
                )
                assert out.returncode == 0, out.stdout + out.stderr
            installed.touch()
    work = tmp_path_factory.mktemp("push_docs_ts")
    src = work / "src"
    src.mkdir()
    (src / "recover.mts").write_text(tagged("ts-recover"))
    receiver = tagged("ts-receiver")
    (src / "receiver.mts").write_text(receiver)
    assert receiver.count(YOUR_WORK) == 1, "the TypeScript receiver's `handle` has changed"
    (src / "receiver_run.mts").write_text(receiver.replace(YOUR_WORK, TEST_WORK))
    (src / "verify.mts").write_text(tagged("ts-verify"))
    out = subprocess.run(
        [
            node,
            str(tsc),
            "--strict",
            "--skipLibCheck",  # @types/node is checked upstream, and checking it takes ~12 s
            "--target",
            "es2022",
            "--module",
            "nodenext",
            "--moduleResolution",
            "nodenext",
            "--typeRoots",
            str(TS_PACKAGE / "node_modules" / "@types"),
            "--types",
            "node",
            "--rootDir",
            str(src),
            "--outDir",
            str(work),
            *(str(p) for p in sorted(src.iterdir())),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"docs/guides/push.md's TypeScript does not compile:\n{out.stdout}"
    (work / "harness.mjs").write_text(HARNESS)
    (work / "receiver_harness.mjs").write_text(RECEIVER_HARNESS)
    return work


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def shown(record: Record) -> list[Any]:
    """`expected(record)` as the harness prints it (bytes as base64)."""
    return [
        event_id(record),
        b64(record.key),
        b64(record.value),
        [[name, b64(value)] for name, value in record.headers],
    ]


@pytest.fixture(scope="module")
def ts_results(compiled: Path) -> dict[str, Any]:
    """What the doc's TypeScript recovers from the proxy's encodings and decides about
    the signatures, run once by node."""
    cases = signature_cases()
    given = {
        "binary": [
            {"headers": binary_headers(r, SHAPE), "body": b64(r.value or b"")} for r in RECORDS
        ],
        "batch": b64(batch_body([batch_event(r, SHAPE) for r in RECORDS])),
        "verify": [[secret, b64(body), header, NOW] for secret, body, header, _ in cases],
    }
    return run_node(compiled / "harness.mjs", given)


def run_node(script: Path, given: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`node SCRIPT` with `given` as JSON on stdin; the JSON document it prints."""
    out = subprocess.run(
        [tool("node"), str(script)],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_the_typescript_recipe_recovers_every_byte_in_binary_mode(
    ts_results: dict[str, Any],
) -> None:
    assert ts_results["binary"] == [shown(record) for record in RECORDS]


def test_the_typescript_recipe_recovers_every_byte_of_a_batch(ts_results: dict[str, Any]) -> None:
    assert ts_results["batch"] == [shown(record) for record in RECORDS]


def test_the_typescript_verification_accepts_the_proxys_signature_and_refuses_the_rest(
    ts_results: dict[str, Any],
) -> None:
    assert ts_results["verify"] == [accepted for *_, accepted in signature_cases()]


@pytest.fixture(scope="module")
def ts_receiver(compiled: Path) -> dict[str, Any]:
    """The address the doc's TypeScript receiver listens on, and its answers (status,
    headers, base64 body) to each record of RECORDS, POISON and FLAKY in binary mode, then
    to all of them as one batch."""
    records = [*RECORDS, POISON, FLAKY]
    cases = [{"headers": binary_headers(r, SHAPE), "body": b64(r.value or b"")} for r in records]
    batch = batch_body([batch_event(r, SHAPE) for r in records])
    cases.append({"headers": {"content-type": BATCH_CONTENT_TYPE}, "body": b64(batch)})
    return run_node(compiled / "receiver_harness.mjs", cases, {"PORT": "0"})


def test_the_typescript_receiver_binds_loopback(ts_receiver: dict[str, Any]) -> None:
    assert ts_receiver["address"] == "127.0.0.1"


def test_the_typescript_receiver_answers_what_the_proxy_reads_as_ack_nack_retry(
    ts_receiver: dict[str, Any],
) -> None:
    *binary, batch = [
        classify(status, headers, base64.b64decode(body))
        for status, headers, body in ts_receiver["answers"]
    ]
    *acked, poison, flaky = binary
    assert {outcome.verdict for outcome in acked} == {Verdict.ACK}
    assert (poison.verdict, poison.reason) == (Verdict.NACK, "HTTP 422: Poison: poison pill")
    assert flaky.verdict is Verdict.RETRY
    # The batch: acked, with the failures in the body, reasons as the page gives them.
    assert batch.verdict is Verdict.ACK
    body = ts_receiver["answers"][-1][2]
    records = [*RECORDS, POISON, FLAKY]
    failures = batch_failures(base64.b64decode(body), {event_id(r) for r in records})
    assert failures is not None
    assert {i: (o.verdict, o.reason) for i, o in failures.items()} == {
        event_id(POISON): (Verdict.NACK, "Poison: poison pill"),
        event_id(FLAKY): (Verdict.RETRY, "Error: try later"),
    }


# --- the tables ---------------------------------------------------------------------------


def test_the_config_examples_load() -> None:
    examples = [block for block in code_blocks("toml") if "[[push]]" in block]
    assert len(examples) >= 3
    for block in examples:
        (target,) = push_targets(tomllib.loads(block)["push"], Secrets())
        assert target.name


def _as_toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_as_toml(v) for v in value) + "]"
    return json.dumps(value)


def test_the_keys_table_names_every_push_key_with_its_default() -> None:
    rows = {
        row[0].strip("`"): row[1]
        for row in table_rows(section("Configuring a target"))
        if row[0].startswith("`")
    }
    keys = [f for f in fields(PushTargetSettings) if f.name != "secrets"]
    assert sorted(rows) == sorted(f.name for f in keys)
    for f in keys:
        # Literal defaults are quoted as TOML; None and computed ones are described.
        if f.default is not MISSING and f.default is not None and f.name != "allow":
            assert rows[f.name].startswith(f"`{_as_toml(f.default)}`"), (f.name, rows[f.name])


def test_the_response_table_gives_the_verdicts_of_responses_py() -> None:
    checked = 0
    for answer, verdict, *_ in table_rows(section("What a response means")):
        if answer.startswith("any other") or verdict not in {v.value for v in Verdict}:
            continue
        headers = {"triage-action": "retry"} if "triage-action: retry" in answer else {}
        for status in re.findall(r"\b[1-5](?:\d\d|xx)\b", answer):
            code = int(status.replace("xx", "02"))
            assert classify(code, headers, b"").verdict.value == verdict, (answer, code)
            checked += 1
    assert checked >= 10


def test_every_status_field_and_metric_is_named() -> None:
    text = doc()
    snapshot = PushTargetSnapshot(
        name="t",
        limit=8,
        in_flight=0,
        partitions=(0,),
        state="ok",
        latency=LatencyHistogram(PUSH_BUCKETS_S),
        responses={"2xx": 1},
        records={"ack": 1},
        errors=0,
    )
    missing = [key for key in snapshot.to_json() if f"`{key}`" not in text]
    assert missing == []
    families = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in push_families([snapshot])
    }
    named = set(re.findall(r"triage_push_\w+", text))
    assert named == families


# --- the page as MkDocs builds it ---------------------------------------------------------


def slugify(text: str) -> str:
    """Python-Markdown's default heading id (toc extension), which MkDocs uses."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_links_resolve_and_the_figures_placeholder_is_there_once() -> None:
    text = FENCE.sub("", doc())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans hold no links
    anchors = {slugify(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("https://", "http://")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            # `mkdocs build --strict` fails on a link outside docs/ or to a missing page.
            resolved = (DOC.parent / path).resolve()
            assert resolved.is_relative_to(ROOT / "docs"), target
            assert resolved.is_file(), target
        else:
            assert anchor in anchors, target
    assert doc().count("<!-- figures: bench_push -->") == 1
    assert "\n<!-- figures: bench_push -->\n" in doc()
