"""BreakerActor: one circuit breaker per deployment, and each deployment's recent health.

State it owns, per deployment id (``provider/model`` as configured, a bounded set):

* the circuit: CLOSED (calls flow; consecutive failures are counted), OPEN (no calls
  until ``reset_timeout`` has passed), HALF_OPEN (exactly one probe call is out; its
  outcome closes or re-opens the circuit);
* a cool-down: a 429 asks the gateway to leave the deployment alone for its
  ``Retry-After``, without counting as a failure;
* recent latency (EWMA of whole calls), recent time to first token (EWMA of streams)
  and an error rate (EWMA of failures), which the least-latency strategy and
  ``/admin/providers`` read.

What counts: a connection error, a timeout, a 5xx (and 408) is a failure; a 429 cools;
any other answer is a success (the deployment is up, even if it refused the request);
a call cancelled because its client went away is neutral. An unused probe (its caller
went away, or never sent it) is returned, so the next caller may probe.

The hot path costs no hop: the actor publishes its table as a read-only mapping of
frozen :class:`Health` entries, so a handler sees a closed circuit without asking
(:meth:`BreakerHandle.admission`). Only a probe, where exactly one caller may win, is an
ask; outcomes are tells (never awaited). Entries of closed deployments idle for
``idle_purge`` seconds are forgotten every sweep, so a deployment not used for a while
is measured afresh.

Why not pybreaker: measured (see notes/libraries.md), its half-open state lets every
concurrent caller through instead of one probe, and it counts a cancelled call as a
failure. Both rules are the point of this breaker, and its state machine is ~40 lines
here, so the actor owns a small one rather than wrapping pybreaker and overriding both.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

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


@dataclass(frozen=True, slots=True)
class Health:
    """One deployment's published entry; replaced whole on every change."""

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
        if self.state is CircuitState.CLOSED:
            return Admission.PASS, 0.0
        if self.state is CircuitState.OPEN and now < self.open_until:
            return Admission.WAIT, self.open_until - now
        if self.state is CircuitState.HALF_OPEN and now < self.probe_until:
            return Admission.WAIT, PROBE_WAIT_SECONDS
        return Admission.PROBE, 0.0


_CLOSED = Health()


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


# -- the actor -----------------------------------------------------------------------------
class BreakerActor(Actor[Permit | Report]):
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
        self._sweep_seconds = sweep_seconds
        self._sweeper: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def on_stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def receive(self, msg: Permit | Report) -> Any:
        if isinstance(msg, Report):
            self._report(msg, time.monotonic())
            return None
        if isinstance(msg, Permit):
            return self._permit(msg, time.monotonic())
        raise TypeError(f"unexpected message {msg!r}")

    async def on_internal(self, msg: Any) -> None:
        if isinstance(msg, _Sweep):
            self.purge_idle(time.monotonic())

    # -- transitions -------------------------------------------------------------------
    def _permit(self, msg: Permit, now: float) -> Permission:
        health = self._table.get(msg.deployment, _CLOSED)
        admission, wait = health.admission(now)
        if admission is Admission.WAIT:
            return Permission(False, retry_after=wait)
        if admission is Admission.PASS:
            return Permission(True)
        # OPEN whose time is up, or HALF_OPEN whose probe was returned or expired: this
        # caller is the one probe; every other caller sees probe_until and waits.
        self._table[msg.deployment] = replace(
            health, state=CircuitState.HALF_OPEN, probe_until=now + msg.lease, probe_token=msg.token,
            last_used=now,
        )
        log.info("circuit %s half-open: probe granted", msg.deployment)
        return Permission(True, probe=True)

    def _report(self, msg: Report, now: float) -> None:
        health = self._table.get(msg.deployment, _CLOSED)
        state, failures = health.state, health.failures
        open_until, probe_until, cooling_until = health.open_until, health.probe_until, health.cooling_until
        probe_token = health.probe_token
        # Only the outstanding probe decides a half-open circuit; a probe whose lease ran
        # out and was granted again to someone else is just a late call.
        is_probe = msg.token != 0 and msg.token == probe_token and state is CircuitState.HALF_OPEN
        if is_probe:
            probe_until, probe_token = 0.0, 0
        outcome = msg.outcome
        if outcome is Outcome.NEUTRAL:
            pass  # a probe never used was returned above: the next caller may probe
        elif outcome is Outcome.FAILURE:
            if is_probe:
                state, open_until = CircuitState.OPEN, now + self.settings.reset_timeout
                log.warning("circuit %s re-opened: the probe failed", msg.deployment)
            elif state is CircuitState.CLOSED:
                failures += 1
                if failures >= self.settings.fail_max:
                    state, open_until = CircuitState.OPEN, now + self.settings.reset_timeout
                    log.warning("circuit %s opened after %d failures", msg.deployment, failures)
            # OPEN or HALF_OPEN and not the probe: a call from before it opened; no news.
        else:  # SUCCESS or RATE_LIMITED: the deployment answered
            if is_probe:
                log.info("circuit %s closed: the probe succeeded", msg.deployment)
            if is_probe or state is CircuitState.CLOSED:
                state, failures, open_until = CircuitState.CLOSED, 0, 0.0
            if outcome is Outcome.RATE_LIMITED:
                wait = msg.retry_after if msg.retry_after is not None else DEFAULT_COOLDOWN_SECONDS
                cooling_until = max(cooling_until, now + wait)
        error_rate = health.error_rate
        if outcome is not Outcome.NEUTRAL:
            sample = 0.0 if outcome is Outcome.SUCCESS else 1.0
            error_rate += ERROR_ALPHA * (sample - error_rate)
        self._table[msg.deployment] = Health(
            state=state,
            failures=failures,
            open_until=open_until,
            cooling_until=cooling_until,
            probe_until=probe_until,
            probe_token=probe_token,
            latency=_ewma(health.latency, msg.latency),
            ttft=_ewma(health.ttft, msg.ttft),
            error_rate=error_rate,
            calls=health.calls + (outcome is not Outcome.NEUTRAL),
            last_used=now,
        )

    def purge_idle(self, now: float) -> int:
        """Forget closed, cool entries unused for ``idle_purge`` seconds; how many went."""
        horizon = now - self.settings.idle_purge
        idle = [
            name for name, h in self._table.items()
            if h.state is CircuitState.CLOSED and h.last_used <= horizon and h.cooling_until <= now
        ]
        for name in idle:
            del self._table[name]
        return len(idle)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_seconds)
            self.post_internal(_Sweep())


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

    __slots__ = ("_ref", "_tokens", "_view", "dropped_reports")

    def __init__(self, actor: BreakerActor, ref: ActorRef[Any]) -> None:
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
            return Admission.PASS, 0.0
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
    ) -> None:
        """Tell the outcome of one attempt; never raises (a lost report is counted).

        ``token`` is the one :meth:`permit` returned, if the attempt asked.
        """
        try:
            self._ref.tell(Report(deployment, outcome, token, latency, ttft, retry_after))
        except ActorError:
            self.dropped_reports += 1

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
