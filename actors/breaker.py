"""BreakerActor: one circuit breaker per deployment, and each deployment's recent health.

State it owns, per deployment id (``provider/model`` as configured, a bounded set):

* the circuit: CLOSED (calls flow; consecutive failures are counted), OPEN (no calls
  until ``reset_timeout`` has passed), HALF_OPEN (exactly one probe call is out; its
  outcome closes or re-opens the circuit);
* a cool-down: a 429 asks the gateway to leave the deployment alone for its
  ``Retry-After``, without counting as a failure;
* recent latency (EWMA of whole calls), recent time to first token (EWMA of streams)
  and an error rate (EWMA of failed attempts), which the least-latency strategy and
  ``/admin/providers`` read.

What counts: a connection error, a timeout, a 5xx (and 408) is a failure; a 429 cools;
any other answer is a success (the deployment is up, even if it refused the request);
a call cancelled because its client went away is neutral. A call counts once toward
``fail_max`` however often it was retried on the deployment: an attempt reported with
``will_retry`` feeds the error rate only, and the call's last attempt decides. An unused
probe (its caller went away, or never sent it) is returned, so the next caller may probe.

The hot path costs no hop: the actor publishes its table as a read-only mapping of
frozen :class:`Health` entries, so a handler sees a closed circuit without asking
(:meth:`BreakerHandle.admission`). Only a probe, where exactly one caller may win, is an
ask; outcomes are tells (never awaited). Entries of closed deployments idle for
``idle_purge`` seconds are forgotten every sweep, so a deployment not used for a while
is measured afresh.

The state machine is pybreaker's: each deployment has a ``pybreaker.CircuitBreaker``
(``fail_max``, success resets the count, a failed trial re-opens, a good one closes),
and each counted outcome is replayed into it with ``with breaker.calling():`` (a
failure raises inside the block; a 429 raises an excluded exception, which pybreaker
treats as the success it is for the circuit). Its listener publishes every state
change. The actor adds what pybreaker lacks (measured in notes/libraries.md and pinned
by tests/test_breaker.py):

* exactly one half-open probe: pybreaker lets every caller through while half-open, so
  only the report carrying the probe's token reaches a half-open breaker; the actor
  grants the probe itself, with a lease, and moves the breaker to half-open then;
* neutral cancellations: pybreaker counts a cancelled call as a failure, and one in
  ``exclude`` as a success (which would reset the count or close a half-open circuit),
  so a neutral outcome is never replayed;
* the reset timeout on the monotonic clock that the published snapshot is read with
  (pybreaker times it by wall clock, which can jump), the 429 cool-down, the latency
  and error averages, and the idle purge. pybreaker's Redis storage is not used: it is
  blocking, and breakers are per process by design.

Over 500 lines while the published entry (:class:`Health`, its states and admission)
lives here; they are one concern with the actor that writes them and the handle that
reads them.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import pybreaker

from actors.runtime import Actor, ActorError, ActorRef
from gateway.core.config import BreakerSettings, GatewayConfig

__all__ = [
    "Admission",
    "BreakerActor",
    "BreakerHandle",
    "CircuitState",
    "DeploymentStatus",
    "Health",
    "Outcome",
    "Permission",
    "Permit",
    "Reconfigure",
    "Report",
]

log = logging.getLogger("gateway.breaker")

#: Weight of the newest sample in the latency and time-to-first-token averages.
LATENCY_ALPHA = 0.3
#: Weight of the newest outcome in the error rate (slower: one failure is not a trend).
ERROR_ALPHA = 0.1
#: How often idle entries are looked for.
SWEEP_SECONDS = 60.0
#: A 429 without Retry-After cools its deployment this long.
DEFAULT_COOLDOWN_SECONDS = 1.0
#: What a caller turned away because a probe is out is told to wait.
PROBE_WAIT_SECONDS = 1.0


class CircuitState(enum.IntEnum):
    """A circuit's state; the value is what ``gateway_circuit_state`` exports."""

    CLOSED = 0  # calls flow; consecutive failures are counted
    HALF_OPEN = 1  # reset_timeout has passed: one probe decides
    OPEN = 2  # no calls until reset_timeout has passed


