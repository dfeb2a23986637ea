"""The benchmark's options that change what is measured (no processes started here)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.cli import build_parser
from bench.stack import key_create_argv


class ThreeRounds:
    """A stand-in RunContext: full sizes, three rounds, every target; the passes themselves
    come from a test's stand-in ``measure``."""

    quick, rounds, duration = False, 3, None
    stack = None

    def seconds(self, full: float, quick: float) -> float:
        return full

    def call(self, target: str, profile: Any, body: Any) -> None:
        return None

    def active(self) -> list[str]:
        return ["direct", "bare", "gateway"]


def test_the_bench_key_has_its_budget_unless_no_budget_is_asked() -> None:
    assert build_parser().parse_args([]).no_budget is False
    assert build_parser().parse_args(["--no-budget"]).no_budget is True
    budgeted = key_create_argv(budget=True)
    assert budgeted[budgeted.index("--budget-usd") + 1] == "1000000"
    assert budgeted[budgeted.index("--budget-period") + 1] == "total"
    unbudgeted = key_create_argv(budget=False)
    assert "--budget-usd" not in unbudgeted and "--budget-period" not in unbudgeted
    assert "--rpm" in unbudgeted  # the limits stay: only the budget goes


async def test_s3_reports_each_servers_least_cpu_per_chunk_of_its_rounds_and_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3's latency rows come from each target's best round by first chunk; its CPU per
    chunk is each server's lowest round (noise only adds CPU), every round in a note."""
    from bench import scenarios
    from bench.driver import Result
    from bench.stack import Window

    # Per target, its rounds: (time to first chunk s, server CPU s) over 100 events.
    rounds = {"direct": [(0.001, None)] * 3, "bare": [(0.002, 0.005), (0.003, 0.004), (0.004, 0.0045)],
              "gateway": [(0.002, 0.009), (0.003, 0.007), (0.004, 0.008)]}
    taken = {t: 0 for t in rounds}

    async def fake_measure(ctx: Any, target: str, profile: Any, run: Any) -> scenarios.Measured:
        ttfc, cpu = rounds[target][taken[target]]
        taken[target] += 1
        result = Result(latencies=[1.0] * 2, ttfcs=[ttfc] * 2, events=[50, 50], duration=1.0)
        window = None if cpu is None else Window(start_rss=0, start_cpu=0.0, started=0.0, cpu=cpu, wall=1.0)
        return scenarios.Measured(result, window)

    monkeypatch.setattr(scenarios, "measure", fake_measure)
    report = await scenarios.s3(ThreeRounds())  # type: ignore[arg-type]
    cpu = next(r for r in report.rows if r.metric == "server CPU per chunk")
    assert cpu.values == {"bare": 40.0, "gateway": 70.0}  # the lowest rounds, not the fastest-first-chunk ones
    assert cpu.compare.startswith("1.75\u00d7 bare") and cpu.passed is False
    ttfc = next(r for r in report.rows if r.metric == "time to first chunk p50")
    assert ttfc.values["gateway"] == 2.0 and ttfc.values["bare"] == 2.0  # the best round by first chunk
    assert any("bare 50, 40, 45 µs" in n and "gateway 90, 70, 80 µs" in n for n in report.notes)


async def test_s2_reads_each_targets_best_round_and_notes_every_rounds_p99(monkeypatch: pytest.MonkeyPatch) -> None:
    """S2's bar reads each target's best round (lowest p50 + p99); a note gives every
    round's p99 and the gateway's over the bare relay's round by round."""
    from bench import scenarios
    from bench.driver import Result

    # Per target, its rounds' latencies (s): a p50 and a p99 each.
    rounds = {"direct": [(0.050, 0.052)] * 3, "bare": [(0.0505, 0.053), (0.0505, 0.0525), (0.051, 0.055)],
              "gateway": [(0.051, 0.0540), (0.051, 0.0560), (0.051, 0.0530)]}
    taken = {t: 0 for t in rounds}

    async def fake_measure(ctx: Any, target: str, profile: Any, run: Any) -> scenarios.Measured:
        p50, p99 = rounds[target][taken[target]]
        taken[target] += 1
        return scenarios.Measured(Result(latencies=[p50] * 98 + [p99] * 2, duration=1.0))

    monkeypatch.setattr(scenarios, "measure", fake_measure)
    report = await scenarios.s2(ThreeRounds())  # type: ignore[arg-type]
    over = next(r for r in report.rows if r.metric == "added p99 over the bare relay's")
    assert over.values == {"gateway": 0.5} and over.passed is True  # 53.0 - 52.5: the best rounds
    assert any(
        "bare 53.00, 52.50, 55.00" in n and "gateway 54.00, 56.00, 53.00" in n
        and "same round: +1.00, +3.50, -2.00" in n for n in report.notes
    ), report.notes


