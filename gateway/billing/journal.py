"""The billing journal: usage events on local disk until the ledger has them.

Layout under the journal root (``BILLING_JOURNAL_DIR``, default
``$LLM_GATEWAY_HOME/billing-journal``)::

    <ledger_id>/slot-<n>/lock                       flock'd by the process using the slot
    <ledger_id>/slot-<n>/segment-000000000007.jsonl one JSON line per event
    <ledger_id>/slot-<n>/rejected.jsonl             lines the ledger refused (kept, logged)

* An event is written to the active segment the moment it is appended: one ``write``
  into the kernel's page cache (microseconds, no wait on the disk), so a process that
  dies right after, even by SIGKILL, has left it in the file. :meth:`Journal.commit`
  then makes it survive a power cut too: one ``fsync`` for everything written since the
  last one, in a worker thread so the event loop never waits on the disk (one of
  :data:`JOURNAL_IO`, whose wake-ups do not preempt the loop).
* While a worker thread writes (a seal, or a retry after a disk error) events are
  buffered in memory instead and written by the next commit, so a failed write can be
  cut back to the file's last good end without cutting anybody else's line.
* The active segment is sealed by :meth:`Journal.seal` before shipping; a sealed segment
  is deleted (:meth:`Journal.discard`) only after the ledger committed every line of it.
  Shipping a segment twice is harmless (the ledger ignores known ``call_id``\\ s).
* Each process locks one slot (``flock``, released by the kernel even on SIGKILL), so
  replicas sharing a data directory never touch each other's files. On open, segments
  left in slots nobody holds (a crashed process) are moved into the opener's slot and
  shipped with its own.
* Slots are filed under the ledger's id (:func:`gateway.billing.ledger.fetch_ledger_id`), so a
  journal written for one database is never shipped into another.
* A torn last line (a crash in the middle of a write that was never fsync'd) is
  skipped; a write that fails half-way is cut back, so a retry never glues two lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gateway.billing.reservations import micro_usd
from gateway.core.threads import BackgroundPool

__all__ = ["Journal", "JournalBusy", "Segment"]

log = logging.getLogger("gateway.billing")

#: Lines of unshipped segments kept in memory at most (beyond, they are read back from
#: disk to be shipped): a long ledger outage must not grow the heap without bound.
MAX_KEPT_BYTES = 16 * 1024 * 1024
_SEGMENT_GLOB = "segment-*.jsonl"
_LOCK_NAME = "lock"
_REJECTED_NAME = "rejected.jsonl"
#: Enough for every replica one host will ever run; a bound so a bug cannot loop forever.
MAX_SLOTS = 256
#: The journals' writes, fsyncs, reads and unlinks (every journal of the process): threads
#: whose wake-ups do not preempt the event loop (gateway/core/threads.py).
JOURNAL_IO = BackgroundPool("journal-io", workers=2)


class JournalBusy(OSError):
    """Every journal slot is locked by another live process."""


@dataclass(slots=True)
class Segment:
    """One journal file: how many events it holds and what they cost, per key and subject."""

    path: Path
    lines: int = 0
    #: Integer micro-USD (exact sums, see gateway/billing/reservations.py).
    key_spend: dict[uuid.UUID, int] = field(default_factory=dict)
    subject_spend: dict[uuid.UUID, int] = field(default_factory=dict)
    #: The lines as this process wrote them, for shipping without reading the file back;
    #: None for a segment found on disk, or once the journal's memory bound was reached.
    kept: list[bytes] | None = None
    kept_bytes: int = 0

    def add_spend(self, api_key_id: uuid.UUID, subject_id: uuid.UUID, cost_micro_usd: int) -> None:
        if cost_micro_usd > 0:
            self.key_spend[api_key_id] = self.key_spend.get(api_key_id, 0) + cost_micro_usd
            self.subject_spend[subject_id] = self.subject_spend.get(subject_id, 0) + cost_micro_usd


def _segment_name(seq: int) -> str:
    return f"segment-{seq:012d}.jsonl"


def _segment_seq(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _fsync_dir(directory: Path) -> None:
    """Make a create, rename or unlink in ``directory`` survive a power cut."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scan(path: Path) -> tuple[list[bytes], list[bytes], bool]:
    """A segment's valid lines, its unreadable ones, and whether its tail was torn."""
    good: list[bytes] = []
    bad: list[bytes] = []
    torn = False
    data = path.read_bytes()
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            # A write cut short by a crash; it was never fsync'd, so never acknowledged.
            log.warning("billing journal %s: skipping a torn last line (%d bytes)", path.name, len(raw))
            torn = True
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            bad.append(raw)
            continue
        (good if isinstance(obj, dict) and "call_id" in obj else bad).append(raw)
    return good, bad, torn