class Outcome(enum.Enum):
    """How one upstream attempt ended, as far as the breaker cares."""

    SUCCESS = "success"  # the deployment answered (any status but 408/429/5xx)
    FAILURE = "failure"  # connection error, timeout, 408 or 5xx, stream cut
    RATE_LIMITED = "rate_limited"  # 429: cool down for Retry-After, not a failure
    NEUTRAL = "neutral"  # cancelled (client gone) or never sent: says nothing


class Admission(enum.Enum):
    """What the published snapshot says about sending a call now."""

    PASS = "pass"  # closed: send, no need to ask
    PROBE = "probe"  # a probe may be due: ask the actor, one caller wins
    WAIT = "wait"  # open, cooling or a probe is out: skip this deployment


class Health(NamedTuple):
    """One deployment's published entry; replaced whole on every change.

    A named tuple rather than a frozen dataclass, for the success fold, which publishes a
    new entry per whole call (:func:`_folded`): a tuple is made in one C call, where a
    frozen dataclass's ``__init__`` sets its eleven fields one by one through
    ``object.__setattr__`` (1.25 µs; 0.7 µs through the slots' own setters).
    """

    state: CircuitState = CircuitState.CLOSED
    #: Consecutive failures while closed.
    failures: int = 0
    #: OPEN: monotonic time from which a probe may go.
    open_until: float = 0.0
    #: A 429 asked for quiet until this monotonic time.
    cooling_until: float = 0.0
    #: HALF_OPEN: the outstanding probe's lease ends then (0: no probe is out).
    probe_until: float = 0.0
    #: HALF_OPEN: the token of the outstanding probe (0: none).
    probe_token: int = 0
    #: EWMA of whole-call latency, seconds.
    latency: float | None = None
    #: EWMA of streams' time to first token, seconds.
    ttft: float | None = None
    #: EWMA of failures (1) against answers (0).
    error_rate: float = 0.0
    calls: int = 0
    #: Monotonic time of the last permit or report.
    last_used: float = 0.0

    def admission(self, now: float, *, ignore_cooling: bool = False) -> tuple[Admission, float]:
        """What to do with this deployment at ``now``, and how long to wait if WAIT.

        ``ignore_cooling``: the caller has itself waited out the 429 that cooled it.
        """
        if self.cooling_until > now and not ignore_cooling:
            return Admission.WAIT, self.cooling_until - now
        if self.state is _STATE_CLOSED:
            return _PASS, 0.0
        if self.state is CircuitState.OPEN and now < self.open_until:
            return Admission.WAIT, self.open_until - now
        if self.state is CircuitState.HALF_OPEN and now < self.probe_until:
            return Admission.WAIT, PROBE_WAIT_SECONDS
        return Admission.PROBE, 0.0


_CLOSED = Health()
#: Enum members the hot path reads, looked up once (through their class: ~60 ns a read).
_STATE_CLOSED = CircuitState.CLOSED
_PASS = Admission.PASS
_SUCCESS = Outcome.SUCCESS

_new_health = tuple.__new__


def _folded(h: Health, latency: float | None, ttft: float | None, now: float) -> Health:
    """``h`` with one more success folded in, as :meth:`BreakerActor._report` would publish
    it: ``Health(CLOSED, 0, 0.0, ...)`` made without the named tuple's own ``__new__``
    (a Python function around the same ``tuple.__new__``)."""
    return _new_health(Health, (
        _STATE_CLOSED, 0, 0.0, h.cooling_until, h.probe_until, h.probe_token,
        _ewma(h.latency, latency), _ewma(h.ttft, ttft), h.error_rate - ERROR_ALPHA * h.error_rate, h.calls + 1, now,
    ))


# -- messages ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Permit:
    """May a call go to ``deployment`` now? Replies a :class:`Permission`."""

    deployment: str
    #: How long a granted probe stays reserved if its outcome never comes back.
    lease: float
    #: The asker's unique token: a probe granted to it is reported (or returned) with it.
    token: int


@dataclass(frozen=True, slots=True)
class Report:
    """How one attempt on ``deployment`` ended (tell)."""

    deployment: str
    outcome: Outcome
    #: The token the attempt was permitted with, if it asked (0: it did not).
    token: int = 0
    #: Whole-call latency (non-streaming) or None.
    latency: float | None = None
    #: Time to first token (streams) or None.
    ttft: float | None = None
    #: RATE_LIMITED: the provider's Retry-After, seconds.
    retry_after: float | None = None
    #: FAILURE that the caller retries on the same deployment: it feeds the error rate,
    #: but only the call's last attempt counts toward ``fail_max`` (one call, one count).
    will_retry: bool = False


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """A config reload (tell): new settings, and deployments whose history is void."""

    settings: BreakerSettings
    #: Deployments whose provider changed (or that were removed): their circuit and
    #: latency history say nothing of what the id now points at, so they are forgotten.
    forget: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Permission:
    """The answer to a Permit."""

    granted: bool
    #: The grant is the one half-open probe: its report must carry the Permit's token.
    probe: bool = False
    #: Not granted: seconds until asking again makes sense.
    retry_after: float = 0.0


