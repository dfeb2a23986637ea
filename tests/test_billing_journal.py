"""The billing journal on a real directory: commit, seal, recovery, slots, torn lines."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from pathlib import Path

import orjson
import pytest

from gateway.billing.journal import Journal
from gateway.billing.shipping import JournalShipper

KEY, SUBJECT = uuid.uuid4(), uuid.uuid4()


def line(n: int, cost: float = 0.5) -> bytes:
    return orjson.dumps(
        {"call_id": str(uuid.uuid4()), "n": n, "api_key_id": str(KEY), "subject_id": str(SUBJECT), "cost_usd": cost},
        option=orjson.OPT_APPEND_NEWLINE,
    )


def crash(journal: Journal) -> None:
    """What SIGKILL does to a journal: file descriptors close, nothing else runs."""
    if journal._fd is not None:
        os.close(journal._fd)
    assert journal._lock_fd is not None
    os.close(journal._lock_fd)


async def test_commit_seal_read_discard(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    lines = [line(i) for i in range(5)]
    for raw in lines:
        journal.append(raw, KEY, SUBJECT, 500_000)
    assert journal.buffered == 5 and journal.pending_events == 5
    assert await journal.commit() == 5
    assert journal.buffered == 0
    segment = await journal.seal()
    assert segment is not None and segment.lines == 5
    assert Journal.read(segment) == lines
    assert journal.unshipped_spend() == ({KEY: 2_500_000}, {SUBJECT: 2_500_000})
    assert await journal.seal() is None  # nothing new: no empty segment
    journal.discard(segment)
    assert not segment.path.exists() and journal.pending_events == 0
    journal.close()


async def test_a_crash_leaves_committed_events_for_the_next_open(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    committed = [line(i) for i in range(3)]
    for raw in committed:
        journal.append(raw, KEY, SUBJECT, 500_000)
    await journal.commit()
    sealed = await journal.seal()
    journal.append(line(99), KEY, SUBJECT, 0.5)
    await journal.commit()  # in the active segment, not sealed yet
    # Appended, never committed: written into the file at once, so a crash of the process
    # (not of the machine: that takes the fsync) still leaves it.
    journal.append(line(100), KEY, SUBJECT, 0.5)
    crash(journal)
    assert sealed is not None
    reopened = Journal.open(tmp_path)
    assert reopened.directory == journal.directory  # the same slot, free again
    leftovers = reopened.sealed()
    assert [s.lines for s in leftovers] == [3, 2]
    assert [orjson.loads(x)["n"] for s in leftovers for x in Journal.read(s)] == [0, 1, 2, 99, 100]
    # Spend of the leftovers is known again, so budgets count them before they ship.
    assert reopened.unshipped_spend()[0] == {KEY: 2_500_000}
    # New segments never reuse a leftover's name.
    reopened.append(line(5), KEY, SUBJECT, 0.5)
    new = await reopened.seal()
    assert new is not None and new.path not in {s.path for s in leftovers}
    reopened.close()


async def test_torn_tail_is_skipped_and_garbage_set_aside(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    good = [line(1), line(2)]
    for raw in good:
        journal.append(raw, KEY, SUBJECT, 500_000)
    await journal.commit()
    segment_path = journal._active.path if journal._active else None
    crash(journal)
    assert segment_path is not None
    with segment_path.open("ab") as f:
        f.write(b"not json at all\n")
        f.write(b'{"call_id": "torn", "n": 3, "api_k')  # a write cut by the crash
    reopened = Journal.open(tmp_path)
    [segment] = reopened.sealed()
    assert segment.lines == 2 and Journal.read(segment) == good
    assert (reopened.directory / "rejected.jsonl").read_bytes() == b"not json at all\n"
    reopened.close()


async def test_each_process_gets_its_own_slot(tmp_path: Path) -> None:
    first = Journal.open(tmp_path)
    second = Journal.open(tmp_path)
    assert first.directory != second.directory
    second.append(line(7), KEY, SUBJECT, 0.5)
    await second.commit()
    crash(second)  # its slot is free now, with an event in it
    first.append(line(8), KEY, SUBJECT, 0.5)
    await first.commit()
    # A restarted process takes the free slot and finds its events; the live slot is not touched.
    third = Journal.open(tmp_path)
    assert third.directory == second.directory
    assert [orjson.loads(x)["n"] for s in third.sealed() for x in Journal.read(s)] == [7]
    assert first.pending_events == 1 and list(first.directory.glob("segment-*"))
    first.close()
    third.close()


async def test_orphans_move_into_the_opener_slot(tmp_path: Path) -> None:
    holder = Journal.open(tmp_path)  # slot-0 stays held
    dead = Journal.open(tmp_path)  # slot-1
    dead.append(line(1), KEY, SUBJECT, 0.5)
    await dead.commit()
    crash(dead)
    other = Journal.open(tmp_path)  # takes slot-1 back
    keeper = Journal.open(tmp_path)  # slot-2: nothing to adopt while slot-1 is held
    assert keeper.sealed() == []
    crash(other)
    holder.close()
    adopter = Journal.open(tmp_path)  # slot-0 is free again: takes it and adopts slot-1's files
    assert adopter.directory.name == "slot-0"
    assert [orjson.loads(x)["n"] for s in adopter.sealed() for x in Journal.read(s)] == [1]
    assert not list(dead.directory.glob("segment-*"))
    adopter.close()
    keeper.close()


async def test_an_event_after_close_is_written_at_once(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    journal.close()
    late = line(42)
    journal.append(late, KEY, SUBJECT, 500_000)
    reopened = Journal.open(tmp_path)
    assert [x for s in reopened.sealed() for x in Journal.read(s)] == [late]
    reopened.close()


async def test_an_event_appended_while_a_segment_is_being_sealed_is_not_stranded(tmp_path: Path) -> None:
    """Found by the fault suite: an append while seal() waits on the disk used to count in
    the segment being sealed but stay in the buffer, with no active segment to write it
    to, so every later commit failed (and close() dropped it)."""
    journal = Journal.open(tmp_path)
    first, late = line(1), line(2)
    journal.append(first, KEY, SUBJECT, 500_000)
    writing, release = threading.Event(), threading.Event()
    real_write = journal._write_sync

    def slow_write(path: Path, data: bytes) -> None:
        writing.set()
        release.wait(5)
        real_write(path, data)

    journal._write_sync = slow_write  # type: ignore[method-assign]
    sealing = asyncio.ensure_future(journal.seal())
    await asyncio.to_thread(writing.wait, 5)
    journal.append(late, KEY, SUBJECT, 250_000)  # arrives while the sealed segment is written
    release.set()
    sealed = await sealing
    journal._write_sync = real_write  # type: ignore[method-assign]
    assert sealed is not None and Journal.read(sealed) == [first] and sealed.lines == 1
    assert await journal.lines_of(sealed) == [first]  # what ships is what the file holds
    assert await journal.commit() == 1  # the late event, in a segment of its own
    following = await journal.seal()
    assert following is not None and Journal.read(following) == [late] and following.lines == 1
    assert await journal.lines_of(following) == [late]
    assert journal.unshipped_spend() == ({KEY: 750_000}, {SUBJECT: 750_000})
    journal.close()


async def test_a_failed_seal_keeps_every_event_for_the_next_try(tmp_path: Path) -> None:
    journal = Journal.open(tmp_path)
    first, late = line(1), line(2)
    journal.append(first, KEY, SUBJECT, 500_000)
    writing, release = threading.Event(), threading.Event()
    real_write = journal._write_sync

    def failing_write(path: Path, data: bytes) -> None:
        writing.set()
        release.wait(5)
        raise OSError(28, "No space left on device")

    journal._write_sync = failing_write  # type: ignore[method-assign]
    sealing = asyncio.ensure_future(journal.seal())
    await asyncio.to_thread(writing.wait, 5)
    journal.append(late, KEY, SUBJECT, 250_000)
    release.set()
    try:
        await sealing
        raise AssertionError("the disk error must reach the caller")
    except OSError:
        pass
    journal._write_sync = real_write  # type: ignore[method-assign]
    assert journal.buffered == 2 and journal.pending_events == 2
    sealed = await journal.seal()
    assert sealed is not None and Journal.read(sealed) == [first, late] and sealed.lines == 2
    assert await journal.lines_of(sealed) == [first, late]
    assert journal.unshipped_spend() == ({KEY: 750_000}, {SUBJECT: 750_000})
    journal.close()


async def test_segments_written_here_ship_from_memory_and_recovered_ones_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal.open(tmp_path)
    written = [line(i) for i in range(4)]
    for raw in written:
        journal.append(raw, KEY, SUBJECT, 1)
    sealed = await journal.seal()
    assert sealed is not None

    def no_read(segment: object) -> list[bytes]:
        raise AssertionError("a segment this process wrote is shipped from memory, not read back")

    monkeypatch.setattr(Journal, "read", staticmethod(no_read))
    assert await journal.lines_of(sealed) == written
    await journal.discard_soon(sealed)
    assert not sealed.path.exists() and journal.pending_events == 0 and journal._kept_bytes == 0
    monkeypatch.undo()
    journal.append(line(9), KEY, SUBJECT, 1)
    await journal.commit()
    crash(journal)
    reopened = Journal.open(tmp_path)  # a previous run's segment: only its file knows its lines
    [left] = reopened.sealed()
    assert left.kept is None and [orjson.loads(x)["n"] for x in await reopened.lines_of(left)] == [9]
    reopened.close()


async def test_kept_lines_hold_their_own_length_not_orjsons_buffer(tmp_path: Path) -> None:
    """orjson's output keeps the 8 KiB buffer it was written into, whatever its length; the
    lines kept for shipping (a whole ship interval of them) are copies of their own size."""
    import tracemalloc

    journal = Journal.open(tmp_path)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            journal.append(line(i), KEY, SUBJECT, 1)  # the caller's line is dropped at once
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    sealed = await journal.seal()
    assert sealed is not None and sealed.kept is not None
    kept = await journal.lines_of(sealed)
    assert [orjson.loads(raw)["n"] for raw in kept] == list(range(200))
    assert kept == sealed.path.read_bytes().splitlines(keepends=True)  # the file's bytes
    size = sum(len(raw) for raw in kept)
    assert held < 2 * size + 64 * 1024  # orjson's own buffers: about 200 x 8 KiB (1.6 MB)
    journal.close()


async def test_lines_past_the_memory_bound_are_shipped_from_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.billing.journal as journal_module

    lines = [line(i) for i in range(10)]
    monkeypatch.setattr(journal_module, "MAX_KEPT_BYTES", len(lines[0]) * 6)
    journal = Journal.open(tmp_path)
    for raw in lines[:5]:
        journal.append(raw, KEY, SUBJECT, 1)
    first = await journal.seal()
    for raw in lines[5:]:
        journal.append(raw, KEY, SUBJECT, 1)  # past the bound: this segment keeps nothing
    second = await journal.seal()
    assert first is not None and second is not None
    assert first.kept is not None and second.kept is None
    assert await journal.lines_of(first) == lines[:5] and await journal.lines_of(second) == lines[5:]
    await journal.discard_soon(first)
    await journal.discard_soon(second)
    assert journal._kept_bytes == 0 and journal.pending_events == 0
    journal.close()


async def test_an_appended_event_is_in_the_file_before_append_returns(tmp_path: Path) -> None:
    """A usage event is written into the segment at once (no await, no commit), so a
    SIGKILL right after the client got its answer cannot lose it; the commit fsyncs it."""
    journal = Journal.open(tmp_path)
    raw = line(1)
    journal.append(raw, KEY, SUBJECT, 500_000)
    assert journal._active is not None and journal._active.path.read_bytes() == raw
    assert journal.buffered == 1  # written, not yet fsync'd
    assert await journal.commit() == 1 and journal.buffered == 0
    journal.close()


async def test_a_refused_write_keeps_the_event_in_memory_until_a_commit_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal.open(tmp_path)
    lines = [line(n) for n in range(1, 5)]
    journal.append(lines[0], KEY, SUBJECT, 500_000)
    real_write = os.write

    def disk_full(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    journal.append(lines[1], KEY, SUBJECT, 250_000)
    journal.append(lines[2], KEY, SUBJECT, 250_000)  # behind the buffered one, never before it
    assert journal._active is not None and journal._active.path.read_bytes() == lines[0]
    assert journal.buffered == 3 and journal.pending_events == 3
    monkeypatch.setattr(os, "write", real_write)
    assert await journal.commit() == 3
    segment = await journal.seal()
    assert segment is not None and Journal.read(segment) == lines[:3]
    journal.append(lines[3], KEY, SUBJECT, 0)  # the next segment is written through again
    assert journal._active is not None and journal._active.path.read_bytes() == lines[3]
    journal.close()


async def _ship_nowhere(_conn: object, lines: list[bytes]) -> int:
    raise AssertionError("this test commits only")


async def test_group_commit_fsyncs_at_most_once_per_window_and_catches_up(tmp_path: Path) -> None:
    """One fsync per window whatever the rate (each wakes a worker thread that takes the
    loop's CPU from it), and nothing written stays unsynced past the window's end."""
    journal = Journal.open(tmp_path)
    window = 0.05
    shipper = JournalShipper(
        None, _ship_nowhere, batches=lambda lines: [lines],  # type: ignore[arg-type]  # commits use no pool
        ship_timeout=1.0, fsync_interval=window, log=logging.getLogger("test"), name="test", store="nowhere",
    )
    shipper.journal = journal
    committer = asyncio.create_task(shipper.commit_forever())
    loop = asyncio.get_running_loop()
    started, appended = loop.time(), 0
    while loop.time() - started < 0.4:
        journal.append(line(appended), KEY, SUBJECT, 1)
        appended += 1
        await asyncio.sleep(0.002)
    elapsed = loop.time() - started
    assert appended >= 50
    assert 1 <= journal.commits <= elapsed / window + 2  # one per window, not one per line
    # The last lines are synced by a later round without another append (a slow disk's
    # fsync may take longer than the window, so this waits for it rather than a set time).
    for _ in range(500):
        if journal._unsynced == 0 and journal.buffered == 0:
            break
        await asyncio.sleep(0.01)
    assert journal._unsynced == 0 and journal.buffered == 0
    shipper.stopping = True
    journal.wake()
    await asyncio.wait_for(committer, 5)
    journal.close()