def _spend_of(lines: list[bytes], segment: Segment) -> None:
    for raw in lines:
        obj = orjson.loads(raw)
        try:
            segment.add_spend(
                uuid.UUID(obj["api_key_id"]), uuid.UUID(obj["subject_id"]), micro_usd(obj.get("cost_usd") or 0)
            )
        except (KeyError, TypeError, ValueError):
            continue


class Journal:
    """One process's journal slot. Not thread-safe: used from one event loop only.

    Lifecycle: :meth:`open` (locks a slot, adopts orphans, recovers leftovers) →
    ``append``/``commit``/``seal``/``read``/``discard`` → :meth:`close` (releases the
    slot). After close, a late :meth:`append` is written and fsync'd at once into its
    own segment, so even an event that arrives during shutdown is not lost.
    """

    def __init__(self, directory: Path, lock_fd: int, sealed: list[Segment], next_seq: int) -> None:
        self.directory = directory
        self._lock_fd: int | None = lock_fd
        self._sealed: list[Segment] = sealed
        self._next_seq = next_seq
        self._active: Segment | None = None
        self._fd: int | None = None
        self._size = 0
        self._buffer: list[bytes] = []
        #: Lines written straight into the active segment and not yet fsync'd; whether its
        #: directory entry is (a segment file the event loop created).
        self._unsynced = 0
        self._dir_unsynced = False
        #: A worker thread is writing buffered lines: appends buffer rather than write.
        self._thread_writes = False
        self._io_lock = asyncio.Lock()
        self._has_data = asyncio.Event()
        self.commits = 0
        self.rejected = 0
        #: Bytes of lines kept in memory across the active and sealed segments.
        self._kept_bytes = 0

    # -- opening -----------------------------------------------------------------------
    @classmethod
    def open(cls, root: Path) -> Journal:
        """Lock a free slot under ``root``, adopt orphaned segments, recover leftovers.

        Blocking file I/O: call it in a worker thread. Raises JournalBusy when every
        slot is held, OSError when the directory cannot be used.
        """
        root.mkdir(parents=True, exist_ok=True)
        mine: Path | None = None
        lock_fd: int | None = None
        for n in range(MAX_SLOTS):
            slot = root / f"slot-{n}"
            slot.mkdir(exist_ok=True)
            lock_fd = _try_lock(slot / _LOCK_NAME)
            if lock_fd is not None:
                mine = slot
                break
        if mine is None or lock_fd is None:
            raise JournalBusy(f"all {MAX_SLOTS} billing journal slots under {root} are in use")
        try:
            existing = sorted(mine.glob(_SEGMENT_GLOB), key=_segment_seq)
            next_seq = max((_segment_seq(p) for p in existing), default=0) + 1
            adopted, next_seq = cls._adopt_orphans(root, mine, next_seq)
            sealed: list[Segment] = []
            for path in [*existing, *adopted]:
                good, bad, torn = _scan(path)
                if bad:
                    cls._write_rejected(mine, bad)
                    log.error("billing journal %s: %d unreadable line(s) set aside", path, len(bad))
                if not good:
                    path.unlink()
                    continue
                if bad or torn:
                    # Rewrite without the bad lines so shipping never meets them again.
                    path.write_bytes(b"".join(good))
                segment = Segment(path, lines=len(good))
                _spend_of(good, segment)
                sealed.append(segment)
        except BaseException:
            os.close(lock_fd)
            raise
        if sealed:
            log.info(
                "billing journal %s: %d event(s) left from a previous run, shipping them",
                mine, sum(s.lines for s in sealed),
            )
        return cls(mine, lock_fd, sealed, next_seq)

    @staticmethod
    def _adopt_orphans(root: Path, mine: Path, next_seq: int) -> tuple[list[Path], int]:
        """Move segments out of slots no live process holds; returns them, in order."""
        adopted: list[Path] = []
        for slot in sorted(root.glob("slot-*")):
            if slot == mine or not slot.is_dir():
                continue
            fd = _try_lock(slot / _LOCK_NAME)
            if fd is None:
                continue  # a live replica owns it
            try:
                for path in sorted(slot.glob(_SEGMENT_GLOB), key=_segment_seq):
                    target = mine / _segment_name(next_seq)
                    next_seq += 1
                    os.rename(path, target)
                    adopted.append(target)
                if adopted:
                    _fsync_dir(slot)
            finally:
                os.close(fd)
        if adopted:
            _fsync_dir(mine)
            log.info("billing journal: adopted %d segment(s) from stopped replicas", len(adopted))
        return adopted, next_seq

    # -- appending and committing --------------------------------------------------------
    def append(self, line: bytes, api_key_id: uuid.UUID, subject_id: uuid.UUID, cost_micro_usd: int) -> int:
        """Write one event line into the active segment (the page cache: it outlives the
        process from here on); :meth:`commit` fsyncs it. Never waits on the disk: while a
        worker thread writes, or after a failed write, the line is buffered instead.
        Returns :attr:`active_lines` (the caller's cue to ship, without a property's call)."""
        if self._lock_fd is None:
            self._append_after_close(line)
            return self.active_lines
        active = self._active
        if active is None:
            active = self._active = Segment(self.directory / _segment_name(self._next_seq), kept=[])
            self._next_seq += 1
        active.lines += 1
        active.add_spend(api_key_id, subject_id, cost_micro_usd)
        # The line kept with its segment for shipping, within MAX_KEPT_BYTES. Shipping a
        # segment used to read it back in a worker thread and parse every line again,
        # holding the GIL (and so the event loop) for a few µs per line; the lines are the
        # ones written here, so the copy in memory is the file's content. Past the bound
        # the segment drops its copy and is read from disk like a recovered one.
        kept = active.kept
        if kept is not None:
            size = len(line)
            if self._kept_bytes + size > MAX_KEPT_BYTES:
                self._kept_bytes -= active.kept_bytes
                active.kept, active.kept_bytes = None, 0
            else:
                # A copy of its own length: orjson's output keeps the 8 KiB buffer it was
                # written into (a 635-byte ledger line held 8,160 bytes), and kept lines
                # wait for a ship (a second's calls at 2,500 a second: 20 MB, not 1.6).
                kept.append(bytes(memoryview(line)))
                active.kept_bytes += size
                self._kept_bytes += size
        if self._buffer or self._thread_writes or not self._write_through(active.path, line):
            self._buffer.append(line)
        self._has_data.set()
        return active.lines

    def _write_through(self, path: Path, line: bytes) -> bool:
        """Write ``line`` at the end of the active segment on the event loop's thread; False
        (the file cut back to its last good end) when the disk refuses it."""
        try:
            if self._fd is None:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._size = 0
                self._dir_unsynced = True
            written = os.write(self._fd, line)
        except OSError as exc:
            log.warning("billing journal: write failed (%s); events wait in memory for the next commit", exc)
            written = -1
        if written == len(line):
            self._size += written
            self._unsynced += 1
            return True
        if self._fd is not None and written > 0:  # a short write (disk full): never leave half a line
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
        return False

    async def wait_for_data(self) -> None:
        """Return when something is buffered and not yet committed (or on :meth:`wake`)."""
        await self._has_data.wait()

    def wake(self) -> None:
        """Release :meth:`wait_for_data` once even with nothing buffered (to stop a committer)."""
        self._has_data.set()

    @property
    def unshipped(self) -> bool:
        """Whether a line waits to be shipped: the active segment's, or a sealed one's."""
        return self._active is not None or bool(self._sealed)

    async def wait_for_lines(self) -> None:
        """Return at once if a line waits to be shipped, else when one is appended (or on
        :meth:`wake`): a shipper with nothing to ship sleeps instead of waking on a timer.
        The append that wakes it also wakes the committer, which may clear the event
        first: this waiter was released all the same."""
        if not self.unshipped:
            await self._has_data.wait()

    async def commit(self) -> int:
        """Write and fsync everything buffered, in a worker thread; returns the count.

        On a disk error the lines stay buffered (and the file is cut back to its last
        good end), so the next commit retries them. Must not be cancelled while the
        thread writes: callers stop the committer by asking it, never by cancelling.
        """
        async with self._io_lock:
            return await self._commit_locked()

    async def _commit_locked(self) -> int:
        count = len(self._buffer)
        if count == 0:
            return await self._sync_written()
        assert self._active is not None
        data = b"".join(self._buffer)
        loop = asyncio.get_running_loop()
        synced, self._unsynced = self._unsynced, 0
        self._thread_writes = True
        try:
            await loop.run_in_executor(JOURNAL_IO.get(), self._write_sync, self._active.path, data)
        except BaseException:
            self._unsynced += synced
            raise
        finally:
            self._thread_writes = False
        del self._buffer[:count]
        if not self._buffer and not self._unsynced:
            self._has_data.clear()
        self.commits += 1
        return count + synced

    async def _sync_written(self) -> int:
        """fsync the lines written straight into the active segment. Appends go on
        writing meanwhile (an fsync and a write to one file do not conflict); those
        that land after the fsync began wait for the next commit."""
        synced = self._unsynced
        fd = self._fd
        if synced == 0 or fd is None:
            self._has_data.clear()
            return 0
        self._unsynced = 0
        self._has_data.clear()
        dir_unsynced, self._dir_unsynced = self._dir_unsynced, False
        try:
            await asyncio.get_running_loop().run_in_executor(JOURNAL_IO.get(), self._fsync_sync, fd, dir_unsynced)
        except BaseException:
            self._unsynced += synced
            self._dir_unsynced = self._dir_unsynced or dir_unsynced
            self._has_data.set()
            raise
        self.commits += 1
        return synced

    def _fsync_sync(self, fd: int, dir_too: bool) -> None:
        os.fsync(fd)
        if dir_too:
            _fsync_dir(self.directory)

    def _write_sync(self, path: Path, data: bytes) -> None:
        """Append ``data`` (possibly nothing) and fsync: the file and, when it is new or
        was created by a write-through, its directory entry."""
        if self._fd is None:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._size = 0
            self._dir_unsynced = True
        if self._dir_unsynced:
            _fsync_dir(self.directory)
            self._dir_unsynced = False
        fd = self._fd
        start = self._size
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
        self._size = start + len(data)

    async def seal(self) -> Segment | None:
        """Commit, then close the active segment so it can be shipped; None if empty.

        The segment is detached *before* its last lines are written: an event appended
        while the disk works (appends never wait) goes to a new segment, so the sealed
        one holds exactly the lines it counts. If the write fails, the segment is
        reattached (with whatever was appended meanwhile) and retried by the next commit.
        """
        async with self._io_lock:
            segment = self._active
            if segment is None:
                return None
            self._active = None
            count = len(self._buffer)
            synced, self._unsynced = self._unsynced, 0
            # Appends made while the thread works belong to the next segment: buffered,
            # since the open file is this one's.
            self._thread_writes = True
            try:
                if count or synced or self._dir_unsynced:
                    data = b"".join(self._buffer[:count])
                    await asyncio.get_running_loop().run_in_executor(JOURNAL_IO.get(), self._write_sync, segment.path, data)
                    del self._buffer[:count]
                    self.commits += 1
            except BaseException:
                self._unsynced += synced
                self._reattach(segment)
                raise
            finally:
                self._thread_writes = False
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._buffer:
                self._has_data.set()  # the next segment's first lines: the committer writes them
            else:
                self._has_data.clear()
            self._sealed.append(segment)
            return segment

    def _reattach(self, segment: Segment) -> None:
        """Make ``segment`` active again after a failed seal, absorbing any newer one
        (its lines are still buffered behind the segment's own, and not yet on disk)."""
        newer, self._active = self._active, segment
        if newer is not None:
            segment.lines += newer.lines
            if segment.kept is not None and newer.kept is not None:
                segment.kept += newer.kept
                segment.kept_bytes += newer.kept_bytes
            else:  # one of them was past the memory bound: the file is what ships
                self._kept_bytes -= segment.kept_bytes + newer.kept_bytes
                segment.kept, segment.kept_bytes = None, 0
            for k, v in newer.key_spend.items():
                segment.key_spend[k] = segment.key_spend.get(k, 0) + v
            for s, v in newer.subject_spend.items():
                segment.subject_spend[s] = segment.subject_spend.get(s, 0) + v

    # -- shipping ---------------------------------------------------------------------
    def sealed(self) -> list[Segment]:
        """Sealed segments not yet shipped, oldest first."""
        return list(self._sealed)

    @staticmethod
    def read(segment: Segment) -> list[bytes]:
        """A sealed segment's lines (blocking read: call it in a worker thread)."""
        return _scan(segment.path)[0]

    async def lines_of(self, segment: Segment) -> list[bytes]:
        """A sealed segment's lines: the ones kept in memory when this process wrote them,
        else read from its file in a worker thread. Raises FileNotFoundError if it is gone."""
        if segment.kept is not None:
            return segment.kept
        return await asyncio.get_running_loop().run_in_executor(JOURNAL_IO.get(), Journal.read, segment)

    def discard(self, segment: Segment) -> None:
        """Forget a segment the ledger has committed in full (unlinks its file)."""
        with contextlib.suppress(FileNotFoundError):
            segment.path.unlink()
        self._forget(segment)

    async def discard_soon(self, segment: Segment) -> None:
        """:meth:`discard`, with the unlink in a worker thread: a file system busy with a
        journal commit can hold an unlink for milliseconds, which must not be the loop's."""
        self._forget(segment)
        with contextlib.suppress(FileNotFoundError):
            await asyncio.get_running_loop().run_in_executor(JOURNAL_IO.get(), segment.path.unlink)

    def _forget(self, segment: Segment) -> None:
        if segment.kept is not None:
            self._kept_bytes -= segment.kept_bytes
            segment.kept, segment.kept_bytes = None, 0
        with contextlib.suppress(ValueError):
            self._sealed.remove(segment)

    def reject(self, lines: list[bytes]) -> None:
        """Set aside lines the ledger refuses, so they never block the ones after them."""
        self._write_rejected(self.directory, lines)
        self.rejected += len(lines)

    @staticmethod
    def _write_rejected(directory: Path, lines: list[bytes]) -> None:
        with (directory / _REJECTED_NAME).open("ab") as f:
            f.write(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())

    # -- state --------------------------------------------------------------------------
    @property
    def pending_events(self) -> int:
        """Events not yet in the ledger: buffered, in the active segment, or sealed."""
        active = self._active.lines if self._active is not None else 0
        return active + sum(s.lines for s in self._sealed)

    @property
    def buffered(self) -> int:
        """Events appended but not yet fsync'd (in memory, or written and awaiting fsync)."""
        return len(self._buffer) + self._unsynced

    @property
    def active_lines(self) -> int:
        return self._active.lines if self._active is not None else 0

    def unshipped_spend(self) -> tuple[dict[uuid.UUID, int], dict[uuid.UUID, int]]:
        """Micro-USD of every event not yet in the ledger, per key and per subject."""
        keys: dict[uuid.UUID, int] = {}
        subjects: dict[uuid.UUID, int] = {}
        segments = [*self._sealed, *([self._active] if self._active is not None else [])]
        for segment in segments:
            for k, v in segment.key_spend.items():
                keys[k] = keys.get(k, 0) + v
            for s, v in segment.subject_spend.items():
                subjects[s] = subjects.get(s, 0) + v
        return keys, subjects

    # -- closing ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    def close(self) -> None:
        """Release the slot. Anything still buffered is written and fsync'd first."""
        if self._lock_fd is None:
            return
        if (self._buffer or self._unsynced) and self._active is not None:
            try:
                self._write_sync(self._active.path, b"".join(self._buffer))
                self._buffer.clear()
                self._unsynced = 0
            except OSError as exc:
                log.error("billing journal: %d event(s) could not be written at close: %s", len(self._buffer), exc)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.close(self._lock_fd)
        self._lock_fd = None

    def _append_after_close(self, line: bytes) -> None:
        """A late event after close: its own segment, written and fsync'd right away."""
        path = self.directory / _segment_name(self._next_seq)
        self._next_seq += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.directory)
        log.warning("billing journal: event after shutdown kept in %s for the next start", path)
