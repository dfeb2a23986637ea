"""Helper threads that give way to the event loop.

The gateway's requests all run on one event-loop thread; helper threads (the journals'
writes and fsyncs) do blocking work beside it in the same process, usually on the same
core. Linux lets a newly woken thread preempt the one running, so every fsync's
wake-ups took the core from the loop in the middle of a request (issue 23's eleventh
pass, docs/benchmark.md: at 180 requests a second the loop was preempted 1.3-1.6 times a
request, 0.2 after).

Under ``SCHED_BATCH`` a thread keeps its fair share of the CPU (so an fsync is never
starved, unlike ``SCHED_IDLE``), but its wake-ups do not preempt: it runs when the loop
waits or at the end of the loop's time slice. That suits work whose delay costs nothing
(a later fsync covers more lines), not a consumer of what the loop makes: the log writer
under it fell behind a saturated loop and its queue grew (S1's peak RSS 93 → 133 MB), so
it keeps the default policy. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BackgroundPool"]


def _give_way_to_the_loop() -> None:
    """Put the calling thread under ``SCHED_BATCH`` (Linux; no privilege needed)."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    with contextlib.suppress(OSError):  # a sandbox refusing it leaves the default policy
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread, not the process


class BackgroundPool:
    """A thread pool made on first use, once per process, whose threads give way to the
    loop. A forked child makes its own (the parent's threads are not in it)."""

    def __init__(self, name: str, workers: int) -> None:
        self._name = name
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                pool = self._pool
                if pool is None:
                    pool = self._pool = ThreadPoolExecutor(
                        max_workers=self._workers, thread_name_prefix=self._name, initializer=_give_way_to_the_loop
                    )
        return pool

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()