@dataclass(frozen=True, slots=True)
class _Sweep:
    """Internal: forget idle entries."""


# -- pybreaker behind the actor ------------------------------------------------------------
class _AttemptFailed(Exception):
    """A failed attempt, raised inside ``calling()`` so pybreaker counts it."""


class _RateLimited(Exception):
    """A 429, raised inside ``calling()``: excluded, so pybreaker takes it as a success
    (the deployment answered) while the actor cools the deployment."""


@dataclass(slots=True)
class _Circuit:
    """One deployment's pybreaker breaker and the open deadline its listener set."""

    breaker: pybreaker.CircuitBreaker
    #: Monotonic time from which a probe may go (set when pybreaker opens the circuit).
    open_until: float = 0.0


_STATES = {
    pybreaker.STATE_CLOSED: CircuitState.CLOSED,
    pybreaker.STATE_HALF_OPEN: CircuitState.HALF_OPEN,
    pybreaker.STATE_OPEN: CircuitState.OPEN,
}


class _Transitions(pybreaker.CircuitBreakerListener):
    """Hears every breaker's state changes: sets the open deadline and logs the change.

    The actor publishes the deadline and the state with the entry it rebuilds after each
    message, so ``gateway_circuit_state`` and ``/admin/providers`` follow this listener.
    """

    def __init__(self, circuits: Mapping[str, _Circuit], reset_timeout: float) -> None:
        self._circuits = circuits
        #: Seconds an opened circuit stays open; a config reload may change it.
        self.reset_timeout = reset_timeout

    def state_change(
        self,
        cb: pybreaker.CircuitBreaker,
        old_state: pybreaker.CircuitBreakerState | None,
        new_state: pybreaker.CircuitBreakerState,
    ) -> None:
        name = cb.name or ""
        circuit = self._circuits.get(name)
        old = old_state.name if old_state is not None else None
        if new_state.name == pybreaker.STATE_OPEN:
            if circuit is not None:
                circuit.open_until = time.monotonic() + self.reset_timeout
            if old == pybreaker.STATE_HALF_OPEN:
                log.warning("circuit %s re-opened: the probe failed", name)
            else:
                log.warning("circuit %s opened after %d failures", name, cb.fail_counter)
        elif new_state.name == pybreaker.STATE_HALF_OPEN:
            log.info("circuit %s half-open: probe granted", name)
        elif old == pybreaker.STATE_HALF_OPEN:
            log.info("circuit %s closed: the probe succeeded", name)