def test_the_profile_sets_aside_a_pool_workers_unlink_but_not_the_loops(tmp_path: Any) -> None:
    """A journal thread waiting in ``unlink`` uses no CPU; the loop's own unlink does."""
    from bench.profiling import summarize

    py = "/usr/lib/python3.11"
    pool = (f"Thread._bootstrap ({py}/threading.py:1002);_worker ({py}/concurrent/futures/thread.py:83);"
            f"_WorkItem.run ({py}/concurrent/futures/thread.py:58);Path.unlink ({py}/pathlib.py:1147)")
    loop = (f"_run_module_as_main (<frozen runpy>:198);Runner.run ({py}/asyncio/runners.py:118);"
            f"discard (/src/gateway/billing/journal.py:450);Path.unlink ({py}/pathlib.py:1147)")
    ours = f"Runner.run ({py}/asyncio/runners.py:118);serve (/src/gateway/edge/pipeline.py:130)"
    collapsed = tmp_path / "stacks.txt"
    collapsed.write_text(f"{pool} 30\n{loop} 10\n{ours} 60\n")
    summary = summarize(collapsed)
    assert summary["samples"] == 70 and summary["blocked_share"] == 30.0
    assert dict(summary["areas"]) == {"gateway (ours)": 85.7, "pathlib": 14.3}


def test_bench_native_reads_perfs_shares_as_cpu_per_request() -> None:
    """``bench.native`` turns ``perf report``'s percentages into µs of the server's CPU per
    request: comments and blank lines skipped, a symbol's user/kernel mark kept (so a user
    and a kernel symbol of one name never merge), one key's lines summed."""
    from bench.native import Samples, parse_report, per_request, report

    by_symbol = parse_report(
        "# Samples: 30K of event 'cpu-clock'\n#\n"
        "    35.80%  libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault\n"
        "     2.50%  [kernel.kallsyms]      [k] copy_user_generic\n"
        "     0.50%  [kernel.kallsyms]      [.] copy_user_generic\n"
        "     0.25%  libc.so.6              [.] malloc\n"
        "     0.25%  libc.so.6              [.] malloc\n"
        "\n", 2)
    assert by_symbol == pytest.approx({
        ("libpython3.11.so.1.0", "[.] _PyEval_EvalFrameDefault"): 0.358,
        ("[kernel.kallsyms]", "[k] copy_user_generic"): 0.025,
        ("[kernel.kallsyms]", "[.] copy_user_generic"): 0.005,
        ("libc.so.6", "[.] malloc"): 0.005,
    })
    assert parse_report("    98.58%     5736:python \n     1.42%     5741:python \n", 1) == pytest.approx(
        {("5736:python",): 0.9858, ("5741:python",): 0.0142})
    # 2 s of CPU over 10,000 requests is 200 µs a request; a quarter of the samples, 50.
    bare = Samples("bare", 10_000, 2.0, {"libpython3.11.so.1.0": 0.8}, {}, {"main (event loop)": 1.0})
    gateway = Samples("gateway", 5_000, 2.0, {"libpython3.11.so.1.0": 0.9, "orjson.so": 0.02}, {},
                      {"main (event loop)": 0.95, "thread 7": 0.05})
    assert bare.cpu_per_request == pytest.approx(200.0) and per_request(bare, 0.25) == pytest.approx(50.0)
    text = report([bare, gateway], top=5)
    assert "| gateway | 5,000 | 400.0 | 2.00\u00d7 |" in text
    assert "| libpython3.11.so.1.0 | 160.0 | 360.0 |" in text and "| orjson.so | 0.0 | 8.0 |" in text
    assert "| main (event loop) | 200.0 | 380.0 |" in text and "| thread 7 | 0.0 | 20.0 |" in text
