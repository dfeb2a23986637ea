"""The breaker actor on its own (real runtime) and in front of fake providers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pybreaker
import pytest

from actors.breaker import Admission, BreakerActor, BreakerHandle, CircuitState, Health, Outcome
from actors.runtime import Supervisor
from gateway.core.config import BreakerSettings
from tests.conftest import auth, chat_body
from tests.fleet import fleet_config, records, served_by

DEP = "p/m"


@pytest.fixture
async def breaker() -> AsyncIterator[tuple[BreakerActor, BreakerHandle]]:
    supervisor = Supervisor()
    actor = BreakerActor(BreakerSettings(fail_max=3, reset_timeout=0.2, idle_purge=0.2), sweep_seconds=0.1)
    ref = await supervisor.start(actor)
    yield actor, BreakerHandle(actor, ref)
    await supervisor.stop()


async def settle(handle: BreakerHandle) -> None:
    """Let the actor drain the tells sent so far (an ask queues behind them)."""
    await handle.permit("settle/none", 1.0)


async def open_circuit(handle: BreakerHandle, dep: str = DEP) -> None:
    for _ in range(3):
        handle.report(dep, Outcome.FAILURE)
    await settle(handle)
    assert handle.health(dep).state is CircuitState.OPEN


async def test_opens_after_fail_max_consecutive_failures(breaker: Any) -> None:
    _, handle = breaker
    for outcome in (Outcome.FAILURE, Outcome.FAILURE, Outcome.SUCCESS, Outcome.FAILURE, Outcome.FAILURE):
        handle.report(DEP, outcome)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.CLOSED  # a success resets the count
    assert handle.admission(DEP)[0] is Admission.PASS
    handle.report(DEP, Outcome.FAILURE)
    await settle(handle)
    admission, wait = handle.admission(DEP)
    assert admission is Admission.WAIT and 0 < wait <= 0.2


async def test_half_open_grants_exactly_one_probe_among_20(breaker: Any) -> None:
    _, handle = breaker
    await open_circuit(handle)
    await asyncio.sleep(0.25)
    assert handle.admission(DEP)[0] is Admission.PROBE
    answers = await asyncio.gather(*(handle.permit(DEP, 5.0) for _ in range(20)))
    probes = [(p, token) for p, token in answers if p.granted]
    assert len(probes) == 1 and probes[0][0].probe
    assert all(p.retry_after > 0 for p, _ in answers if not p.granted)
    assert handle.admission(DEP)[0] is Admission.WAIT  # the others see it without asking
    # The probe succeeds: closed, and everyone passes again.
    handle.report(DEP, Outcome.SUCCESS, token=probes[0][1], latency=0.01)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.CLOSED
    assert handle.admission(DEP)[0] is Admission.PASS


async def test_a_failed_probe_reopens_and_an_unused_one_returns(breaker: Any) -> None:
    _, handle = breaker
    await open_circuit(handle)
    await asyncio.sleep(0.25)
    permission, token = await handle.permit(DEP, 5.0)
    assert permission.probe
    handle.report(DEP, Outcome.NEUTRAL, token=token)  # its caller went away
    await settle(handle)
    assert handle.admission(DEP)[0] is Admission.PROBE
    permission, token = await handle.permit(DEP, 5.0)
    assert permission.probe
    # A report from an ordinary late call is no probe outcome.
    handle.report(DEP, Outcome.SUCCESS)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.HALF_OPEN
    handle.report(DEP, Outcome.FAILURE, token=token)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.OPEN


async def test_a_lost_probe_is_reclaimed_after_its_lease(breaker: Any) -> None:
    _, handle = breaker
    await open_circuit(handle)
    await asyncio.sleep(0.25)
    first, _ = await handle.permit(DEP, 0.1)
    assert first.probe and not (await handle.permit(DEP, 0.1))[0].granted
    await asyncio.sleep(0.15)
    assert (await handle.permit(DEP, 0.1))[0].probe


async def test_cancellations_never_count(breaker: Any) -> None:
    _, handle = breaker
    for _ in range(10):
        handle.report(DEP, Outcome.NEUTRAL)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.CLOSED and handle.health(DEP).failures == 0


async def test_rate_limit_cools_without_counting_and_idle_entries_go(breaker: Any) -> None:
    actor, handle = breaker
    handle.report(DEP, Outcome.FAILURE)
    handle.report(DEP, Outcome.RATE_LIMITED, retry_after=0.1)
    await settle(handle)
    health = handle.health(DEP)
    assert health.state is CircuitState.CLOSED and health.failures == 0
    assert handle.admission(DEP)[0] is Admission.WAIT
    await asyncio.sleep(0.15)
    assert handle.admission(DEP)[0] is Admission.PASS
    # Unused past idle_purge, the entry goes with a periodic sweep (an open one would stay).
    for _ in range(50):
        if handle.health(DEP) is None:
            break
        await asyncio.sleep(0.05)
    assert handle.health(DEP) is None
    await open_circuit(handle, "other/m")
    assert actor.purge_idle(asyncio.get_running_loop().time() + 10) == 0


async def test_a_call_counts_once_however_often_it_was_retried(breaker: Any) -> None:
    _, handle = breaker
    for call in range(1, 3):  # two calls, each two retried attempts and a failed last one
        for will_retry in (True, True, False):
            handle.report(DEP, Outcome.FAILURE, will_retry=will_retry)
        await settle(handle)
        health = handle.health(DEP)
        assert health.state is CircuitState.CLOSED and health.failures == call
    assert health.calls == 6 and health.error_rate > 0  # every attempt is still measured
    # A call that fails, then succeeds on its retry: the success resets the count.
    handle.report(DEP, Outcome.FAILURE, will_retry=True)
    handle.report(DEP, Outcome.SUCCESS, latency=0.01)
    await settle(handle)
    assert handle.health(DEP).failures == 0
    for _ in range(3):
        handle.report(DEP, Outcome.FAILURE, will_retry=True)
        handle.report(DEP, Outcome.FAILURE)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.OPEN  # three failed calls


async def test_the_probe_decides_at_once_even_if_its_call_would_retry(breaker: Any) -> None:
    _, handle = breaker
    await open_circuit(handle)
    await asyncio.sleep(0.25)
    permission, token = await handle.permit(DEP, 5.0)
    assert permission.probe
    handle.report(DEP, Outcome.FAILURE, token=token, will_retry=True)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.OPEN


async def test_an_interleaved_cancellation_neither_resets_nor_counts(breaker: Any) -> None:
    _, handle = breaker
    for outcome in (Outcome.FAILURE, Outcome.FAILURE, Outcome.NEUTRAL):
        handle.report(DEP, outcome)
    await settle(handle)
    assert handle.health(DEP).failures == 2  # not reset: a cancellation is no success
    handle.report(DEP, Outcome.FAILURE)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.OPEN


async def test_rate_limits_reset_the_count_and_a_429_probe_closes(breaker: Any) -> None:
    _, handle = breaker
    for outcome in (Outcome.FAILURE, Outcome.FAILURE, Outcome.RATE_LIMITED, Outcome.FAILURE, Outcome.FAILURE):
        handle.report(DEP, outcome, retry_after=0.01)
    await settle(handle)
    assert handle.health(DEP).state is CircuitState.CLOSED and handle.health(DEP).failures == 2
    await open_circuit(handle)
    await asyncio.sleep(0.25)
    permission, token = await handle.permit(DEP, 5.0)
    assert permission.probe
    handle.report(DEP, Outcome.RATE_LIMITED, token=token, retry_after=0.05)
    await settle(handle)
    health = handle.health(DEP)
    assert health.state is CircuitState.CLOSED and health.failures == 0  # it answered
    assert handle.admission(DEP)[0] is Admission.WAIT  # but cools for its Retry-After


# ----------------------------------------------------------------------------- pybreaker
# What the actor relies on in pybreaker, and what it works around (notes/libraries.md):
# pinned here so an upgrade that changes either fails a test, not production.
class _Boom(Exception):
    pass


class _Excluded(Exception):
    pass


def _fold(cb: pybreaker.CircuitBreaker, exc: type[Exception] | None) -> None:
    try:
        with cb.calling():
            if exc is not None:
                raise exc
    except (_Boom, _Excluded):
        pass


async def test_pybreaker_calling_works_around_an_await_and_opens_at_fail_max() -> None:
    cb = pybreaker.CircuitBreaker(fail_max=2, reset_timeout=60, throw_new_error_on_trip=False)
    for _ in range(2):
        with pytest.raises(_Boom), cb.calling():
            await asyncio.sleep(0)
            raise _Boom
    assert cb.current_state == pybreaker.STATE_OPEN
    with pytest.raises(pybreaker.CircuitBreakerError), cb.calling():
        pass


async def test_pybreaker_half_open_admits_every_concurrent_caller_so_the_actor_gates_it() -> None:
    cb = pybreaker.CircuitBreaker(fail_max=1, reset_timeout=60, throw_new_error_on_trip=False)
    _fold(cb, _Boom)
    cb.half_open()
    admitted = 0

    async def caller() -> None:
        nonlocal admitted
        with cb.calling():
            admitted += 1
            await asyncio.sleep(0.01)

    await asyncio.gather(*(caller() for _ in range(10)))
    assert admitted == 10  # no single trial call: hence the actor's probe token and lease
    assert cb.current_state == pybreaker.STATE_CLOSED


def test_pybreaker_counts_excluded_as_success_and_cancellation_as_failure() -> None:
    cb = pybreaker.CircuitBreaker(fail_max=3, reset_timeout=60, exclude=[_Excluded], throw_new_error_on_trip=False)
    _fold(cb, _Boom)
    _fold(cb, _Boom)
    _fold(cb, _Excluded)
    assert cb.fail_counter == 0  # excluded resets: right for a 429, wrong for a cancellation
    with pytest.raises(asyncio.CancelledError), cb.calling():
        raise asyncio.CancelledError
    assert cb.fail_counter == 1  # so the actor never replays a cancelled call


async def test_the_actor_drives_one_pybreaker_per_deployment(breaker: Any) -> None:
    actor, handle = breaker
    states: list[tuple[str, str]] = []

    class Seen(pybreaker.CircuitBreakerListener):
        def state_change(self, cb: Any, old: Any, new: Any) -> None:
            states.append((cb.name, new.name))

    handle.report(DEP, Outcome.SUCCESS)
    await settle(handle)
    actor._circuits[DEP].breaker.add_listener(Seen())
    await open_circuit(handle)
    await asyncio.sleep(0.25)
    _, token = await handle.permit(DEP, 5.0)
    handle.report(DEP, Outcome.SUCCESS, token=token)
    await settle(handle)
    assert states == [(DEP, "open"), (DEP, "half-open"), (DEP, "closed")]


# ----------------------------------------------------------------------------- over loopback
BREAKER = {"fail_max": 2, "reset_timeout_seconds": 0.3}


async def test_breaker_opens_probes_once_under_20_callers_and_closes(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    fake = await fake_factory()
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "0"}, config_yaml=fleet_config(
        {"a": fake}, [{"name": "m", "deployments": [{"provider": "a", "model": "m"}]}], circuit_breaker=BREAKER))
    await fake.script({"status": 500}, {"status": 500})
    for _ in range(2):
        assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))).status == 500
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "circuit_open"
    assert resp.headers["Retry-After"] == "1"
    assert await served_by(fake) == [2]  # open: the provider is left alone
    (status,) = gw.state.deployment_health()
    assert status.state is CircuitState.OPEN and status.to_dict()["circuit_state_value"] == 2
    await asyncio.sleep(0.35)
    assert gw.state.deployment_health()[0].state is CircuitState.HALF_OPEN
    await fake.script({"delay_ms": 300})  # the probe takes a while; 19 others arrive meanwhile
    answers = await asyncio.gather(*(
        gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key)) for _ in range(20)))
    statuses = sorted(r.status for r in answers)
    assert statuses == [200] + [503] * 19
    assert await served_by(fake) == [3]
    assert gw.state.deployment_health()[0].state is CircuitState.CLOSED
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))).status == 200


async def test_client_disconnects_do_not_open_it_and_return_the_probe(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory()
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "0"}, config_yaml=fleet_config(
        {"a": fake}, [{"name": "m", "deployments": [{"provider": "a", "model": "m"}]}], circuit_breaker=BREAKER))
    calls = records(gw)

    async def hang_up(stream: bool = False) -> None:
        finished = len(calls)
        await fake.script({"hang": True})
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(gw.url("/v1/chat/completions"), json=chat_body(model="m", stream=stream),
                                   headers=auth(api_key), timeout=aiohttp.ClientTimeout(total=0.3))
        for _ in range(100):  # the handler sees the disconnect and cancels the upstream call
            if len(calls) > finished:
                break
            await asyncio.sleep(0.02)

    for stream in (False, True, False, True):
        await hang_up(stream)
    assert [c.outcome for c in calls] == ["cancelled"] * 4
    assert gw.state.breaker.health("a/m").state is CircuitState.CLOSED
    assert gw.state.breaker.health("a/m").failures == 0
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))).status == 200
    # Open it, let the probe's caller hang up: the probe returns, the next caller probes.
    await fake.script({"status": 500}, {"status": 500})
    for _ in range(2):
        await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    await asyncio.sleep(0.35)
    await hang_up()
    assert gw.state.breaker.health("a/m").state is CircuitState.HALF_OPEN
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 200
    assert gw.state.breaker.health("a/m").state is CircuitState.CLOSED


async def test_a_failed_call_with_retries_counts_once_toward_fail_max(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    """fail_max 3 and two retries: one call whose three attempts fail leaves the circuit
    closed (it used to open it for reset_timeout); three such calls open it."""
    fake = await fake_factory()
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "2"}, config_yaml=fleet_config(
        {"a": fake}, [{"name": "m", "deployments": [{"provider": "a", "model": "m"}]}],
        circuit_breaker={"fail_max": 3, "reset_timeout_seconds": 60}))
    calls = records(gw)
    await fake.script(*({"status": 503} for _ in range(9)))
    for call in range(1, 3):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
        assert resp.status == 503 and (await resp.json())["error"]["type"] == "fake"  # the provider's own
        assert calls[-1].retries == 2
        (status,) = gw.state.deployment_health()
        assert status.state is CircuitState.CLOSED and status.consecutive_failures == call
    assert await served_by(fake) == [6]
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m", stream=True), headers=auth(api_key))
    assert resp.status == 503 and (await resp.json())["error"]["type"] == "fake"
    (status,) = gw.state.deployment_health()
    assert status.state is CircuitState.OPEN and status.calls == 9
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "circuit_open"
    assert await served_by(fake) == [9]  # open: the provider is left alone


async def test_a_success_on_a_clean_closed_circuit_is_folded_in_at_once_as_the_actor_would() -> None:
    """The handle applies such a success in the caller's task (no hop): the entry must be
    the one the actor's own report would publish, and anything else must still queue."""
    from actors.breaker import Report

    settings = BreakerSettings(fail_max=3, reset_timeout=30)
    inline, queued = BreakerActor(settings), BreakerActor(settings)
    supervisor = Supervisor()
    handle = BreakerHandle(inline, await supervisor.start(inline))
    try:
        now = 100.0
        for actor in (inline, queued):  # a first failure and a success: a history, then clean
            actor._report(Report(DEP, Outcome.FAILURE, 0, None, None, None, False), now)
            actor._report(Report(DEP, Outcome.SUCCESS, 0, 0.2, None, None, False), now)
        assert inline.applies_now(DEP) and handle.health(DEP).failures == 0
        for i, (latency, ttft) in enumerate([(0.1, None), (None, 0.05), (0.3, 0.02)]):
            inline.fold_success(DEP, latency, ttft, now + i)
            queued._report(Report(DEP, Outcome.SUCCESS, 0, latency, ttft, None, False), now + i)
            assert inline.view[DEP] == queued.view[DEP]
            assert type(inline.view[DEP]) is Health  # an entry, not just a tuple of its values
        handle.report(DEP, Outcome.SUCCESS, latency=0.1)  # applied before report() returns
        assert handle.health(DEP).calls == queued.view[DEP].calls + 1
        handle.report(DEP, Outcome.FAILURE)  # a failure is the actor's: it waits in the mailbox
        assert handle.health(DEP).failures == 0
        await settle(handle)
        assert handle.health(DEP).failures == 1 and not inline.applies_now(DEP)
    finally:
        await supervisor.stop()
