"""Push targets on the one lifecycle (lifecycle.Lifecycle): a target (push/target.py) and
the table of them (push/targets.py) start once, stop safely twice or before start, send
nothing after they stopped, and end a stop with no task left. A target here is an
in-memory twin whose requests wait on a gate; the dispatcher is the real one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from tests.unit.test_dispatcher import BASE
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import ConfigError, ShuttingDown, StateError
from triage_proxy.lifecycle import State
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.push.cloudevents import EventShape
from triage_proxy.push.grpc import Registration
from triage_proxy.push.http import HttpEndpoint, HttpTarget
from triage_proxy.push.limit import LimitSettings
from triage_proxy.push.responses import Outcome, Verdict
from triage_proxy.push.target import Call, PushTarget, TargetShape
from triage_proxy.push.targets import PushTargets
from triage_proxy.structs import Record

BOUND_S = 10.0
"""The most any wait here takes (each normally ends in milliseconds)."""


def run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):  # in this task: `others()` counts no wrapper
            await coro

    asyncio.run(bounded())


def shape(timeout_s: float = 5.0) -> TargetShape:
    return TargetShape(
        name="t",
        limit=LimitSettings(min_limit=1, max_limit=4, initial=4),
        batch=1,
        max_batch_bytes=1024 * 1024,
        timeout_s=timeout_s,
    )


class Twin(PushTarget):
    """A target whose every request waits for `gate`, then acks."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        super().__init__(shape(timeout_s))
        self.gate = asyncio.Event()
        self.calling = asyncio.Event()
        """Set once a request is in flight."""
        self.answered = 0
        self.cancelled = 0
        self.connects = 0
        self.disconnects = 0

    def _connect(self) -> None:
        self.connects += 1

    async def _disconnect(self) -> None:
        self.disconnects += 1

    async def call(self, records: list[Record], payloads: list[object]) -> Call:
        self._check_sending()
        self.calling.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.answered += 1
        return Call([Outcome(Verdict.ACK)] * len(records), dropped=False, kind="2xx")


def dispatcher_with(n: int) -> Dispatcher:
    dispatcher = Dispatcher(settings_from_dict(BASE, {}), 0, CommitTracker(0), lambda dl: None)
    dispatcher.add([Record("t", 0, i, b"k", b"v", (), 1_700_000_000_000) for i in range(n)])
    return dispatcher


def others() -> set[asyncio.Task[Any]]:
    """Tasks other than the test's own: none may be left once a stop returned."""
    return asyncio.all_tasks() - {asyncio.current_task()}


def test_a_target_starts_once_and_stops_safely_twice() -> None:
    async def main() -> None:
        target = Twin()
        async with target:
            assert target.state is State.RUNNING
            with pytest.raises(StateError, match="push target t already running"):
                await target.start()
        await target.stop()
        await target.stop(abandon=True)
        assert target.state.value == "stopped"
        assert (target.connects, target.disconnects) == (1, 1)
        with pytest.raises(StateError, match="push target t already stopped"):
            await target.start()
        assert not others()

    run(main())


def test_a_target_stopped_before_start_never_connects() -> None:
    async def main() -> None:
        target = Twin()
        await target.stop()
        assert target.state is State.STOPPED
        with pytest.raises(StateError):
            await target.start()
        assert (target.connects, target.disconnects) == (0, 0)

    run(main())


def test_a_close_during_start_leaves_nothing_running() -> None:
    async def main() -> None:
        first = Twin()
        await asyncio.gather(first.start(), first.stop())
        assert first.state is State.STOPPED
        assert (first.connects, first.disconnects) == (1, 1)
        second = Twin()
        stopped, started = await asyncio.gather(
            second.stop(), second.start(), return_exceptions=True
        )
        assert stopped is None
        assert isinstance(started, StateError)
        assert second.state is State.STOPPED
        assert (second.connects, second.disconnects) == (0, 0)
        assert not others()

    run(main())