# -- the actor -----------------------------------------------------------------------------
class BreakerActor(Actor[Permit | Report | Reconfigure]):
    """Owns every deployment's circuit and health; publishes them as ``view``."""

    name = "breaker"
    ask_timeout = 1.0

    def __init__(
        self, settings: BreakerSettings, *, mailbox_size: int = 8192, sweep_seconds: float = SWEEP_SECONDS
    ) -> None:
        self.mailbox_size = mailbox_size
        super().__init__()
        self.settings = settings
        self._table: dict[str, Health] = {}
        #: Read-only view handlers read without a hop; entries are frozen, replaced whole.
        self.view: Mapping[str, Health] = MappingProxyType(self._table)
        #: The state machines behind the entries; only this actor's task touches them.
        self._circuits: dict[str, _Circuit] = {}
        self._transitions = _Transitions(self._circuits, settings.reset_timeout)
        self._sweep_seconds = sweep_seconds
        self._sweeper: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def on_stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def receive(self, msg: Permit | Report | Reconfigure) -> Any:
        if isinstance(msg, Report):
            self._report(msg, time.monotonic())
            return None
        if isinstance(msg, Permit):
            return self._permit(msg, time.monotonic())
        if isinstance(msg, Reconfigure):
            self._reconfigure(msg)
            return None
        raise TypeError(f"unexpected message {msg!r}")

    async def on_internal(self, msg: Any) -> None:
        if isinstance(msg, _Sweep):
            self.purge_idle(time.monotonic())

    # -- transitions -------------------------------------------------------------------
    def _circuit(self, deployment: str) -> _Circuit:
        circuit = self._circuits.get(deployment)
        if circuit is None:
            breaker = pybreaker.CircuitBreaker(
                fail_max=self.settings.fail_max,
                # Kept for completeness: the actor times the reset itself (monotonic).
                reset_timeout=self.settings.reset_timeout,
                exclude=[_RateLimited],
                listeners=[self._transitions],
                name=deployment,
                throw_new_error_on_trip=False,
            )
            circuit = self._circuits[deployment] = _Circuit(breaker)
        return circuit

    def _permit(self, msg: Permit, now: float) -> Permission:
        health = self._table.get(msg.deployment, _CLOSED)
        admission, wait = health.admission(now)
        if admission is Admission.WAIT:
            return Permission(False, retry_after=wait)
        if admission is Admission.PASS:
            return Permission(True)
        # OPEN whose time is up, or HALF_OPEN whose probe was returned or expired: this
        # caller is the one probe; every other caller sees probe_until and waits.
        circuit = self._circuit(msg.deployment)
        if circuit.breaker.current_state != pybreaker.STATE_HALF_OPEN:
            circuit.breaker.half_open()
        self._table[msg.deployment] = health._replace(
            state=CircuitState.HALF_OPEN, probe_until=now + msg.lease, probe_token=msg.token,
            last_used=now,
        )
        return Permission(True, probe=True)

    def applies_now(self, deployment: str) -> bool:
        """Whether a success on ``deployment`` changes nothing but its health sample: its
        circuit is closed with no failure counted (see :meth:`BreakerHandle.report`). The
        published entry says so: every change of a circuit rewrites it (:meth:`_report`)."""
        health = self._table.get(deployment)
        return health is not None and health.state is CircuitState.CLOSED and not health.failures

    def fold_success(self, deployment: str, latency: float | None, ttft: float | None, now: float) -> None:
        """What :meth:`_report` does for a success where :meth:`applies_now`: pybreaker's
        count is zero and stays so (nothing to replay), so only the samples move."""
        self._table[deployment] = _folded(self._table[deployment], latency, ttft, now)

    def fold_if_clear(self, deployment: str, latency: float | None, ttft: float | None, now: float) -> bool:
        """:meth:`fold_success` where :meth:`applies_now`, in one look at the entry:
        whether it applied (False: the success must go through the mailbox)."""
        health = self._table.get(deployment)
        if health is None or health.state is not _STATE_CLOSED or health.failures:
            return False
        self._table[deployment] = _folded(health, latency, ttft, now)
        return True

    def _report(self, msg: Report, now: float) -> None:
        health = self._table.get(msg.deployment, _CLOSED)
        circuit = self._circuit(msg.deployment)
        breaker = circuit.breaker
        probe_until, probe_token, cooling_until = health.probe_until, health.probe_token, health.cooling_until
        state = _STATES[breaker.current_state]
        # Only the outstanding probe decides a half-open circuit (pybreaker would let any
        # report decide it); a probe whose lease ran out and was granted again to someone
        # else is just a late call. OPEN: a call from before it opened, no news.
        is_probe = msg.token != 0 and msg.token == probe_token and state is CircuitState.HALF_OPEN
        if is_probe:
            probe_until, probe_token = 0.0, 0
        outcome = msg.outcome
        # NEUTRAL is never replayed (pybreaker would count it one way or the other); a
        # retried attempt waits for its call's last one, unless it is the probe.
        counted = outcome is not Outcome.NEUTRAL and (is_probe or (state is CircuitState.CLOSED and not msg.will_retry))
        # The hot path: an answer on a closed circuit with nothing counted would only reset
        # pybreaker's zero count; skipping that no-op saves ~6 us of replay per call.
        no_op = outcome is not Outcome.FAILURE and state is CircuitState.CLOSED and breaker.fail_counter == 0
        if counted and not no_op:
            _replay(breaker, outcome)
        if outcome is Outcome.RATE_LIMITED:
            wait = msg.retry_after if msg.retry_after is not None else DEFAULT_COOLDOWN_SECONDS
            cooling_until = max(cooling_until, now + wait)
        error_rate = health.error_rate
        if outcome is not Outcome.NEUTRAL:
            sample = 0.0 if outcome is Outcome.SUCCESS else 1.0
            error_rate += ERROR_ALPHA * (sample - error_rate)
        state = _STATES[breaker.current_state]
        self._table[msg.deployment] = Health(
            state=state,
            failures=breaker.fail_counter,
            open_until=circuit.open_until if state is CircuitState.OPEN else 0.0,
            cooling_until=cooling_until,
            probe_until=probe_until,
            probe_token=probe_token,
            latency=_ewma(health.latency, msg.latency),
            ttft=_ewma(health.ttft, msg.ttft),
            error_rate=error_rate,
            calls=health.calls + (outcome is not Outcome.NEUTRAL),
            last_used=now,
        )

    def _reconfigure(self, msg: Reconfigure) -> None:
        """Apply reloaded settings; unchanged deployments keep their circuit and history."""
        self.settings = msg.settings
        self._transitions.reset_timeout = msg.settings.reset_timeout
        for circuit in self._circuits.values():
            circuit.breaker.fail_max = msg.settings.fail_max
            circuit.breaker.reset_timeout = msg.settings.reset_timeout
        for name in msg.forget:
            self._table.pop(name, None)
            self._circuits.pop(name, None)

    def purge_idle(self, now: float) -> int:
        """Forget closed, cool entries unused for ``idle_purge`` seconds; how many went."""
        horizon = now - self.settings.idle_purge
        idle = [
            name for name, h in self._table.items()
            if h.state is CircuitState.CLOSED and h.last_used <= horizon and h.cooling_until <= now
        ]
        for name in idle:
            del self._table[name]
            self._circuits.pop(name, None)
        return len(idle)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_seconds)
            self.post_internal(_Sweep())


