"""The actor runtime (actors/runtime.py): mailboxes, tell/ask, supervision, ordered stop.

Every test runs real actors under a real :class:`Supervisor` on the test's event loop;
``Probe`` is a small actor whose messages make it answer, fail, hold, defer or crash on
demand, so each behaviour is driven deterministically (events, not sleeps).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from actors.runtime import Actor, ActorError, ActorRef, ActorStopped, AskTimeout, MailboxFull, Supervisor
from gateway.http.middleware import error_answer
from tests.conftest import Gateway, chat_body, until


# ----------------------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True)
class Echo:
    """Answer ``value``; also journaled, so tests see the order of handling."""

    value: Any


@dataclass(frozen=True, slots=True)
class Fail:
    """Raise ``error`` while handling this message."""

    error: Exception


@dataclass(frozen=True, slots=True)
class Hold:
    """Wait until the probe's gate opens (the actor is busy meanwhile)."""


@dataclass(frozen=True, slots=True)
class Defer:
    """Answer later: the reply is a future the test resolves through ``probe.deferred``."""

    key: str


@dataclass(frozen=True, slots=True)
class CrashLoop:
    """Post an internal message whose handling raises: the loop itself crashes."""


@dataclass(frozen=True, slots=True)
class ReadTrace:
    """Answer the trace id seen inside ``receive`` (0 when there is none)."""


@dataclass(frozen=True, slots=True)
class SpawnWork:
    """Start ``coro_result`` as background work; its result returns via on_internal."""

    result: Any


@dataclass(frozen=True, slots=True)
class TellOther:
    """Tell ``Echo(value)`` to another actor (used from on_stop ordering tests)."""

    value: Any


class Probe(Actor[Any]):
    """An actor driven by the test: every hook writes to a shared journal."""

    def __init__(
        self,
        name: str = "probe",
        *,
        mailbox_size: int = 8,
        ask_timeout: float = 5.0,
        journal: list[str] | None = None,
    ) -> None:
        self.name = name
        self.mailbox_size = mailbox_size
        self.ask_timeout = ask_timeout
        super().__init__()
        self.journal: list[str] = [] if journal is None else journal
        self.gate = asyncio.Event()
        self.gate.set()
        self.holding = asyncio.Event()
        self.deferred: dict[str, asyncio.Future[Any]] = {}
        self.restart_errors: list[BaseException] = []
        self.restart_gate = asyncio.Event()
        self.restart_gate.set()
        self.internal_traces: list[int] = []
        self.fail_start: Exception | None = None
        self.other: ActorRef[Any] | None = None
        self.tell_other_on_stop: Any = None

    async def on_start(self) -> None:
        if self.fail_start is not None:
            raise self.fail_start
        self.journal.append(f"start {self.name}")

    async def receive(self, msg: Any) -> Any:
        if isinstance(msg, Echo):
            self.journal.append(f"{self.name} echo {msg.value}")
            return msg.value
        if isinstance(msg, Fail):
            self.journal.append(f"{self.name} fail")
            raise msg.error
        if isinstance(msg, Hold):
            self.holding.set()
            await self.gate.wait()
            self.journal.append(f"{self.name} held")
            return "held"
        if isinstance(msg, Defer):
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.deferred[msg.key] = fut
            return fut
        if isinstance(msg, CrashLoop):
            self.post_internal("crash")
            return None
        if isinstance(msg, ReadTrace):
            return trace.get_current_span().get_span_context().trace_id
        if isinstance(msg, SpawnWork):

            async def work() -> Any:
                await asyncio.sleep(0)
                return msg.result

            self.spawn(work(), lambda result, error: ("spawned", result, error))
            return None
        if isinstance(msg, TellOther):
            assert self.other is not None
            self.other.tell(Echo(msg.value))
            return None
        raise TypeError(f"unexpected {msg!r}")

    async def on_internal(self, msg: Any) -> None:
        if msg == "crash":
            raise RuntimeError("loop crashed on purpose")
        self.internal_traces.append(trace.get_current_span().get_span_context().trace_id)
        self.journal.append(f"{self.name} internal {msg!r}")

    async def on_restart(self, exc: BaseException) -> None:
        self.restart_errors.append(exc)
        await self.restart_gate.wait()
        self.journal.append(f"{self.name} restarted")

    async def on_stop(self) -> None:
        if self.tell_other_on_stop is not None and self.other is not None:
            self.other.tell(Echo(self.tell_other_on_stop))
        self.journal.append(f"stop {self.name}")


