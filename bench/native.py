"""Where a server's CPU goes below Python, per request: the gateway's against the bare relay's.

    python -m bench.native [--stream [--chunks N]] [--seconds S] [--top K] \\
        [--variant NAME=TREE[:VAR=VALUE,...] | --variant NAME=bare ...]
    (default: --variant bare=bare --variant gateway=.)

``python -m bench.opcodes`` counts the Python bytecode a request runs; this shows what
that Python costs in the machine, and what else the process spends: the interpreter's
eval loop, allocation and dict lookups, C extensions (orjson, uvloop, aiohttp's parser),
the kernel, and each thread's share. It drives S1's load (or S3's streams with
``--stream``) at each variant in turn, as ``python -m bench.server_cpu`` does, samples
the server with ``perf record -e cpu-clock`` over the measured seconds, and prints µs of
CPU per request by shared object, by thread, and by symbol (the symbols where the first
variant and the others differ most), each sample's share of the server's CPU in the same
window read from ``/proc``.

``cpu-clock`` is a software event, so it works in virtual machines without hardware
counters (``perf stat -e instructions`` says "not supported" on this one). Needs ``perf``
(Debian's ``linux-perf``) and, as a user other than root, ``kernel.perf_event_paranoid``
of 2 or lower; it says so and stops otherwise.

Examples::

    python -m bench.native                                  # bare relay and this tree, S1
    python -m bench.native --stream --top 30
    python -m bench.native --variant before=/tmp/before --variant after=.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.driver import closed_loop
from bench.server_cpu import Variant, add_variant_options, chosen_variants, load_profile, variant_load
from bench.stack import ProcWatch, Stack, StackOptions

__all__ = ["Samples", "main", "measure", "parse_report", "per_request", "report"]

#: Samples a second (a prime, so sampling does not beat with the load's own period).
FREQUENCY = 4999
_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S.*?)\s*$")


@dataclass
class Samples:
    """One variant's window: its requests, the server's CPU, and the shares perf saw."""

    name: str
    requests: int
    cpu_seconds: float
    #: Share (0..1) of the samples by shared object, by (shared object, symbol), by thread.
    by_dso: dict[str, float] = field(default_factory=dict)
    by_symbol: dict[tuple[str, str], float] = field(default_factory=dict)
    by_thread: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_per_request(self) -> float:
        """µs of the server's CPU per request (every thread's)."""
        return 1e6 * self.cpu_seconds / self.requests


def parse_report(text: str, columns: int) -> dict[tuple[str, ...], float]:
    """Shares (0..1) from ``perf report --stdio -g none`` sorted by ``columns`` keys: each
    line ``  12.34%  key1  key2...`` (comments and blanks skipped). A symbol keeps its
    ``[.]`` or ``[k]`` mark (user or kernel) so that the two never merge."""
    shares: dict[tuple[str, ...], float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        parts = m.group(2).split(None, columns - 1)
        if len(parts) < columns:
            continue
        shares[tuple(parts)] += float(m.group(1)) / 100
    return dict(shares)


def per_request(samples: Samples, share: float) -> float:
    """A share of the samples as µs of CPU per request."""
    return share * samples.cpu_per_request


def _perf_report(data: Path, sort: str) -> str:
    done = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio",
                           "-g", "none"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"perf report --sort {sort} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def perf_usable() -> str | None:
    """Why ``perf record -e cpu-clock`` cannot run here, or None if it can."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian: apt-get install linux-perf)"
    done = subprocess.run(["perf", "record", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"perf record -e cpu-clock fails here: {done.stderr.strip()[-300:]}"
    return None


async def measure(variant: Variant, *, stream: bool, chunks: int, seconds: float) -> Samples:
    """Warm the server up, then sample it over ``seconds`` of load."""
    profile = load_profile(stream, chunks)
    options = StackOptions(profiles=(profile,), bare=variant.bare, gateway_env=variant.env, repo=variant.repo)
    with tempfile.TemporaryDirectory(prefix="bench-native-") as scratch:
        data = Path(scratch) / "perf.data"
        async with Stack(options) as stack:
            call, pid = variant_load(stack, variant, profile, stream=stream, chunks=chunks)
            concurrency = 64 if stream else 32
            stagger = profile.stream_seconds if stream else 0.0  # S3's spread starts
            await closed_loop(lambda _i: call, concurrency=concurrency, duration=2.0, warmup=0.5, stagger=stagger)
            watch = ProcWatch(pid)
            recorder: list[subprocess.Popen[bytes]] = []
            async with watch.window() as window:

                def start() -> None:
                    # The perf window is the measured window: both start when the warm-up ends.
                    recorder.append(subprocess.Popen(
                        ["perf", "record", "-e", "cpu-clock", "-F", str(FREQUENCY), "-p", str(pid), "-o", str(data),
                         "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    watch.restart(window)

                result = await closed_loop(lambda _i: call, concurrency=concurrency, duration=seconds,
                                           warmup=0.5 + stagger, stagger=stagger, on_measure=start)
            for proc in recorder:
                await asyncio.to_thread(proc.wait, 30)
        if not result.ok:
            raise RuntimeError(f"{variant.name}: no request succeeded ({dict(result.errors)})")
        if not data.exists():
            raise RuntimeError(f"{variant.name}: perf recorded nothing")
        by_dso = {k[0]: v for k, v in parse_report(_perf_report(data, "dso"), 1).items()}
        by_symbol = {(k[0], k[1]): v for k, v in parse_report(_perf_report(data, "dso,sym"), 2).items()}
        by_thread = {k[0]: v for k, v in parse_report(_perf_report(data, "pid"), 1).items()}
    return Samples(variant.name, result.ok, window.cpu, by_dso, by_symbol, _threads_named(by_thread, pid))


def _threads_named(by_thread: dict[str, float], pid: int) -> dict[str, float]:
    """``5736:python`` as ``main`` (the event loop's thread: its id is the process's) or ``thread 5741``."""
    named: dict[str, float] = defaultdict(float)
    for key, share in by_thread.items():
        tid = key.split(":", 1)[0]
        named["main (event loop)" if tid == str(pid) else f"thread {tid}"] += share
    return dict(named)


def report(samples: list[Samples], top: int) -> str:
    """The tables: µs per request by shared object, by thread, and by symbol."""
    base = samples[0]
    names = [s.name for s in samples]
    head = "| " + " | ".join(names) + " |"
    rule = " ---: |" * len(samples)
    out = ["| variant | requests | server CPU per request (µs) | vs first |", "| --- | ---: | ---: | ---: |"]
    for s in samples:
        out.append(f"| {s.name} | {s.requests:,} | {s.cpu_per_request:,.1f} | "
                   f"{s.cpu_per_request / base.cpu_per_request:.2f}× |")

    def table(title: str, keys: list[str], share_of: dict[str, dict[str, float]]) -> None:
        out.extend(["", f"| {title} (µs per request) {head}", f"| --- |{rule}"])
        for key in keys:
            cells = " | ".join(f"{per_request(s, share_of[s.name].get(key, 0.0)):,.1f}" for s in samples)
            out.append(f"| {key} | {cells} |")

    dsos = sorted({k for s in samples for k in s.by_dso}, key=lambda k: -max(
        per_request(s, s.by_dso.get(k, 0.0)) for s in samples))
    table("shared object", [k for k in dsos if max(per_request(s, s.by_dso.get(k, 0.0)) for s in samples) >= 0.5],
          {s.name: s.by_dso for s in samples})
    threads = sorted({k for s in samples for k in s.by_thread}, key=lambda k: (not k.startswith("main"), k))
    table("thread", threads, {s.name: s.by_thread for s in samples})
    symbols = {k for s in samples for k in s.by_symbol}

    def spread(key: tuple[str, str]) -> float:
        values = [per_request(s, s.by_symbol.get(key, 0.0)) for s in samples]
        return max(values) - min(values) if len(values) > 1 else values[0]

    chosen = sorted(symbols, key=spread, reverse=True)[:top]
    out.extend(["", f"| symbol (µs per request; where the variants differ most) {head}", f"| --- |{rule}"])
    for dso, symbol in chosen:
        cells = " | ".join(f"{per_request(s, s.by_symbol.get((dso, symbol), 0.0)):,.1f}" for s in samples)
        out.append(f"| `{symbol}` ({dso}) | {cells} |")
    return "\n".join(out)


async def main(argv: list[str] | None = None) -> list[Samples]:
    parser = argparse.ArgumentParser(prog="python -m bench.native", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_options(parser, seconds=6.0, per_variant="sampled")
    parser.add_argument("--top", type=int, default=25, help="symbols listed (default 25)")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args)
    why = perf_usable()
    if why is not None:
        parser.exit(2, f"python -m bench.native: {why}\n")
    samples = [await measure(v, stream=args.stream, chunks=args.chunks, seconds=max(1.0, args.seconds))
               for v in variants]
    print(report(samples, args.top), flush=True)
    return samples


if __name__ == "__main__":
    asyncio.run(main())
