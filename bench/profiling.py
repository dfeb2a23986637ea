"""A sampling profile of the gateway's hot path, taken with py-spy under S1's load.

py-spy attaches to the running gateway from outside (``--nonblocking``: the gateway is
never paused), samples its Python stacks and writes them collapsed, one stack per line.
:func:`summarize` turns that into what the report shows: where the samples land by
area (our code, aiohttp, the event loop, JSON...), the hottest functions by self time,
and our own functions by inclusive time.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["find_py_spy", "record", "summarize"]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def find_py_spy() -> str | None:
    """py-spy next to this interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


async def record(pid: int, seconds: float, output: Path, *, cpu: int | None) -> str | None:
    """Sample ``pid`` for ``seconds`` into ``output`` (collapsed stacks); an error or None."""
    exe = find_py_spy()
    if exe is None:
        return "py-spy is not installed (pip install py-spy)"
    argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "250",
            "--format", "raw", "--nonblocking", "--output", str(output)]
    if cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0 or not output.exists():
        return f"py-spy failed ({proc.returncode}): {out.decode(errors='replace').strip()[-300:]}"
    return None


#: Frames that only start the process: present in every stack that reaches them.
_ROOTS = ("gateway/__main__.py", "gateway/cli.py", "gateway/edge/server.py")


#: Python frames under which only the C event loop runs (asyncio.Runner, aiohttp's run_app).
_LOOP_RUNNERS = frozenset({"run", "run_app", "run_until_complete", "run_forever"})


#: Leaf frames (function, file) of a thread blocked in a call that releases the GIL:
#: py-spy's ``--nonblocking`` sampling counts them as running, but they use no CPU. The
#: thread pool waiting for work, the log writer waiting for records, the journal's
#: worker in ``write``/``fsync`` (waiting on the disk: its kernel time is small).
#: Matched on the function's own name (py-spy spells it ``QueueListener.dequeue`` or
#: ``dequeue`` depending on its version).
_BLOCKED = frozenset({
    ("_worker", "concurrent/futures/thread.py"),
    ("dequeue", "logging/handlers.py"),
    ("_write_sync", "gateway/billing/journal.py"),
    ("_fsync_sync", "gateway/billing/journal.py"),
    ("_fsync_dir", "gateway/billing/journal.py"),
})

#: Leaf frames that are such a blocked call when a thread pool's worker runs them: the
#: journal's unlink of a shipped segment (``Journal.discard_soon``) waits on the file
#: system's journal behind the fsyncs. Counted, it read as 19 µs of CPU per S1 request
#: ("pathlib") where ``bench.threads`` measured 1.3-1.9 µs for each journal thread. On
#: the loop's own thread the same call is the loop's time, and counts.
_BLOCKED_IN_POOL = frozenset({("unlink", "pathlib.py")})
_POOL_WORKER = ("_worker", "concurrent/futures/thread.py")


def _short(path: str) -> str:
    """``aiohttp/client.py`` from however py-spy spelled the file."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "/lib/python3" in path:
        return path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    for ours in ("/gateway/", "/actors/", "/bench/"):
        if ours in path:
            return ours.strip("/") + "/" + path.split(ours, 1)[1]
    return path


def _area(func: str, path: str) -> str:
    top = path.split("/", 1)[0] if "/" in path else path.rsplit(".", 1)[0]
    if top in ("gateway", "actors"):
        return f"{top} (ours)"
    if func.rpartition(".")[2] in _LOOP_RUNNERS:
        # The leaf is what runs the loop: uvloop's C code, polling and socket I/O.
        return "event loop and socket I/O (uvloop, C)"
    if top == "bench":
        return "bare relay's handler"
    if top in ("multidict", "yarl", "propcache", "frozenlist", "aiosignal"):
        return "aiohttp"
    return top or "other"


def _parse(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip(), ""
    return m.group("func"), m.group("file")


def _in_pool_worker(frames: list[tuple[str, str]]) -> bool:
    """Whether a stack is a thread pool worker's (``ThreadPoolExecutor``)."""
    return any((func.rpartition(".")[2], _short(path)) == _POOL_WORKER for func, path in frames)


def summarize(collapsed: Path, top: int = 15) -> dict[str, Any]:
    """Areas, hottest functions (self) and our functions (inclusive), as sample shares.

    Samples of a thread blocked in a GIL-releasing call (:data:`_BLOCKED`) are set aside
    (``blocked_share``, of all samples): counted, they made waiting threads look like
    the largest consumers of CPU (a quarter of the gateway's samples in S1).
    """
    total = 0
    blocked = 0
    self_time: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_parse(f) for f in stack.split(";") if f]
        if not frames:
            continue
        func, path = frames[-1]
        leaf = (func.rpartition(".")[2], _short(path))
        if leaf in _BLOCKED or (leaf in _BLOCKED_IN_POOL and _in_pool_worker(frames)):
            blocked += count
            continue
        total += count
        self_time[f"{func} ({_short(path)})"] += count
        areas[_area(func, _short(path))] += count
        seen: set[str] = set()
        for func, path in frames:
            short = _short(path)
            if _area(func, short).endswith("(ours)") and short not in _ROOTS:
                seen.add(f"{func} ({short})")
        for name in seen:
            inclusive[name] += count
    if not total:
        return {"samples": 0}

    def share(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(name, round(100 * c / total, 1)) for name, c in counter.most_common(n)]

    return {
        "samples": total,
        "blocked_share": round(100 * blocked / (total + blocked), 1),
        "areas": share(areas, 20),
        "self": share(self_time, top),
        "ours_inclusive": share(inclusive, top),
    }
