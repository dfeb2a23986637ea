"""The benchmark's options that change what is measured (no processes started here)."""

from __future__ import annotations

from bench.cli import build_parser
from bench.stack import key_create_argv


def test_the_bench_key_has_its_budget_unless_no_budget_is_asked() -> None:
    assert build_parser().parse_args([]).no_budget is False
    assert build_parser().parse_args(["--no-budget"]).no_budget is True
    budgeted = key_create_argv(budget=True)
    assert budgeted[budgeted.index("--budget-usd") + 1] == "1000000"
    assert budgeted[budgeted.index("--budget-period") + 1] == "total"
    unbudgeted = key_create_argv(budget=False)
    assert "--budget-usd" not in unbudgeted and "--budget-period" not in unbudgeted
    assert "--rpm" in unbudgeted  # the limits stay: only the budget goes