def test_a_target_sends_nothing_and_takes_no_partition_unless_running() -> None:
    http = HttpTarget(
        shape(),
        HttpEndpoint(
            url="http://127.0.0.1:9/",
            event=EventShape(source="triage://g/t"),
            nack_statuses=frozenset({400}),
            max_response_bytes=4096,
        ),
    )
    record = Record("t", 0, 7, b"k", b"v", (), 0)

    async def main() -> None:
        dispatcher = dispatcher_with(0)
        with pytest.raises(StateError, match="push target t is new: it sends nothing"):
            await http.call([record], [record])
        with pytest.raises(StateError, match="push target t is new: it takes no partition"):
            http.attach(0, dispatcher)
        await http.start()
        await http.stop()
        with pytest.raises(StateError, match="push target t is stopped: it sends nothing"):
            await http.call([record], [record])
        with pytest.raises(StateError, match="push target t is stopped: it takes no partition"):
            http.attach(0, dispatcher)
        assert not others()

    run(main())


async def _stopping(target: Twin, dispatcher: Dispatcher) -> asyncio.Task[None]:
    """Start `target` on `dispatcher`'s partition, wait for a request in flight (held at
    the target's gate), and begin a graceful stop: the stop's task, in STOPPING."""
    await target.start()
    target.attach(0, dispatcher)
    await asyncio.wait_for(target.calling.wait(), BOUND_S)
    stopping = asyncio.create_task(target.stop())
    await asyncio.sleep(0)  # the stop task runs to its first wait
    assert target.state is State.STOPPING
    return stopping


def test_stop_lets_the_requests_in_flight_end_with_their_answers() -> None:
    async def main() -> None:
        target = Twin()
        dispatcher = dispatcher_with(3)
        stopping = await _stopping(target, dispatcher)
        target.gate.set()
        await asyncio.wait_for(stopping, BOUND_S)
        assert target.answered >= 1
        assert target.cancelled == 0
        assert target.snapshot().partitions == ()
        assert dispatcher.in_flight == 0
        assert not others()

    run(main())


def test_stop_abandoning_cancels_the_requests_and_gives_their_records_back() -> None:
    async def main() -> None:
        target = Twin()
        dispatcher = dispatcher_with(3)
        graceful = await _stopping(target, dispatcher)  # would wait for the gate
        await asyncio.wait_for(target.stop(abandon=True), BOUND_S)  # cuts it short
        await asyncio.wait_for(graceful, BOUND_S)
        assert target.answered == 0
        assert target.cancelled >= 1
        assert dispatcher.in_flight == 0
        assert dispatcher.failures() == {}  # given back without an attempt
        assert target.disconnects == 1
        assert not others()

    run(main())


def test_requests_that_outlive_the_stop_timeout_are_cancelled() -> None:
    async def main() -> None:
        target = Twin(timeout_s=0.01)  # a stop timeout of 1.02 s
        dispatcher = dispatcher_with(1)
        await target.start()
        target.attach(0, dispatcher)
        await asyncio.wait_for(target.calling.wait(), BOUND_S)
        await asyncio.wait_for(target.stop(), BOUND_S)
        assert (target.answered, target.cancelled) == (0, 1)
        assert dispatcher.in_flight == 0
        assert dispatcher.failures() == {}
        assert not others()

    run(main())


def table(*targets: dict[str, Any]) -> PushTargets:
    settings = settings_from_dict({**BASE, "push": list(targets)}, {})
    return PushTargets(settings, lambda: ["tok"])


HTTP = {"name": "orders", "url": "http://127.0.0.1:9/"}
GRPC = {"name": "legacy", "mode": "grpc", "registration": True}


def test_the_table_starts_once_and_stops_safely_twice() -> None:
    async def main() -> None:
        targets = table(HTTP)
        with pytest.raises(StateError, match="push targets not started"):
            targets.serve(0, dispatcher_with(0))
        async with targets:
            assert [s.name for s in targets.snapshot()] == ["orders"]
            with pytest.raises(StateError, match="push targets already running"):
                await targets.start()
        await targets.stop()
        assert targets.state is State.STOPPED
        assert targets.snapshot() == ()
        with pytest.raises(StateError):
            await targets.start()
        assert not others()

    run(main())


