"""`triage dev --push URL` as a user runs it: the embedded stack in a subprocess delivers
to a real aiohttp receiver on a free loopback port, and `triage status --json` shows the
push target of each proxy process with its records acked."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.integration.harness import await_until, produce
from tests.integration.receivers import Handler, receiver
from tests.integration.test_cli import TRIAGE, run_triage
from triage_proxy.push.targets import UNREGISTERED

pytestmark = pytest.mark.integration

PER_PARTITION = 5


def acking(seen: dict[str, bytes]) -> Handler:
    """A CloudEvents binary-mode handler that acks everything, keyed by `ce-id`."""

    async def handle(request: web.Request) -> web.Response:
        seen[request.headers["ce-id"]] = await request.read()
        return web.Response(status=204)

    return handle


def status_json(config: str) -> dict[str, Any]:
    out = run_triage("status", "--config", config, "--json")
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def acked(doc: dict[str, Any]) -> int:
    return sum(row["records"].get("ack", 0) for row in doc["push"])


def done(doc: dict[str, Any]) -> bool:
    return acked(doc) == 2 * PER_PARTITION and [p["lag"] for p in doc["partitions"]] == [0, 0]


def test_dev_push_delivers_to_the_url_and_status_shows_the_target(tmp_path: Path) -> None:
    seen: dict[str, bytes] = {}
    log = open(tmp_path / "dev.stderr", "wb")  # noqa: SIM115  (closed in finally)

    async def scenario() -> None:
        async with receiver(acking(seen)) as url:
            proc = await asyncio.create_subprocess_exec(
                *TRIAGE,
                *("dev", "--json", "--partitions", "2", "--state-dir", str(tmp_path / "s")),
                *("--push", url, "--push-registration"),
                stdout=subprocess.PIPE,
                stderr=log,
            )
            try:
                assert proc.stdout is not None
                info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
                http, grpc_ = info["push"]
                assert http == {"name": "dev", "mode": "http", "url": url, "batch": 1}
                assert grpc_["name"] == "dev-grpc"
                assert grpc_["authorization"] == info["token"]
                assert len(grpc_["registration"]) == 2  # one per proxy process

                # Registration is on and takes the dev token, raw.
                async with aiohttp.ClientSession() as session:
                    headers = {"Authorization": info["token"]}
                    async with session.get(grpc_["registration"][0], headers=headers) as reply:
                        assert reply.status == 400
                        assert "Missing gRPC port header" in await reply.text()

                for partition in (0, 1):
                    values = [(None, b"p%d-%d" % (partition, i), None) for i in range(5)]
                    await asyncio.to_thread(
                        produce, info["bootstrap"], info["topic"], values, partition
                    )
                assert await await_until(lambda: len(seen) == 2 * PER_PARTITION, 60)
                want = {
                    f"{info['topic']}/{p}/{i}": b"p%d-%d" % (p, i)
                    for p in (0, 1)
                    for i in range(PER_PARTITION)
                }
                assert seen == want

                config = info["config"]
                doc = await asyncio.to_thread(status_json, config)
                for _ in range(50):  # acks settle, then commit, just after the answers
                    if done(doc):
                        break
                    await asyncio.sleep(0.2)
                    doc = await asyncio.to_thread(status_json, config)
                assert acked(doc) == 2 * PER_PARTITION
                # The gRPC table no consumer registered with: one row per process, waiting.
                waiting = [row for row in doc["push"] if row["name"] == "dev-grpc"]
                assert sorted(row["partitions"] for row in waiting) == [[0], [1]]
                assert {row["state"] for row in waiting} == {UNREGISTERED}
                rows = sorted(
                    (row for row in doc["push"] if row["name"] == "dev"),
                    key=lambda row: row["partitions"],
                )
                assert [(row["name"], row["partitions"]) for row in rows] == [
                    ("dev", [0]),
                    ("dev", [1]),
                ]
                for row in rows:
                    assert row["state"] == "ok"
                    assert row["responses"] == {"2xx": PER_PARTITION}
                    assert row["errors"] == 0
                    assert row["latency_p50_s"] is not None
                    assert row["limit"] >= 1
                assert [p["lag"] for p in doc["partitions"]] == [0, 0]

                table = await asyncio.to_thread(run_triage, "status", "--config", config)
                assert table.returncode == 0, table.stderr
                assert "push targets" in table.stdout
                assert "2xx 5" in table.stdout
                assert "unregistered" in table.stdout
                assert "no consumer has registered yet" in table.stdout

                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 60) == 0
            finally:
                if proc.returncode is None:  # a failed assertion: stop the stack it runs
                    proc.send_signal(signal.SIGTERM)
                    try:
                        await asyncio.wait_for(proc.wait(), 60)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()

    try:
        asyncio.run(scenario())
    finally:
        log.close()
