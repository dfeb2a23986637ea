"""Python bytecode instructions per request, the gateway's against the bare relay's: a
measure of the features' cost that a noisy machine does not move.

    python -m bench.opcodes [--stream [--chunks N]] [--concurrency N] [--seconds S] [--top K] [--json PATH] \\
        [--lines TEXT] [--variant NAME=TREE[:VAR=VALUE,...] | --variant NAME=bare ...]
    (default: --variant bare=bare --variant gateway=.)

CPU figures on a small shared machine move by ±10 % between runs, so a change worth 3 %
cannot be seen in them. This drives S1's load (or S3's streams with ``--stream``) at each
variant in turn, as ``python -m bench.server_cpu`` does, and counts the bytecode
instructions the server's event-loop thread executes per request, by function, with
``sys.settrace`` (``bench/opcount/sitecustomize.py``, put first on the server's
``PYTHONPATH``, switched on and off by SIGUSR1 and SIGUSR2 after a warm-up). The count of
a request's path is the same in every run: two runs agree to within the requests caught
half-way at the window's ends.

What it does not see: work in C (JSON, hashing, uvloop, the kernel's socket calls) and
other threads. On this machine the gateway's instructions over the bare relay's tracked
its CPU ratio (2.35 times against 2.39 times at the ninth pass). Tracing slows the server about
20 times, so a window of a few seconds holds a few hundred requests; the per-request figure
divides by the requests the server started in the window (aiohttp's ``BaseRequest``).

Tracing slows a server so much that S3's 64 streams saturate it: its reads then find
several events waiting and take them at once, as the untraced server, idle most of the
time under S3, never does. ``--concurrency 4`` (a few streams, the traced server mostly
idle) counts what each event costs when it is read on its own, as S3's are; the
request's own share of a stream is then larger, the process's background (shipping,
journal commits) spread over fewer streams.

Examples::

    python -m bench.opcodes                                  # bare relay and this tree, S1
    python -m bench.opcodes --stream --concurrency 4         # each event read on its own
    python -m bench.opcodes --stream --chunks 2 --top 40
    git worktree add /tmp/before HEAD~1
    python -m bench.opcodes --variant before=/tmp/before --variant after=.
    python -m bench.opcodes --variant gateway=. --lines gateway/edge/dispatch.py  # where a function's count goes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.driver import closed_loop
from bench.server_cpu import Variant, add_variant_options, chosen_variants, load_profile, variant_load
from bench.stack import REPO, Stack, StackOptions

__all__ = ["Counts", "main", "measure"]

TRACER_DIR = Path(__file__).resolve().parent / "opcount"

#: The function aiohttp runs once for every request it starts (``BaseRequest.__init__``).
_REQUEST_MARK = ("aiohttp/web_request.py", "__init__")

#: Where a function's file says it belongs, first match wins (for the table by area).
_AREAS = (
    ("gateway/", "gateway"), ("actors/", "actors"), ("aiohttp/", "aiohttp"), ("asyncio/", "asyncio"),
    ("bench/bare_relay.py", "bare relay"), ("<string>", "generated (dataclasses)"), ("asyncpg/", "asyncpg"),
    ("logging/", "logging"), ("multidict/", "multidict"), ("yarl/", "yarl"),
)


@dataclass
class Counts:
    """One variant's counts in one window."""

    name: str
    requests: int
    #: (short file, function, first line) → [instructions, calls]
    functions: dict[tuple[str, str, int], list[int]]
    #: With ``--lines``: (short file, function, line) → instructions, for the files it names.
    lines: dict[tuple[str, str, int], int] = field(default_factory=dict)

    @property
    def instructions(self) -> int:
        return sum(v[0] for v in self.functions.values())

    @property
    def calls(self) -> int:
        return sum(v[1] for v in self.functions.values())

    def per_request(self, value: int) -> float:
        return value / self.requests

    def areas(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (path, _func, _line), (instructions, _calls) in self.functions.items():
            out[_area(path)] += instructions / self.requests
        return dict(out)


def _short(path: str, tree: Path = REPO) -> str:
    for cut in ("site-packages/", "/lib/python3", str(tree) + "/", str(REPO) + "/"):
        if cut in path:
            tail = path.split(cut, 1)[1]
            return tail.split("/", 1)[1] if cut == "/lib/python3" and "/" in tail else tail
    return path


def _area(path: str) -> str:
    for marker, name in _AREAS:
        if marker in path:
            return name
    return "other (standard library)"


async def measure(variant: Variant, *, stream: bool, chunks: int, seconds: float, concurrency: int | None = None,
                  lines_of: str | None = None) -> Counts:
    """Warm the server up, then count its instructions over ``seconds`` of load (and, for
    the files whose path holds ``lines_of``, line by line)."""
    profile = load_profile(stream, chunks)
    with tempfile.TemporaryDirectory(prefix="bench-opcodes-") as scratch:
        out = Path(scratch) / "counts.json"
        tree = REPO if variant.bare else variant.repo
        env = {**variant.env, "BENCH_OPCOUNT_FILE": str(out), **({"BENCH_OPCOUNT_LINES": lines_of} if lines_of else {}),
               "PYTHONPATH": os.pathsep.join([str(TRACER_DIR), str(tree), os.environ.get("PYTHONPATH", "")])}
        options = StackOptions(profiles=(profile,), bare=variant.bare, gateway_env=env, repo=variant.repo,
                               bare_env=env if variant.bare else {})
        async with Stack(options) as stack:
            call, pid = variant_load(stack, variant, profile, stream=stream, chunks=chunks)
            concurrency = concurrency or (64 if stream else 32)
            await closed_loop(lambda _i: call, concurrency=concurrency, duration=2.0, warmup=0.5)
            os.kill(pid, signal.SIGUSR1)
            result = await closed_loop(lambda _i: call, concurrency=concurrency, duration=seconds, warmup=0.0)
            os.kill(pid, signal.SIGUSR2)
            for _ in range(100):
                if out.exists():
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"{variant.name}: the server wrote no counts (is SIGUSR1 free?)")
            rows = json.loads(out.read_text(encoding="utf-8"))
    if not result.ok:
        raise RuntimeError(f"{variant.name}: no request succeeded ({dict(result.errors)})")
    functions: dict[tuple[str, str, int], list[int]] = {}
    by_line: dict[tuple[str, str, int], int] = {}
    for path, func, line, instructions, calls, *at in rows:
        if at:  # a line of a function --lines asked for
            line_key = (_short(path, tree), func, at[0])
            by_line[line_key] = by_line.get(line_key, 0) + instructions
            continue
        key = (_short(path, tree), func, line)
        have = functions.setdefault(key, [0, 0])
        have[0] += instructions
        have[1] += calls
    requests = sum(calls for (path, func, _), (_, calls) in functions.items() if (path, func) == _REQUEST_MARK)
    if requests == 0:
        raise RuntimeError(f"{variant.name}: no request started in the counting window")
    return Counts(variant.name, requests, functions, by_line)


