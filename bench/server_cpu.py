"""Server CPU per request of one or more gateway builds, in alternated passes: an A/B test.

    python -m bench.server_cpu [--stream [--chunks N[,M]] [--in-phase]] [--keep-busy] [--seconds S] \\
        [--pairs N] [--no-budget] --variant NAME=TREE[:VAR=VALUE,...] [--variant NAME=bare] [--variant ...]
    (or, from the repository root: PYTHONPATH=. python bench/server_cpu.py ...)

A change of a few microseconds per request is below what one full ``python -m bench`` run
can tell apart on a small shared machine. This drives S1's load (32 concurrent
non-streaming calls, ``fast`` upstream) or, with ``--stream``, S3's (64 concurrent streams
of 50 chunks 20 ms apart) at one gateway at a time, started from each variant's source
tree (another checkout, e.g. a ``git worktree`` of the commit before a change) and with
its extra environment (``LOG_LEVEL=warning`` to measure what logging costs), and reads
the gateway process's CPU over ``S`` measured seconds after a 2 s warm-up. Variants take
turns ``N`` times (A B A B ...), so a neighbour's noise lands on both; each pass prints its
figure and the end the median per variant. The gateway is pinned to one CPU and the
driver and fake provider to the other, as in ``python -m bench``.

With ``--stream`` the streams start spread over one stream's length (64 streams x 50
chunks 20 ms apart: a start every 16 ms), as S3 starts them, so each event reaches the
server on its own; ``--in-phase`` starts them together, as this command did before the
thirteenth pass: the 64 streams then stay in step and the server takes each 20 ms tick's
64 events back to back. The two cost the gateway very differently (docs/benchmark.md,
"The thirteenth pass"): S3's figure is the spread one.

``--keep-busy`` runs a spinner on the server's CPU during each pass, under Linux's
``SCHED_IDLE`` (it runs only when nothing else wants that CPU, and never preempts the
server): the CPU never idles between two events. It measures how much of a server's CPU
per request is the cost of waking on a core that went idle (caches and TLBs cold, the
hypervisor's switch), not work of its own; the spinner's CPU is not the server's.

``NAME=bare`` is the bare relay (``bench/bare_relay.py``) as a variant of its own, measured
in the same turns. ``--chunks N`` sets the streams' length (default 50); two lengths,
``--chunks 10,50``, measure each variant at both in turn and split its CPU per stream
into what each chunk costs (the slope between the two) and what the stream's request
costs whatever its length (the intercept): whether a gateway's excess over the bare
relay is per chunk or per request.

Examples::

    git worktree add /tmp/before HEAD~1
    python -m bench.server_cpu --variant before=/tmp/before --variant after=.
    python -m bench.server_cpu --no-budget --variant logs=. --variant quiet=.:LOG_LEVEL=warning
    python -m bench.server_cpu --stream --chunks 10,50 --variant gateway=. --variant bare=bare

PostgreSQL as for ``python -m bench`` (``BENCH_PG_ADMIN_DSN``); each pass has its own
scratch database, dropped at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.driver import Call, closed_loop
from bench.scenarios import RunContext, profiles_for, stream_body, whole_body
from bench.stack import REPO, ProcWatch, Profile, Stack, StackOptions

__all__ = [
    "Variant", "add_variant_options", "chosen_variants", "load_profile", "main", "measure", "parse_variant", "spinner",
    "variant_load",
]


@dataclass(frozen=True)
class Variant:
    name: str
    repo: Path
    env: dict[str, str] = field(default_factory=dict)
    #: The bare relay instead of a gateway (``NAME=bare``).
    bare: bool = False


def parse_variant(spec: str) -> Variant:
    """``NAME=TREE[:VAR=VALUE,...]``."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--variant {spec!r}: expected NAME=TREE[:VAR=VALUE,...]")
    if rest == "bare":
        return Variant(name, REPO, bare=True)
    tree, _, env_text = rest.partition(":")
    env: dict[str, str] = {}
    for item in filter(None, env_text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"--variant {spec!r}: {item!r} is not VAR=VALUE")
        env[key] = value
    repo = Path(tree).expanduser().resolve()
    if not (repo / "gateway" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"--variant {spec!r}: {repo} is not a gateway source tree")
    return Variant(name, repo, env)


