"""`triage console` in a real browser (Debian's Chromium, driven by Playwright) over the
embedded stack: a real proxy process, Tansu and moto server, the console as the operator
runs it (`triage console -c triage.toml`).

One stack per module: the dead letters each test needs are written once and each test
uses its own (by reason). The overview test runs first (file order) while the backlog
still waits for a consumer, so its commit is blocked at offset 0; the table test runs
last (it drops the table). Screenshots of each page go to $TRIAGE_SCREENSHOTS
(docs/console/ holds the current ones), else to a temp folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import TOKEN, create_topic, produce, write_dead_letters
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port_block, stop_process
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.provisioning import create_bucket, create_table
from triage_proxy.structs import DeadLetter, Record

# On one worker (--dist loadgroup): the module's stack (a proxy, the console, their topic
# and tables) and its browser start once, not on every worker its tests would spread over.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("console")]

CHROMIUM = os.environ.get("TRIAGE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 30_000
"""How long a page may take to show what a test waits for (CI shares 2 cores)."""
BINARY_VALUE = b"\x00\x01\xff\xfebinary\x7f"
HOSTILE_KEY = b"<script>alert('key')</script>"
HOSTILE_VALUE = b'"><img src=x onerror=alert(1)><script>alert(2)</script>'
HOSTILE_HEADERS: list[tuple[str, bytes | None]] = [
    ("<script>alert(3)</script>", b'"><img src=x onerror=alert(4)>'),
    ("trace", b"<svg onload=alert(5)>"),
]
HOSTILE_REASON = "<img src=x onerror=alert(6)> hostile <script>alert(7)</script>"
DISCARD_REASON = "schema v1 rejected"
TWICE_REASON = "raced by two browsers"
BACKLOG = 5
LARGE_VALUE = b"L" * 450_000
"""Over DynamoDB's item limit: the proxy's writer keeps it in the overflow bucket."""


@dataclass
class Seen:
    """What the test's consumer handled (the replayed copies carry triage-replay-of)."""

    values: list[bytes] = field(default_factory=list)
    replays: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Stack:
    topic: str
    config: Path
    url: str
    """The login URL the console printed."""
    base: str
    dead_letters: DeadLetterSettings
    group: str
    endpoint: str
    """The proxy's gRPC endpoint."""
    shots: Path


def _dl(topic: str, offset: int, value: bytes | None, reason: str, **kw: Any) -> DeadLetter:
    record = Record(
        topic, 0, offset, kw.get("key", b"k%d" % offset), value, kw.get("headers", []), 1
    )
    return DeadLetter(
        record=record,
        reason=reason,
        attempts=kw.get("attempts", 3),
        consumer_id="test-consumer",
        dead_lettered_at_ms=int(time.time() * 1000),
    )