def report(counts: list[Counts], top: int) -> str:
    """The table: instructions and calls per request, by area and by function."""
    base = counts[0]
    lines = ["| variant | requests counted | instructions per request | Python calls per request | vs first |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for c in counts:
        ratio = c.per_request(c.instructions) / base.per_request(base.instructions)
        lines.append(f"| {c.name} | {c.requests:,} | {c.per_request(c.instructions):,.0f} | "
                     f"{c.per_request(c.calls):,.0f} | {ratio:.2f}× |")
    areas = sorted({a for c in counts for a in c.areas()}, key=lambda a: -max(c.areas().get(a, 0) for c in counts))
    lines += ["", "| area (instructions per request) | " + " | ".join(c.name for c in counts) + " |",
              "| --- |" + " ---: |" * len(counts)]
    for area in areas:
        lines.append(f"| {area} | " + " | ".join(f"{c.areas().get(area, 0):,.0f}" for c in counts) + " |")
    last = counts[-1]
    lines += ["", f"Functions by instructions per request in {last.name} (calls per request in brackets):", "",
              "| function | " + " | ".join(c.name for c in counts) + " |", "| --- |" + " ---: |" * len(counts)]
    ranked = sorted(last.functions.items(), key=lambda kv: -kv[1][0])[:top]
    for key, _ in ranked:
        cells = []
        for c in counts:
            have = c.functions.get(key)
            cells.append(f"{have[0] / c.requests:,.1f} ({have[1] / c.requests:.2f})" if have else "—")
        lines.append(f"| `{key[0]}:{key[1]}` (line {key[2]}) | " + " | ".join(cells) + " |")
    if any(c.lines for c in counts):
        lines += ["", f"Lines by instructions per request in {last.name}:", "",
                  "| line | " + " | ".join(c.name for c in counts) + " |", "| --- |" + " ---: |" * len(counts)]
        for key, _ in sorted(last.lines.items(), key=lambda kv: -kv[1])[:top]:
            cells = [f"{c.lines[key] / c.requests:,.1f}" if key in c.lines else "—" for c in counts]
            lines.append(f"| `{key[0]}:{key[2]}` ({key[1]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> list[Counts]:
    parser = argparse.ArgumentParser(prog="python -m bench.opcodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_options(parser, seconds=4.0, per_variant="counted")
    parser.add_argument("--concurrency", type=int,
                        help="clients at once (default 64 streams, 32 whole calls; a few: each event read alone)")
    parser.add_argument("--top", type=int, default=40, help="functions listed (default 40)")
    parser.add_argument("--json", type=Path, help="also write every count here")
    parser.add_argument("--lines", metavar="TEXT",
                        help="also count line by line the files whose path holds TEXT "
                             "(e.g. gateway/edge/dispatch.py), and list their costliest lines")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args)
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency takes at least 1")
    counts = [await measure(v, stream=args.stream, chunks=args.chunks, seconds=max(1.0, args.seconds),
                                  concurrency=args.concurrency, lines_of=args.lines)
              for v in variants]
    print(report(counts, args.top), flush=True)
    if args.json:
        args.json.write_text(json.dumps([
            {"name": c.name, "requests": c.requests,
             "functions": [[*k, *v] for k, v in sorted(c.functions.items(), key=lambda kv: -kv[1][0])],
             "lines": [[*k, v] for k, v in sorted(c.lines.items(), key=lambda kv: -kv[1])]}
            for c in counts], indent=1), encoding="utf-8")
    return counts


if __name__ == "__main__":
    asyncio.run(main())