def load_profile(stream: bool, chunks: int = 50) -> Profile:
    """The upstream of S1's load (``fast``) or of S3's streams, ``chunks`` long."""
    profile = profiles_for(False)["stream" if stream else "fast"]
    return dataclasses.replace(profile, chunks=chunks) if stream else profile


def variant_load(stack: Stack, variant: Variant, profile: Profile, *, stream: bool, chunks: int) -> tuple[Call, int]:
    """What the tools drive at one variant's server in ``stack``: the call (S1's whole
    answer or S3's stream) and the server's process id."""
    ctx = RunContext(stack, False)
    target = "bare" if variant.bare else "gateway"
    call = ctx.call(target, profile, stream_body(profile, chunks) if stream else whole_body(profile))
    assert stack.gateway is not None
    pid = stack.bare_procs[profile.name].pid if variant.bare else stack.gateway.pid
    return call, pid


def add_variant_options(parser: argparse.ArgumentParser, *, seconds: float, per_variant: str) -> None:
    """The options ``bench.opcodes`` and ``bench.native`` share: variants, S3's streams, their
    length, and the seconds measured (``per_variant`` says what is done in them)."""
    parser.add_argument("--variant", type=parse_variant, action="append",
                        help="NAME=TREE[:VAR=VALUE,...] or NAME=bare (repeat; default bare and this tree)")
    parser.add_argument("--stream", action="store_true", help="S3's streams instead of S1's whole calls")
    parser.add_argument("--chunks", type=int, default=50, help="with --stream: chunks per stream (default 50)")
    parser.add_argument("--seconds", type=float, default=seconds,
                        help=f"{per_variant} seconds per variant (default {seconds:g})")


def chosen_variants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Variant]:
    """The variants :func:`add_variant_options` parsed (default: the bare relay and this
    tree), checked with the chunks; a usage error otherwise."""
    variants: list[Variant] = args.variant or [parse_variant("bare=bare"), parse_variant(f"gateway={REPO}")]
    if len({v.name for v in variants}) != len(variants):
        parser.error("variant names must differ")
    if args.chunks < 1:
        parser.error("--chunks takes at least 1")
    return variants


async def measure(
    variant: Variant, *, stream: bool, seconds: float, budget: bool, chunks: int = 50,
    in_phase: bool = False, keep_busy: bool = False,
) -> tuple[float, float]:
    """One pass: (server CPU µs per request, requests/s)."""
    profile = load_profile(stream, chunks)
    options = StackOptions(profiles=(profile,), bare=variant.bare, gateway_env=variant.env, key_budget=budget,
                           repo=variant.repo)
    async with Stack(options) as stack:
        call, pid = variant_load(stack, variant, profile, stream=stream, chunks=chunks)
        concurrency = 64 if stream else 32
        # S3's spread: one stream's length, over which the workers' first streams start.
        stagger = 0.0 if not stream or in_phase else profile.stream_seconds
        if keep_busy and not stack.pinned:
            raise RuntimeError("--keep-busy needs the server pinned to a CPU of its own (taskset, two CPUs)")
        busy = spinner(stack.server_cpu, 2.0 + stagger + 0.5 + seconds + 30) if keep_busy else contextlib.nullcontext()
        with busy:
            await closed_loop(lambda _i: call, concurrency=concurrency, duration=2.0, warmup=0.5, stagger=stagger)
            watch = ProcWatch(pid)
            async with watch.window() as window:
                result = await closed_loop(lambda _i: call, concurrency=concurrency, duration=seconds,
                                           warmup=0.5 + stagger, stagger=stagger,
                                           on_measure=lambda: watch.restart(window))
    if not result.ok:
        raise RuntimeError(f"{variant.name}: no request succeeded ({dict(result.errors)})")
    return 1e6 * window.cpu / result.ok, result.rps