@pytest.fixture(scope="module")
def stack(
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    tmp_path_factory: pytest.TempPathFactory,
    default_ports_taken: tuple[int, ...],
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("console")
    topic = f"console-{os.getpid()}-{int(time.time())}"
    group = f"g-{topic}"
    create_topic(broker.bootstrap, topic, 1)
    for i in range(BACKLOG):  # one record per request: Tansu's high watermark is exact
        produce(broker.bootstrap, topic, [(b"k%d" % i, b"backlog-%d" % i, None)])
    table = f"dlq-{topic}"
    bucket = f"overflow-{topic}"[:63].lower()
    dl_settings = DeadLetterSettings(
        table=table, endpoint_url=aws.endpoint_url, overflow_bucket=bucket
    )
    create_table(dl_settings)
    create_bucket(dl_settings)
    base = free_port_block(2)
    config = tmp / "triage.toml"
    write_config(
        config,
        {
            "kafka": {"bootstrap_servers": broker.bootstrap, "topic": topic, "group_id": group},
            "server": {"host": "127.0.0.1", "port": base, "http_port": base + 1},
            "auth": {"token": TOKEN},
            "dead_letters": {
                "table": table,
                "endpoint_url": aws.endpoint_url,
                "overflow_bucket": bucket,
                "flush_interval_ms": 5,
            },
            "commit": {"interval_s": 0.1},
            "shutdown": {"drain_timeout_s": 2},
        },
    )
    letters = [
        _dl(topic, 1000, BINARY_VALUE, "binary payload not understood"),
        _dl(topic, 1001, HOSTILE_VALUE, HOSTILE_REASON, key=HOSTILE_KEY, headers=HOSTILE_HEADERS),
        *(_dl(topic, 1100 + i, b'{"v": %d}' % i, DISCARD_REASON) for i in range(4)),
        *(_dl(topic, 1200 + i, b"twice-%d" % i, TWICE_REASON) for i in range(6)),
        _dl(topic, 1300, b"already", "replayed elsewhere first"),
        _dl(topic, 1400, LARGE_VALUE, "too big to keep in the item"),
    ]
    write_dead_letters(dl_settings, letters, group=group)
    command = [sys.executable, "-m", "triage_cli.main"]
    with open(tmp / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(
            [*command, "proxy", "-c", str(config), "-p", "0"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
    console_log = open(tmp / "console.log", "wb")  # noqa: SIM115 - closed at teardown
    console = subprocess.Popen(
        [*command, "console", "-c", str(config), "--port", "0", "--interval", "1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=console_log, text=True,
    )  # fmt: skip
    try:
        url = _read_url(console, tmp / "console.log")
        shots = Path(os.environ.get("TRIAGE_SCREENSHOTS") or tmp / "screenshots")
        shots.mkdir(parents=True, exist_ok=True)
        yield Stack(
            topic=topic,
            config=config,
            url=url,
            base=url.split("/?", 1)[0],
            dead_letters=dl_settings,
            group=group,
            endpoint=f"127.0.0.1:{base}",
            shots=shots,
        )
    finally:
        stop_process(console, 20)
        if console.stdout is not None:
            console.stdout.close()
        console_log.close()
        stop_process(proxy, 20)
        assert console.returncode == 0, (tmp / "console.log").read_text()


def _read_url(console: subprocess.Popen[str], log: Path) -> str:
    assert console.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([console.stdout], [], [], 0.5)
        if ready:
            line = console.stdout.readline()
            if line.startswith("console: "):
                return line.split(" ", 1)[1].strip()
            assert line or console.poll() is None, log.read_text()
    raise AssertionError(f"the console printed no URL: {log.read_text()}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.skip(
            f"no Chromium at {CHROMIUM}: run scripts/ensure-chromium (the README's test "
            "command does), or set TRIAGE_CHROMIUM"
        )
    from playwright.sync_api import sync_playwright

    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Watched:
    """A logged-in page and everything it said that a test must see empty."""

    page: Any
    dialogs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@pytest.fixture
def page(browser: Any, stack: Stack) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    watched = Watched(page)

    def on_dialog(dialog: Any) -> None:
        watched.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    page.on(
        "console",
        lambda msg: watched.errors.append(msg.text) if msg.type == "error" else None,
    )
    page.on("pageerror", lambda exc: watched.errors.append(f"page error: {exc}"))
    page.goto(stack.url)
    yield watched
    context.close()


def _api(page: Any, method: str, path: str, body: dict[str, Any] | None = None,
         csrf: bool = True) -> dict[str, Any]:  # fmt: skip
    """A request from the page itself (its cookie; the CSRF token from its meta tag)."""
    answer: dict[str, Any] = page.evaluate(  # the script's {status, body}
        """async ([method, path, body, csrf]) => {
            const headers = {"Content-Type": "application/json"};
            const meta = document.querySelector('meta[name="csrf-token"]');
            if (csrf && meta) headers["X-CSRF-Token"] = meta.content;
            const r = await fetch(path, {method, headers, credentials: "same-origin",
                body: method === "POST" ? JSON.stringify(body || {}) : undefined});
            return {status: r.status, body: await r.json()};
        }""",
        [method, path, body, csrf],
    )
    return answer


@contextlib.contextmanager
def consuming(stack: Stack) -> Iterator[Seen]:
    """A real consumer of the deployment that acks everything, in a thread."""
    from triage_client import Consumer, Message

    seen = Seen()

    def handle(message: Message) -> None:
        with seen.lock:
            seen.values.append(message.value or b"")
            for name, value in message.headers:
                if name == "triage-replay-of" and value is not None:
                    seen.replays.append(value.decode())

    consumer = Consumer(stack.endpoint, TOKEN, handle, concurrency=4)
    thread = threading.Thread(target=consumer.run, name="console-test-consumer", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        consumer.stop()
        thread.join(30)
        assert not thread.is_alive()


def _until(predicate: Any, timeout: float = 45.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def _shot(stack: Stack, watched: Watched, name: str) -> None:
    watched.page.screenshot(path=str(stack.shots / f"{name}.png"), full_page=True)


# --- the tests -----------------------------------------------------------------------------


def test_token_url_logs_in_and_overview_plots_lag(stack: Stack, page: Watched) -> None:
    p = page.page
    assert "token=" not in p.url, "the token stays out of the address bar"
    assert p.url.endswith("/overview")
    cookie = next(c for c in p.context.cookies() if c["name"] == "triage_console")
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    # The backlog waits for an instance: the commit is blocked at offset 0 for that.
    p.wait_for_selector("tr[data-partition='0'] td.lag")
    p.wait_for_function(
        "() => { const c = window.triageConsole.charts.lag;"
        " return c && c.data[0].length >= 2 && c.data[1].some(v => v > 0); }",
        timeout=WAIT_MS,
    )
    # What the commit waits for shows once the proxy has started (a loaded machine may
    # plot two lag points while its row still says "starting").
    p.wait_for_selector(
        "tr[data-partition='0']:has-text('an instance with credit')", timeout=WAIT_MS
    )
    row = p.locator("tr[data-partition='0']")
    assert row.locator("td.lag").inner_text() == str(BACKLOG)
    assert p.locator("#plot-lag canvas").count() == 1
    # Counts tick at whole numbers, and the dead-letter plot's count (pending, 0 here) has
    # an axis of its own rather than sharing the rate's, which ticked at 0.2, 0.4 ... items.
    axes = p.evaluate(
        "() => { const c = window.triageConsole.charts;"
        " return { lag: c.lag.axes[1]._splits, dl: c.deadletters.axes.map(a => a.scale),"
        " pending: c.deadletters.axes[2] && c.deadletters.axes[2]._splits }; }"
    )
    assert axes["dl"] == ["x", "rate", "count"], axes
    for name in ("lag", "pending"):
        assert axes[name], axes
        assert all(float(v).is_integer() for v in axes[name]), axes
    # On a 1280-pixel laptop screen the partitions table fits: no column (the dead
    # letters pending, last) hides past the right edge, and the page does not scroll
    # sideways past its own header bar.
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    p.set_viewport_size({"width": 1280, "height": 1000})
    # The plots resize on the window's resize event: wait for the layout to settle (a
    # page that stays too wide times out here, and the assertion below says by how much).
    with contextlib.suppress(PlaywrightTimeout):
        p.wait_for_function(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth",
            timeout=10_000,
        )
    widths = p.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert widths[0] <= widths[1], widths
    p.set_viewport_size({"width": 1500, "height": 1000})
    _shot(stack, page, "overview")
    p.goto(stack.base + "/fleet")
    p.wait_for_selector("#process-table td.served")
    assert "0" in p.locator("#process-table td.served").first.inner_text()
    p.wait_for_selector("#lease-table")
    _shot(stack, page, "fleet")
    assert page.dialogs == []
    assert page.errors == []


def test_requests_without_the_cookie_get_401_and_posts_need_the_csrf_token(
    stack: Stack, page: Watched
) -> None:
    for path in ("/overview", "/api/overview", "/static/console.js", "/deadletters"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(stack.base + path, timeout=10)
        refused.value.close()
        assert refused.value.code == 401, path
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(stack.base + "/?token=not-the-token", timeout=10)
    assert wrong.value.code == 401
    assert b"wrong" in wrong.value.read()
    wrong.value.close()

    key = f"{stack.topic}/0/1300"
    item = f"/api/deadletters/item/{key}"
    refused_post = _api(page.page, "POST", item + "/discard", csrf=False)
    assert refused_post["status"] == 403
    assert "CSRF" in refused_post["body"]["error"]
    assert _api(page.page, "GET", item)["body"]["status"] == "pending"  # nothing changed
    # A POST from another origin with the right cookie and token is refused too.
    cookie = next(c for c in page.page.context.cookies() if c["name"] == "triage_console")
    csrf = page.page.locator('meta[name="csrf-token"]').get_attribute("content")
    forged = urllib.request.Request(
        stack.base + item + "/discard",
        data=b"{}",
        method="POST",
        headers={"Cookie": f"triage_console={cookie['value']}", "X-CSRF-Token": csrf or "",
                 "Origin": "http://evil.example"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as cross:
        urllib.request.urlopen(forged, timeout=10)
    cross.value.close()
    assert cross.value.code == 403
    assert _api(page.page, "GET", item)["body"]["status"] == "pending"


def test_an_unserved_fleet_partition_is_named_plainly(stack: Stack, page: Watched) -> None:
    """Seen after `kill -9` of a fleet process: its partitions have no proxy of their own
    (`proxy_url` null) until another serves them. The banner printed "(null: no proxy
    process serves partition 1)", and the row said "nothing unsettled", which nobody
    knows while no proxy answers. The overview here is the console's own, with its one
    partition made unserved on the way to the page."""
    p = page.page
    p.wait_for_selector("tr[data-partition='0'] td.lag")
    real = _api(p, "GET", "/api/overview")["body"]
    row = real["report"]["partitions"][0]
    row.update(proxy="down", proxy_url=None, served_by=None, blocking=None,
               proxy_error="no proxy process serves partition 0")  # fmt: skip
    p.route(
        "**/api/overview",
        lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps(real)
        ),
    )
    try:
        p.reload()
        banner = p.locator("#problems .notice.bad").first
        banner.wait_for()
        assert banner.inner_text() == "Partition 0 down: no proxy process serves partition 0"
        cells = p.locator("tr[data-partition='0'] td").all_inner_texts()
        assert "nothing unsettled" not in cells, cells
        assert "null" not in " ".join(cells), cells
    finally:
        p.unroute("**/api/overview")


def test_filter_by_reason_hex_view_replay_and_replay_again(stack: Stack, page: Watched) -> None:
    p = page.page
    p.goto(stack.base + "/deadletters")
    p.wait_for_selector("#reason-counts")
    p.wait_for_function("() => document.querySelectorAll('#items tbody tr').length > 1")
    # The list shows the table's UTC time; the overview and fleet show the browser's local
    # time: the column says which it is.
    headers = p.locator("#items thead th").all_inner_texts()
    assert "dead-lettered at (UTC)" in headers, headers
    _shot(stack, page, "deadletters")
    p.fill("input[name=reason]", "BINARY payload")
    p.click("#apply")
    p.wait_for_function("() => document.querySelectorAll('#items tbody tr').length === 1")
    row = p.locator("#items tbody tr")
    binary_id = f"{stack.topic}/0/1000"
    assert row.get_attribute("data-id") == binary_id
    assert "reason=BINARY+payload" in p.url
    row.locator("a").click()
    p.wait_for_url(f"**/deadletters/{binary_id}")
    p.wait_for_selector("#payload-value")
    p.click("#view-hex")
    assert "00 01 ff fe 62 69 6e 61" in p.locator("#payload-value").inner_text()
    _shot(stack, page, "deadletter")

    with consuming(stack) as seen:
        p.click("#replay")
        p.wait_for_selector("body[data-outcome]")
        assert p.locator("body").get_attribute("data-outcome") == "replayed"
        assert p.locator("dd[data-field='state']").inner_text() == "replayed"
        assert p.locator("dd[data-field='replayed to']").inner_text().startswith(stack.topic)
        # No longer pending: both actions are off, and look it (a coloured button that
        # does nothing read as one that would discard a replayed item).
        for action in ("#replay", "#discard"):
            assert p.locator(action).is_disabled()
            faded = p.eval_on_selector(action, "b => Number(getComputedStyle(b).opacity)")
            assert faded < 0.6, (action, faded)
        # Consumed again, through the proxy, with its provenance.
        assert _until(lambda: f"{stack.topic}/0/1000" in seen.replays), seen.replays
        assert BINARY_VALUE in seen.values

    # Replaying it again (a second tab, another operator): shown, nothing changes.
    again = _api(p, "POST", f"/api/deadletters/item/{binary_id}/replay")
    assert again["status"] == 200
    assert again["body"]["outcome"] == "skipped"
    assert "already replayed" in again["body"]["why"]
    assert again["body"]["item"]["replay_count"] == 1
    assert page.dialogs == []
    assert page.errors == []


def test_bulk_discard_of_a_filter_with_confirmation_and_progress(
    stack: Stack, page: Watched
) -> None:
    p = page.page
    p.goto(stack.base + "/deadletters?reason=schema+v1")
    p.wait_for_function("() => document.querySelectorAll('#items tbody tr').length === 4")
    p.click("#discard-all")
    p.wait_for_selector("#confirm-text")
    assert "4 pending dead letters" in p.locator("#confirm-text").inner_text()
    _shot(stack, page, "confirm-discard")
    p.click("#confirm-yes")
    p.wait_for_selector("#job[data-state='done']")
    assert p.locator("#job-progress").get_attribute("value") == "4"
    assert "4 discarded" in p.locator("#job-text").inner_text()
    p.wait_for_function(
        "() => [...document.querySelectorAll('#items td.status')]"
        ".every(td => td.textContent === 'discarded')"
    )
    # A filter that matches nothing says so; bulk work on it does nothing.
    p.select_option("select[name=state]", "pending")
    p.click("#apply")
    p.wait_for_selector("#empty")
    assert "No dead letter matches" in p.locator("#empty").inner_text()
    p.click("#discard-all")
    p.wait_for_selector("#message .notice")
    assert "nothing to discard" in p.locator("#message").inner_text()
    assert page.dialogs == []
    assert page.errors == []


def test_a_hostile_dead_letter_runs_nothing(stack: Stack, page: Watched) -> None:
    p = page.page
    p.goto(stack.base + "/deadletters?reason=hostile")
    p.wait_for_selector("#items tbody tr")
    assert p.locator("#items td.reason").first.inner_text() == HOSTILE_REASON
    p.locator("#items a").first.click()
    p.wait_for_selector("#payload-value")
    for view in ("text", "json", "hex"):
        p.click(f"#view-{view}")
        p.wait_for_selector(f"#view-{view}[aria-pressed=true]")
    p.click("#view-text")
    assert p.locator("#payload-value").inner_text() == HOSTILE_VALUE.decode()
    assert p.locator("#payload-key").inner_text() == HOSTILE_KEY.decode()
    header_value = HOSTILE_HEADERS[0][1]
    assert header_value is not None
    assert p.locator("#payload-header-0").inner_text() == header_value.decode()
    assert p.locator("dd[data-field='reason']").inner_text() == HOSTILE_REASON
    assert (
        p.evaluate("() => document.querySelectorAll('main img, main svg, main script').length") == 0
    )
    _shot(stack, page, "hostile")
    # Nothing ran: no alert, and no blocked inline script either (CSP would log an error).
    assert page.dialogs == []
    assert page.errors == []


def test_a_payload_in_s3_is_fetched_on_demand(stack: Stack, page: Watched) -> None:
    p = page.page
    p.goto(stack.base + f"/deadletters/{stack.topic}/0/1400")
    p.wait_for_selector("#fetch-s3")
    assert "s3://" in p.locator("dd[data-field='payload']").inner_text()
    assert p.locator("#payload-value").count() == 0  # not read until asked for
    p.click("#fetch-s3")
    p.wait_for_selector("#payload-value")
    assert f"Value ({len(LARGE_VALUE)} bytes)" in p.locator("#payload").inner_text()
    assert p.locator("#payload-value").inner_text().startswith("LLLL")
    assert page.dialogs == []
    assert page.errors == []


def test_an_unknown_item_is_a_404_page(stack: Stack, page: Watched) -> None:
    p = page.page
    response = p.goto(stack.base + f"/deadletters/{stack.topic}/0/999999")
    assert response is not None
    assert response.status == 404
    assert "No such dead letter" in p.locator("h1").inner_text()
    assert "Traceback" not in p.content()
    response = p.goto(stack.base + "/deadletters/x/not-a-number/1")
    assert response is not None
    assert response.status == 404
    assert _api(p, "GET", "/api/deadletters/item/x/0/5")["status"] == 404
    assert _api(p, "GET", "/api/deadletters?since=yesterday")["status"] == 400


def test_two_browsers_replaying_the_same_items_replay_each_once(
    stack: Stack, browser: Any, page: Watched
) -> None:
    other = browser.new_context()
    second = other.new_page()
    second.goto(stack.url)
    second.wait_for_url("**/overview")
    try:
        with consuming(stack) as seen:
            # Both start the same bulk replay at once (each its own session and job).
            # The first page's request is in flight while the second page sends its own.
            page.page.evaluate(
                """(reason) => {
                    window.startedJob = fetch("/api/jobs", {method: "POST",
                        headers: {"Content-Type": "application/json", "X-CSRF-Token":
                            document.querySelector('meta[name="csrf-token"]').content},
                        body: JSON.stringify({action: "replay", reason})}).then(r => r.json());
                }""",
                TWICE_REASON,
            )
            body = {"action": "replay", "reason": TWICE_REASON}
            second_job = _api(second, "POST", "/api/jobs", body)["body"]
            jobs = [page.page.evaluate("() => window.startedJob"), second_job]

            def finished() -> list[dict[str, Any]] | None:
                states = [_api(page.page, "GET", f"/api/jobs/{jobs[0]['id']}")["body"],
                          _api(second, "GET", f"/api/jobs/{jobs[1]['id']}")["body"]]  # fmt: skip
                return states if all(s["state"] != "running" for s in states) else None

            done = _until(finished)
            assert done, "the jobs did not finish"
            assert [d["state"] for d in done] == ["done", "done"], done
            replayed = sum(d["result"]["replayed"] for d in done)
            assert replayed == 6, done
            assert all(d["result"]["failed"] == 0 for d in done), done
            # An item one job saw claimed by the other (not marked yet) is reported in doubt
            # by it, as `triage dlq replay` reports it: it was not produced by that job.
            ids = {d["result"]["replay_id"] for d in done}
            for d in done:
                for failure in d["result"]["failures"]:
                    assert failure["outcome"] == "in doubt", done
                    assert "claimed by replay" in failure["why"], done
                    assert any(i in failure["why"] for i in ids - {d["result"]["replay_id"]})
            for i in range(6):
                item = _api(second, "GET", f"/api/deadletters/item/{stack.topic}/0/{1200 + i}")
                assert item["body"]["status"] == "replayed"
                assert item["body"]["replay_count"] == 1
            wanted = {f"{stack.topic}/0/{1200 + i}" for i in range(6)}
            assert _until(lambda: wanted <= set(seen.replays)), seen.replays
            with seen.lock:
                twice = [r for r in seen.replays if r in wanted]
            assert sorted(twice) == sorted(wanted), "each item was produced once"
    finally:
        other.close()


def test_the_broker_going_away_is_shown_and_the_overview_recovers(
    stack: Stack, page: Watched, broker: EmbeddedBroker
) -> None:
    p = page.page
    p.wait_for_selector("tr[data-partition='0']")
    broker.signal(signal.SIGSTOP)  # it stops answering (resumed below, whatever happens)
    try:
        p.wait_for_selector("#broker-error", timeout=2 * WAIT_MS)
        assert "Broker:" in p.locator("#broker-error").inner_text()
    finally:
        broker.signal(signal.SIGCONT)
    p.wait_for_selector("#broker-error", state="detached", timeout=2 * WAIT_MS)
    assert page.dialogs == []
    assert page.errors == []


def test_the_table_going_away_is_shown_and_the_page_recovers(stack: Stack, page: Watched) -> None:
    """Last in the module: it drops the table (and makes an empty one again)."""
    import boto3

    p = page.page
    p.goto(stack.base + "/deadletters")
    p.wait_for_selector("#items")
    client = boto3.client(
        "dynamodb", endpoint_url=stack.dead_letters.endpoint_url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip
    try:
        client.delete_table(TableName=stack.dead_letters.table)
        p.click("#apply")
        p.wait_for_selector("#banner:not([hidden])")
        assert "does not exist" in p.locator("#banner").inner_text()
        create_table(stack.dead_letters)
        p.wait_for_selector("#banner[hidden]", state="attached")
        p.wait_for_selector("#empty")
    finally:
        client.close()
    errors = [e for e in page.errors if "503" not in e]  # the failed fetches themselves
    assert page.dialogs == []
    assert errors == [], errors


def test_console_json_api_is_typed_json(stack: Stack, page: Watched) -> None:
    answer = _api(page.page, "GET", "/api/overview")
    assert answer["status"] == 200
    json.dumps(answer["body"])  # plain JSON all the way
    assert answer["body"]["deployment"]["topic"] == stack.topic