@pytest.fixture
async def supervisor() -> AsyncIterator[Supervisor]:
    sup = Supervisor(max_backoff=0.05, stop_timeout=2.0)
    yield sup
    await sup.stop()


async def hold(probe: Probe, ref: ActorRef[Any]) -> None:
    """Make the probe busy: it sits inside ``receive(Hold())`` until ``probe.gate`` opens."""
    probe.gate.clear()
    probe.holding.clear()
    ref.tell(Hold())
    await asyncio.wait_for(probe.holding.wait(), 2)


# ----------------------------------------------------------------------------- tell / ask
async def test_tell_returns_at_once_while_the_actor_is_busy(supervisor: Supervisor) -> None:
    probe = Probe()
    ref = await supervisor.start(probe)
    await hold(probe, ref)
    # tell is a plain call: no coroutine, nothing to await, the message just queues.
    assert ref.tell(Echo(1)) is None
    assert ref.tell(Echo(2)) is None
    assert ref.mailbox_depth == 2 and probe.journal == ["start probe"]
    probe.gate.set()
    await until(lambda: ref.mailbox_depth == 0 and "probe echo 2" in probe.journal)
    assert probe.journal == ["start probe", "probe held", "probe echo 1", "probe echo 2"]


async def test_a_full_mailbox_raises_mailbox_full_at_once(supervisor: Supervisor) -> None:
    probe = Probe(mailbox_size=2)
    ref = await supervisor.start(probe)
    await hold(probe, ref)
    ref.tell(Echo(1))
    ref.tell(Echo(2))
    with pytest.raises(MailboxFull) as info:
        ref.tell(Echo(3))
    assert info.value.actor == "probe" and isinstance(info.value, ActorError)
    with pytest.raises(MailboxFull):
        await asyncio.wait_for(ref.ask(Echo(4)), 1)  # refused, not queued behind the others
    # Results of the actor's own background work never compete for that space.
    probe.post_internal("result while full")
    probe.gate.set()
    await until(lambda: ref.mailbox_depth == 0)
    assert await ref.ask(Echo(5)) == 5
    assert probe.journal[1:] == [
        "probe held", "probe internal 'result while full'", "probe echo 1", "probe echo 2", "probe echo 5",
    ]


async def test_a_full_mailbox_is_answered_503_overloaded_with_retry_after(
    supervisor: Supervisor, aiohttp_client: Any
) -> None:
    probe = Probe(mailbox_size=1)
    ref = await supervisor.start(probe)

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(await ref.ask(Echo("ok")))

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except Exception as exc:
            answer = error_answer(request, exc)  # what each plane's front answers for it
            if answer is None:
                raise
            return answer

    app = web.Application(middlewares=[errors])
    app.router.add_get("/", handler)
    client = await aiohttp_client(app)
    assert (await client.get("/")).status == 200
    await hold(probe, ref)
    ref.tell(Echo("fills the mailbox"))
    resp = await client.get("/")
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert await resp.json() == {
        "error": {"message": "gateway overloaded", "type": "service_unavailable", "code": "overloaded"}
    }
    probe.gate.set()


async def test_a_gateway_whose_auth_actor_takes_no_messages_answers_503(
    gateway: Gateway, key_factory: Any
) -> None:
    raw, _ = await key_factory()
    # An uncached key needs the actor; with the actor stopped that is a shed request, not a 500.
    await gateway.state.supervisor.stop()
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {raw}"})
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["code"] == "overloaded"
    assert resp.headers["x-request-id"]