def test_a_close_during_the_tables_start_leaves_nothing_running() -> None:
    async def main() -> None:
        first = table(HTTP, GRPC)
        await asyncio.gather(first.start(), first.stop())
        assert first.state is State.STOPPED
        assert not others()
        second = table(HTTP)
        stopped, started = await asyncio.gather(
            second.stop(), second.start(), return_exceptions=True
        )
        assert stopped is None
        assert isinstance(started, StateError)
        assert second.snapshot() == ()
        assert not others()

    run(main())


def test_a_table_that_fails_to_start_stops_what_it_started() -> None:
    """The second target's token names an environment variable that is not set: the
    first target, already started, is stopped again, and the error surfaces."""
    broken = {"name": "broken", "url": "http://127.0.0.1:9/", "token": "env:TRIAGE_TEST_UNSET_X"}

    async def main() -> None:
        targets = table(HTTP, broken)
        with pytest.raises(ConfigError, match="TRIAGE_TEST_UNSET_X is not set"):
            await targets.start()
        assert targets.state is State.STOPPED
        assert not others()
        await targets.stop()

    run(main())


def test_nothing_is_added_to_a_table_that_is_stopping() -> None:
    async def main() -> None:
        targets = table(HTTP, GRPC)
        with pytest.raises(StateError, match="not started"):
            await targets.register("127.0.0.1:50051")
        await targets.start()
        await targets.register("127.0.0.1:50051")
        assert {s.name for s in targets.snapshot()} == {"orders", "legacy@127.0.0.1:50051"}
        await targets.stop()
        with pytest.raises(ShuttingDown, match="push targets stopped: no new consumer"):
            await targets.register("127.0.0.1:50052")
        targets.serve(0, dispatcher_with(0))  # ignored: nothing would take from it
        assert all(s.partitions == () for s in targets.snapshot())
        assert not others()

    run(main())


def test_a_registration_while_the_proxy_stops_is_answered_503() -> None:
    async def register(address: str) -> None:
        raise ShuttingDown("push targets stopping: no new consumer")

    async def main() -> web.Response:
        registration = Registration(lambda: ["tok"], register)
        request = make_mocked_request(
            "GET", "/consumers", headers={"Authorization": "tok", "grpcport": "50051"}
        )
        return await registration.handle(request.clone(remote="127.0.0.1"))

    response = asyncio.run(main())
    assert response.status == 503
    assert response.text == "The proxy is stopping; register again later"


class Buggy(Twin):
    """A target whose request-slot accounting has a bug: its lane worker dies of it."""

    async def acquire(self, lane: Any) -> bool:
        raise RuntimeError("a bug in acquire")


class Errors(logging.Handler):
    """Sets `logged` at the first ERROR record."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.logged = asyncio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.logged.set()


def test_a_lane_that_dies_of_a_bug_is_logged_at_once_gives_back_and_fails_stop() -> None:
    async def main() -> None:
        errors = Errors()
        log = logging.getLogger("triage_proxy.push.target")
        log.addHandler(errors)
        try:
            target = Buggy()
            dispatcher = dispatcher_with(3)
            await target.start()
            target.attach(0, dispatcher)
            await asyncio.wait_for(errors.logged.wait(), BOUND_S)
        finally:
            log.removeHandler(errors)
        (record,) = errors.records
        assert "partition 0" in record.getMessage()
        assert "died of a bug" in record.getMessage()
        assert record.exc_info is not None
        assert "a bug in acquire" in str(record.exc_info[1])
        assert dispatcher.in_flight == 0  # its records went back
        assert target.snapshot().partitions == ()
        with pytest.raises(RuntimeError, match="a bug in acquire"):
            await target.stop()
        assert target.state is State.STOPPED
        assert not others()

    run(main())