def _replay(breaker: pybreaker.CircuitBreaker, outcome: Outcome) -> None:
    """Feed one counted outcome (not NEUTRAL) to pybreaker as the call it guarded."""
    try:
        with breaker.calling():
            if outcome is Outcome.FAILURE:
                raise _AttemptFailed
            if outcome is Outcome.RATE_LIMITED:
                raise _RateLimited
    except (_AttemptFailed, _RateLimited):
        pass  # counted (or excluded) by pybreaker; the actor only wanted the transition


def _ewma(old: float | None, sample: float | None) -> float | None:
    if sample is None:
        return old
    if old is None:
        return sample
    return old + LATENCY_ALPHA * (sample - old)


# -- what operators see --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeploymentStatus:
    """One deployment as ``/admin/providers`` and ``gateway_circuit_state`` show it."""

    #: ``provider/model`` as configured: the breaker's key and the metric's label.
    deployment: str
    provider: str
    model: str
    #: Model groups routing to it, in config order.
    model_groups: tuple[str, ...]
    state: CircuitState
    consecutive_failures: int
    #: Recent whole-call latency and stream time to first token (EWMA), seconds.
    latency_seconds: float | None
    ttft_seconds: float | None
    #: Recent share of failed attempts (EWMA, 0..1).
    error_rate: float
    #: Outcomes counted since the entry was last forgotten.
    calls: int
    #: OPEN: seconds until a probe may go. Cooling: seconds until it cools.
    open_for_seconds: float | None
    cooling_for_seconds: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the state as its name (``closed|half_open|open``)."""
        return {
            "deployment": self.deployment,
            "provider": self.provider,
            "model": self.model,
            "model_groups": list(self.model_groups),
            "circuit_state": self.state.name.lower(),
            "circuit_state_value": int(self.state),
            "consecutive_failures": self.consecutive_failures,
            "latency_seconds": self.latency_seconds,
            "ttft_seconds": self.ttft_seconds,
            "error_rate": self.error_rate,
            "calls": self.calls,
            "open_for_seconds": self.open_for_seconds,
            "cooling_for_seconds": self.cooling_for_seconds,
        }


# -- the handle ----------------------------------------------------------------------------
class BreakerHandle:
    """What dispatch calls: snapshot reads on the hot path, an ask only for a probe."""

    __slots__ = ("_actor", "_ref", "_tokens", "_view", "dropped_reports")

    def __init__(self, actor: BreakerActor, ref: ActorRef[Any]) -> None:
        self._actor = actor
        self._ref = ref
        self._view = actor.view
        self._tokens = itertools.count(1)
        #: Reports lost to a full mailbox (overload); counted, never raised.
        self.dropped_reports = 0

    def admission(
        self, deployment: str, now: float | None = None, *, ignore_cooling: bool = False
    ) -> tuple[Admission, float]:
        """PASS, PROBE or WAIT (with seconds) for ``deployment``, from the snapshot."""
        health = self._view.get(deployment)
        if health is None:
            return _PASS, 0.0
        return health.admission(time.monotonic() if now is None else now, ignore_cooling=ignore_cooling)

    def health(self, deployment: str) -> Health | None:
        """The published entry, or None if the deployment has no recent history."""
        return self._view.get(deployment)

    @property
    def view(self) -> Mapping[str, Health]:
        return self._view

    async def permit(self, deployment: str, lease: float) -> tuple[Permission, int]:
        """Ask the actor for a probe (or a pass, if it closed meanwhile).

        Returns the permission and the token to report with. If the asker is cancelled
        while waiting, a probe granted to it after all is returned at once (the return
        is queued behind the ask). Raises MailboxFull or AskTimeout when the actor
        cannot answer (503 overloaded).
        """
        token = next(self._tokens)
        try:
            reply: Permission = await self._ref.ask(Permit(deployment, lease, token))
        except BaseException:
            self.report(deployment, Outcome.NEUTRAL, token=token)
            raise
        return reply, token

    def report(
        self,
        deployment: str,
        outcome: Outcome,
        *,
        token: int = 0,
        latency: float | None = None,
        ttft: float | None = None,
        retry_after: float | None = None,
        will_retry: bool = False,
    ) -> None:
        """Tell the outcome of one attempt; never raises (a lost report is counted).

        ``token`` is the one :meth:`permit` returned, if the attempt asked.
        ``will_retry``: a failed attempt the caller sends again to the same deployment,
        so the call counts once toward ``fail_max``, by its last attempt.
        """
        actor = self._actor
        if (outcome is _SUCCESS and token == 0 and actor.running
                and actor.fold_if_clear(deployment, latency, ttft, time.monotonic())):
            # The common case, a success on a closed circuit with nothing counted against
            # it, only folds a latency sample into the published entry: done here, in the
            # caller's task, it saves the tell and the actor's wake-up (~6 µs per call).
            # Asyncio runs one callback at a time and _report never awaits, so this is as
            # atomic as the actor's own loop; anything that may change a circuit still
            # goes through the mailbox, in order.
            return
        try:
            self._ref.tell(Report(deployment, outcome, token, latency, ttft, retry_after, will_retry))
        except ActorError:
            self.dropped_reports += 1

    def reconfigure(self, settings: BreakerSettings, forget: tuple[str, ...] = ()) -> None:
        """Tell the actor about a config reload (see :class:`Reconfigure`)."""
        self._ref.tell(Reconfigure(settings, forget))

    def statuses(self, config: GatewayConfig, now: float | None = None) -> list[DeploymentStatus]:
        """Every configured deployment with its circuit and health, in config order."""
        now = time.monotonic() if now is None else now
        groups: dict[str, list[str]] = {}
        where: dict[str, tuple[str, str]] = {}
        for group in config.models:
            for d in group.deployments:
                names = groups.setdefault(d.id, [])
                if group.name not in names:
                    names.append(group.name)
                where.setdefault(d.id, (d.provider, d.model))
        return [_status(dep, provider, model, tuple(groups[dep]), self._view.get(dep, _CLOSED), now)
                for dep, (provider, model) in where.items()]


def _status(
    deployment: str, provider: str, model: str, groups: tuple[str, ...], h: Health, now: float
) -> DeploymentStatus:
    state = h.state
    if state is CircuitState.OPEN and now >= h.open_until:
        state = CircuitState.HALF_OPEN  # a probe may go: that is half-open to an observer
    return DeploymentStatus(
        deployment=deployment,
        provider=provider,
        model=model,
        model_groups=groups,
        state=state,
        consecutive_failures=h.failures,
        latency_seconds=h.latency,
        ttft_seconds=h.ttft,
        error_rate=round(h.error_rate, 6),
        calls=h.calls,
        open_for_seconds=max(0.0, h.open_until - now) if h.state is CircuitState.OPEN else None,
        cooling_for_seconds=max(0.0, h.cooling_until - now) if h.cooling_until > now else None,
    )