async def test_ask_fails_at_its_deadline_and_the_late_reply_is_dropped(supervisor: Supervisor) -> None:
    probe = Probe(ask_timeout=0.05)
    ref = await supervisor.start(probe)
    await hold(probe, ref)
    with pytest.raises(AskTimeout) as info:
        await ref.ask(Echo("late"))  # the actor's default deadline
    assert isinstance(info.value, TimeoutError) and info.value.actor == "probe"
    with pytest.raises(AskTimeout):
        await ref.ask(Echo("later"), timeout=0.01)  # an explicit one
    probe.gate.set()
    # The actor still handles the abandoned messages, drops their replies, and goes on.
    assert await ref.ask(Echo("next")) == "next"
    assert probe.journal[-3:] == ["probe echo late", "probe echo later", "probe echo next"]
    assert ref.restarts == 0 and ref.alive


async def test_an_error_in_an_ask_goes_to_the_asker(supervisor: Supervisor) -> None:
    ref = await supervisor.start(Probe())
    with pytest.raises(KeyError, match="no such thing"):
        await ref.ask(Fail(KeyError("no such thing")))
    assert await ref.ask(Echo(1)) == 1
    assert ref.restarts == 0


async def test_a_failed_tell_is_logged_and_the_loop_goes_on(
    supervisor: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    ref = await supervisor.start(Probe())
    with caplog.at_level(logging.ERROR, logger="gateway.actors"):
        ref.tell(Fail(ValueError("bad message")))
        assert await ref.ask(Echo("after")) == "after"
    failed = [r for r in caplog.records if r.name == "gateway.actors"]
    assert len(failed) == 1
    assert "probe: tell Fail failed" in failed[0].getMessage()
    assert failed[0].exc_info is not None and "bad message" in str(failed[0].exc_info[1])
    assert ref.restarts == 0


# ----------------------------------------------------------------------------- supervision
async def test_a_crashed_loop_is_restarted_counted_and_keeps_its_mailbox(supervisor: Supervisor) -> None:
    probe = Probe()
    ref = await supervisor.start(probe)
    probe.restart_gate.clear()  # hold the restart inside on_restart so we can look at it
    ref.tell(CrashLoop())
    await until(lambda: probe.restart_errors)
    assert isinstance(probe.restart_errors[0], RuntimeError)
    assert ref.restarts == 1 and supervisor.restarts() == {"probe": 1}
    assert supervisor.not_running() == ["probe"]
    # Messages sent meanwhile wait in the mailbox and are served after the restart.
    pending = asyncio.ensure_future(ref.ask(Echo("queued during restart")))
    await asyncio.sleep(0.01)
    assert not pending.done()
    probe.restart_gate.set()
    assert await asyncio.wait_for(pending, 2) == "queued during restart"
    assert supervisor.not_running() == []


async def test_restarts_back_off_up_to_the_cap(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor(max_backoff=0.05)
    probe = Probe()
    ref = await supervisor.start(probe)
    gaps: list[float] = []
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.actors"):
            for n in range(1, 5):
                crashed = time.monotonic()
                ref.tell(CrashLoop())
                await until(lambda n=n: len(probe.restart_errors) == n)
                gaps.append(time.monotonic() - crashed)
                assert await ref.ask(Echo(n)) == n
    finally:
        await supervisor.stop()
    planned = [
        float(m.group(1))
        for r in caplog.records
        if (m := re.search(r"actor probe crashed .*; restart \d+ in ([0-9.]+)s", r.getMessage()))
    ]
    assert planned == [0.02, 0.04, 0.05, 0.05]  # doubling, capped at max_backoff
    # A restart never comes before its delay (a lower bound only: no flaky upper bound).
    assert all(gap >= delay * 0.9 for gap, delay in zip(gaps, planned, strict=True))
    assert ref.restarts == 4


async def test_supervisor_starts_in_order_and_stops_in_reverse() -> None:
    journal: list[str] = []
    supervisor = Supervisor()
    billing = Probe("billing", journal=journal)
    auth = Probe("auth", journal=journal)
    edge = Probe("edge", journal=journal)
    billing_ref = await supervisor.start(billing)
    await supervisor.start(auth)
    await supervisor.start(edge)
    # Actors that stop first may still tell the ones started before them.
    edge.other, edge.tell_other_on_stop = billing_ref, "from edge's on_stop"
    assert [r.name for r in supervisor.refs()] == ["billing", "auth", "edge"]
    await supervisor.stop()
    assert journal[:3] == ["start billing", "start auth", "start edge"]
    assert [j for j in journal if j.startswith("stop")] == ["stop edge", "stop auth", "stop billing"]
    # billing, stopping last, still took (and drained) what edge told it while stopping.
    assert journal.index("billing echo from edge's on_stop") < journal.index("stop billing")
    assert not billing_ref.alive


async def test_a_failing_on_start_aborts_start_and_double_start_is_refused(supervisor: Supervisor) -> None:
    broken = Probe("broken")
    broken.fail_start = OSError("cannot open")
    with pytest.raises(OSError, match="cannot open"):
        await supervisor.start(broken)
    assert supervisor.refs() == []
    ok = Probe("ok")
    await supervisor.start(ok)
    with pytest.raises(RuntimeError, match="already started"):
        await supervisor.start(ok)


# ----------------------------------------------------------------------------- stop
async def test_stop_drains_queued_tells_and_asks_before_on_stop() -> None:
    supervisor = Supervisor()
    probe = Probe()
    ref = await supervisor.start(probe)
    await hold(probe, ref)
    ref.tell(Echo("told"))
    asked = asyncio.ensure_future(ref.ask(Echo("asked")))
    await asyncio.sleep(0)
    stopping = asyncio.ensure_future(supervisor.stop())
    await asyncio.sleep(0.01)
    # Intake is closed at once, while what is queued still waits its turn.
    assert not ref.alive
    with pytest.raises(ActorStopped):
        ref.tell(Echo("too late"))
    with pytest.raises(ActorStopped):
        await ref.ask(Echo("too late"))
    assert not stopping.done()
    probe.gate.set()
    await asyncio.wait_for(stopping, 3)
    assert await asked == "asked"
    assert probe.journal == ["start probe", "probe held", "probe echo told", "probe echo asked", "stop probe"]


async def test_stop_with_a_bound_answers_what_is_left_with_actor_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = Supervisor()
    probe = Probe()
    ref = await supervisor.start(probe)
    in_flight = asyncio.ensure_future(ref.ask(Hold()))
    probe.gate.clear()
    await asyncio.wait_for(probe.holding.wait(), 2)
    queued = [asyncio.ensure_future(ref.ask(Echo(i))) for i in range(3)]
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="gateway.actors"):
        await supervisor.stop(timeout=0.1)  # the held message never finishes
    assert "did not stop within" in caplog.text
    for fut in [*queued, in_flight]:
        with pytest.raises(ActorStopped):
            await asyncio.wait_for(fut, 1)  # answered, not left to its own deadline
    assert "stop probe" not in probe.journal  # past the bound, on_stop is skipped


async def test_asks_to_a_stopped_actor_fail_fast() -> None:
    supervisor = Supervisor()
    probe = Probe(ask_timeout=30)
    ref = await supervisor.start(probe)
    await supervisor.stop()
    started = time.monotonic()
    with pytest.raises(ActorStopped, match="probe"):
        await ref.ask(Echo(1))
    with pytest.raises(ActorStopped):
        ref.tell(Echo(1))
    assert time.monotonic() - started < 1  # not the 30 s deadline
    assert not ref.alive and "stopped" in repr(ref)
    await supervisor.stop()  # stopping twice is harmless


async def test_a_crashed_actor_with_a_pending_restart_still_drains_on_stop() -> None:
    supervisor = Supervisor()
    probe = Probe()
    ref = await supervisor.start(probe)
    ref.tell(CrashLoop())
    ref.tell(Echo("queued behind the crash"))
    asked = asyncio.ensure_future(ref.ask(Echo("asked behind the crash")))
    await until(lambda: ref.restarts == 1)
    await supervisor.stop()  # before the restart's backoff has elapsed
    assert await asked == "asked behind the crash"
    assert probe.journal[-3:] == ["probe echo queued behind the crash", "probe echo asked behind the crash", "stop probe"]
    assert probe.restart_errors == []  # the pending restart was called off


async def test_a_stop_during_a_restart_waits_for_it_then_drains() -> None:
    supervisor = Supervisor()
    probe = Probe()
    ref = await supervisor.start(probe)
    probe.restart_gate.clear()
    ref.tell(CrashLoop())
    await until(lambda: probe.restart_errors)  # inside on_restart now
    ref.tell(Echo("queued during the restart"))
    stopping = asyncio.ensure_future(supervisor.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # hooks never overlap: on_stop waits for on_restart
    probe.restart_gate.set()
    await asyncio.wait_for(stopping, 3)
    assert probe.journal[-3:] == ["probe restarted", "probe echo queued during the restart", "stop probe"]


async def test_a_crash_while_draining_still_runs_on_stop() -> None:
    supervisor = Supervisor()
    probe = Probe()
    ref = await supervisor.start(probe)
    await hold(probe, ref)
    ref.tell(CrashLoop())
    ref.tell(Echo("after the crash"))
    stopping = asyncio.ensure_future(supervisor.stop())
    await asyncio.sleep(0.01)
    probe.gate.set()
    await asyncio.wait_for(stopping, 3)
    # The crash is logged, the rest of the mailbox is still served, and on_stop runs (it flushes).
    assert probe.journal[-2:] == ["probe echo after the crash", "stop probe"]


# ----------------------------------------------------------------------------- deferred replies
async def test_a_deferred_reply_lets_the_loop_go_on(supervisor: Supervisor) -> None:
    probe = Probe()
    ref = await supervisor.start(probe)
    first = asyncio.ensure_future(ref.ask(Defer("a")))
    second = asyncio.ensure_future(ref.ask(Defer("b")))
    await until(lambda: len(probe.deferred) == 2)
    assert await ref.ask(Echo("meanwhile")) == "meanwhile"  # served while a and b wait
    assert not first.done() and not second.done()
    probe.deferred["b"].set_result("answer b")
    probe.deferred["a"].set_exception(LookupError("answer a failed"))
    assert await second == "answer b"
    with pytest.raises(LookupError, match="answer a failed"):
        await first


async def test_a_cancelled_deferred_reply_fails_the_ask_without_cancelling_the_asker(
    supervisor: Supervisor,
) -> None:
    probe = Probe()
    ref = await supervisor.start(probe)
    asked = asyncio.ensure_future(ref.ask(Defer("c")))
    await until(lambda: "c" in probe.deferred)
    probe.deferred["c"].cancel()  # e.g. the actor's background work was cancelled
    with pytest.raises(ActorError):
        await asked
    assert not asked.cancelled()


async def test_deferred_replies_still_open_at_stop_fail_with_actor_stopped() -> None:
    supervisor = Supervisor()
    probe = Probe(ask_timeout=30)
    ref = await supervisor.start(probe)
    asked = asyncio.ensure_future(ref.ask(Defer("never answered")))
    await until(lambda: probe.deferred)
    await supervisor.stop()
    with pytest.raises(ActorStopped):
        await asyncio.wait_for(asked, 1)  # not left hanging until its 30 s deadline


# ----------------------------------------------------------------------------- background work
async def test_spawned_work_comes_back_through_on_internal(supervisor: Supervisor) -> None:
    probe = Probe()
    ref = await supervisor.start(probe)
    ref.tell(SpawnWork(42))
    await until(lambda: any("spawned" in j for j in probe.journal))
    assert probe.journal[-1] == "probe internal ('spawned', 42, None)"


# ----------------------------------------------------------------------------- trace context
def _span_context(trace_id: int) -> otel_context.Context:
    span = NonRecordingSpan(SpanContext(trace_id=trace_id, span_id=0x1234, is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    return trace.set_span_in_context(span)


async def test_trace_context_travels_with_the_message(supervisor: Supervisor) -> None:
    probe = Probe()
    ref = await supervisor.start(probe)
    assert await ref.ask(ReadTrace()) == 0  # no context, none seen
    token = otel_context.attach(_span_context(0xABC))
    try:
        assert await ref.ask(ReadTrace()) == 0xABC
        ref.tell(SpawnWork("traced"))  # the background work's result keeps the sender's trace
    finally:
        otel_context.detach(token)
    await until(lambda: probe.internal_traces)
    assert probe.internal_traces == [0xABC]
    # The context is the message's own: it does not stay attached inside the actor.
    assert await ref.ask(ReadTrace()) == 0
    token = otel_context.attach(_span_context(0xDEF))
    try:
        assert await ref.ask(ReadTrace()) == 0xDEF
    finally:
        otel_context.detach(token)
