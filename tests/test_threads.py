"""Helper threads give way to the event loop: the journals' I/O runs under SCHED_BATCH
(its wake-ups do not preempt the loop; its share of the CPU is kept), the log writer does
not, and a forked child makes its own pool."""

from __future__ import annotations

import logging
import os
import queue
import sys
import uuid
from pathlib import Path

import pytest

from gateway.billing import journal as journal_module
from gateway.billing.journal import Journal
from gateway.core.threads import BackgroundPool
from gateway.observability.logs import _Writer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")


def test_a_background_pools_threads_run_under_sched_batch() -> None:
    pool = BackgroundPool("test-pool", workers=2)
    policies = {pool.get().submit(os.sched_getscheduler, 0).result(timeout=5) for _ in range(4)}
    assert policies == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own policy is untouched
    pool.get().shutdown()


async def test_the_journals_fsync_runs_on_a_thread_that_gives_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        seen.append(os.sched_getscheduler(0))
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    journal = Journal.open(tmp_path)
    key = uuid.uuid4()
    journal.append(b'{"call_id": "1"}\n', key, key, 1)
    assert await journal.commit() == 1
    segment = await journal.seal()
    assert segment is not None
    journal.close()
    assert seen and set(seen) == {os.SCHED_BATCH}


def test_the_log_writer_keeps_the_default_policy() -> None:
    """Under SCHED_BATCH its queue backed up while the loop was saturated (S1's peak RSS
    93 → 133 MB): what the loop logs must be written as fast as it is made."""

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.policies: queue.Queue[int] = queue.Queue()

        def emit(self, record: logging.LogRecord) -> None:
            self.policies.put(os.sched_getscheduler(0))

    seen = Seen()
    records: queue.Queue[object] = queue.Queue()
    writer = _Writer(records, seen)
    writer.start()
    try:
        records.put(logging.makeLogRecord({"msg": "hello"}))
        assert seen.policies.get(timeout=5) == os.SCHED_OTHER  # the writer thread's own policy
    finally:
        writer.stop()


def test_a_forked_child_makes_its_own_pool() -> None:
    pool = BackgroundPool("test-fork", workers=1)
    assert pool.get().submit(lambda: 1).result(timeout=5) == 1  # the parent's thread is idle now
    pid = os.fork()
    if pid == 0:  # the child: the parent's idle thread is not here; a new pool must answer
        try:
            ok = pool.get().submit(lambda: 2).result(timeout=5) == 2
        except BaseException:  # any failure is the child's exit status
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pool.get().shutdown()