#: The spinner ``--keep-busy`` runs: pinned to one CPU under SCHED_IDLE, a loop that touches
#: next to no memory, ending by itself at its deadline (or when the pass kills it).
_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for _ in range(100_000):  # a few ms between looks at the clock
        pass
"""


@contextlib.contextmanager
def spinner(cpu: int, most_seconds: float) -> Iterator[subprocess.Popen[bytes]]:
    """A SCHED_IDLE spinner on ``cpu`` while the block runs (``--keep-busy``), for
    ``most_seconds`` at most."""
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), str(most_seconds)])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _lengths(text: str) -> tuple[int, ...]:
    """``--chunks``: one length, or two different ones (the shorter first)."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--chunks {text!r}: expected N or N,M") from None
    if not 1 <= len(values) <= 2 or values[0] < 1 or len(values) != len(text.split(",")):
        raise argparse.ArgumentTypeError(f"--chunks {text!r}: one or two different lengths of at least 1")
    return values


def _label(name: str, chunks: int, lengths: tuple[int, ...]) -> str:
    return f"{name}@{chunks}" if len(lengths) > 1 else name


async def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(prog="python -m bench.server_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=TREE[:VAR=VALUE,...] (repeat; variants alternate)")
    parser.add_argument("--stream", action="store_true", help="S3's streams instead of S1's whole calls")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per pass (default 8)")
    parser.add_argument("--pairs", type=int, default=3, help="passes per variant (default 3, at most 20)")
    parser.add_argument("--no-budget", action="store_true", help="the bench key without its budget")
    parser.add_argument("--in-phase", action="store_true",
                        help="with --stream: start the streams together (default: spread as S3 spreads them)")
    parser.add_argument("--keep-busy", action="store_true",
                        help="a SCHED_IDLE spinner on the server's CPU: it never idles between events")
    parser.add_argument("--chunks", type=_lengths, default=(50,),
                        help="with --stream: chunks per stream, N or N,M (two lengths: per chunk and per stream)")
    args = parser.parse_args(argv)
    variants: list[Variant] = args.variant
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        parser.error("variant names must differ")
    lengths: tuple[int, ...] = args.chunks if args.stream else (50,)
    if not args.stream and args.chunks != (50,):
        parser.error("--chunks needs --stream")
    if args.in_phase and not args.stream:
        parser.error("--in-phase needs --stream")
    if args.keep_busy and not (hasattr(os, "SCHED_IDLE") and len(os.sched_getaffinity(0)) >= 2):
        parser.error("--keep-busy needs Linux's SCHED_IDLE and two CPUs (the server's is kept busy)")
    unit = "stream" if args.stream else "request"
    figures: dict[str, list[float]] = {_label(v.name, n, lengths): [] for v in variants for n in lengths}
    for round_ in range(max(1, min(args.pairs, 20))):
        for variant in variants:
            for chunks in lengths:
                cpu, rps = await measure(variant, stream=args.stream, seconds=max(1.0, args.seconds),
                                         budget=not args.no_budget, chunks=chunks, in_phase=args.in_phase,
                                         keep_busy=args.keep_busy)
                label = _label(variant.name, chunks, lengths)
                figures[label].append(cpu)
                print(f"pass {round_ + 1} {label}: {cpu:,.1f} µs of server CPU per {unit} ({rps:,.0f}/s)", flush=True)
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values):,.1f} µs per {unit} "
              f"(min {min(values):,.1f}, max {max(values):,.1f}, {len(values)} passes)")
    if len(lengths) == 2:
        short, long = lengths
        for variant in variants:
            a = statistics.median(figures[_label(variant.name, short, lengths)])
            b = statistics.median(figures[_label(variant.name, long, lengths)])
            per_chunk = (b - a) / (long - short)
            print(f"{variant.name}: {per_chunk:,.1f} µs per chunk, {a - short * per_chunk:,.0f} µs per stream "
                  f"whatever its length (medians at {short} and {long} chunks)")
    return figures


if __name__ == "__main__":
    asyncio.run(main())
