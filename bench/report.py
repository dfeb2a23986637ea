"""The run's report: one Markdown table (what docs and the README show) and the raw JSON.

Files go to ``bench/results/`` (git-ignored) as ``<stamp>-<mode>.md``/``.json``, and the
newest run is copied to ``latest.md``/``latest.json``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.scenarios import TARGETS, ScenarioReport
from bench.stack import REPO

__all__ = ["machine", "render_markdown", "write"]

_TARGET_TITLES = {"direct": "direct", "bare": "bare relay", "gateway": "gateway"}


def machine() -> dict[str, Any]:
    """What the numbers were measured on, including how busy the machine was."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = ""
    dirty = False
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, check=False).stdout.strip())
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": commit + ("+dirty" if dirty else ""),
    }


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def _extra_env(gateway_env: dict[str, str]) -> str:
    """The gateway's settings the run changed (``--gateway-env``), e.g. budget leases off."""
    if not gateway_env:
        return ""
    return " · gateway environment: " + ", ".join(f"`{k}={v}`" for k, v in sorted(gateway_env.items()))


def _verdict(passed: bool | None) -> str:
    return "" if passed is None else ("pass" if passed else "**FAIL**")


def render_markdown(meta: dict[str, Any], reports: list[ScenarioReport], profile: dict[str, Any] | None,
                    hops: dict[str, Any] | None) -> str:
    m = meta["machine"]
    env = meta["environment"]
    pin = (f"gateway and bare relay pinned to CPU {env['gateway_cpu']}, fake providers and driver to CPU "
           f"{env['load_cpu']}") if env["pinned"] else "not pinned"
    lines = [
        f"# Benchmark: {meta['mode']} run, {meta['started']}",
        "",
        f"Commit `{m['commit']}` · Python {m['python']} · {m['cpus']} CPUs ({m['cpu_model']}) · "
        f"load average before {m['load_average'][0]}, after {meta['load_after'][0]} · {pin} · "
        f"actors in the tree: {', '.join(env['features'])} · Redis: {'yes' if env['redis'] else 'no'}"
        f" · gateway workers: {meta.get('gateway_workers', 1)}"
        f" · bench key budget: {'yes' if env.get('key_budget', True) else 'no'}"
        f"{_extra_env(env.get('gateway_env') or {})}.",
        "",
        "Direct = the client calls the fake provider itself; bare relay = a 20-line aiohttp pass-through "
        "(bench/bare_relay.py); gateway = `llm-gateway serve` with a real key, limits, breaker and billing "
        "as present. Comparisons are gateway minus direct (bare relay minus direct in brackets).",
        "",
        "| scenario | metric | unit | direct | bare relay | gateway | gateway vs direct | bar | verdict |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for report in reports:
        if report.skipped:
            lines.append(f"| {report.id} | *skipped: {report.skipped}* | | | | | | | |")
            continue
        for row in report.rows:
            values = [_fmt(row.values.get(t)) if t in row.values else "—" for t in TARGETS]
            lines.append(
                f"| {row.scenario} | {row.metric} | {row.unit} | {' | '.join(values)} | {row.compare} | "
                f"{row.bar} | {_verdict(row.passed)} |"
            )
    lines.append("")
    for report in reports:
        lines.append(f"- **{report.id}** {report.title}." + (" " + "; ".join(report.notes) + "." if report.notes else ""))
    if hops:
        lines += ["", "## Actor hops", ""]
        costs = hops.get("costs", {})
        lines.append(
            f"Measured in the driver's process: one `ask` round trip to an idle actor costs {costs.get('ask_us')} µs "
            f"and one `tell` (handled) {costs.get('tell_us')} µs, against {costs.get('await_us')} µs for a plain "
            f"`await`; `AuthHandle.authenticate` on a cached key costs {costs.get('cached_key_check_us')} µs. "
            "Hops per request, counted on every `ActorRef.ask`/`tell` while an in-process gateway served "
            f"{hops.get('whole', {}).get('requests', 0)} calls of each kind:"
        )
        lines.append("")
        lines.append("| request | asks | tells | by actor and message |")
        lines.append("| --- | ---: | ---: | --- |")
        for kind in ("whole", "stream"):
            if kind in hops:
                h = hops[kind]
                detail = ", ".join(f"{k} × {v:g}" for k, v in h["per_request"].items()) or "none"
                lines.append(f"| {kind} | {h['asks']:g} | {h['tells']:g} | {detail} |")
    if profile:
        lines += ["", "## Profile of the hot path", ""]
        lines += _profile_lines(profile)
    lines.append("")
    return "\n".join(lines)


def _profile_lines(profile: dict[str, Any]) -> list[str]:
    if profile.get("error"):
        return [f"Not taken: {profile['error']}."]
    targets: dict[str, Any] = profile.get("targets", {})
    if not targets:
        return ["Not taken: no bare relay or gateway in this run."]
    lines = [
        f"py-spy (`--nonblocking`, 250 Hz) on each server for {profile['seconds']:g} s of S1's load; samples "
        "of threads blocked in a call that releases the GIL (the thread pool and the log writer waiting, "
        "the journal's write and fsync) set aside"
        + "".join(f" ({_TARGET_TITLES[n]}: {t['summary'].get('blocked_share', 0)} % of samples)"
                  for n, t in targets.items() if t["summary"].get("blocked_share"))
        + ", so shares are of CPU time, turned into µs per request with the CPU the process used. Raw stacks: "
        + ", ".join(f"`{t['file']}`" for t in targets.values()) + ".",
        "",
    ]
    names = list(targets)
    lines.append("| where the CPU goes, per request | " + " | ".join(_TARGET_TITLES[n] for n in names) + " |")
    lines.append("| --- |" + " ---: |" * len(names))
    areas: dict[str, dict[str, float]] = {}
    for name, t in targets.items():
        per = t.get("cpu_us_per_request") or 0.0
        for area, pct in t["summary"].get("areas", []):
            areas.setdefault(area, {})[name] = per * pct / 100
    ordered = sorted(areas, key=lambda a: -max(areas[a].values()))
    for area in ordered[:10]:
        cells = [f"{areas[area][n]:.0f} µs" if n in areas[area] else "—" for n in names]
        lines.append(f"| {area} | " + " | ".join(cells) + " |")
    totals = [f"**{targets[n].get('cpu_us_per_request') or 0:.0f} µs**" for n in names]
    lines.append("| total | " + " | ".join(totals) + " |")
    gateway = targets.get("gateway")
    if gateway is not None:
        summary = gateway["summary"]
        lines += ["", "| gateway: hottest functions (self) | share |", "| --- | ---: |"]
        lines += [f"| `{name}` | {pct} % |" for name, pct in summary.get("self", [])]
        lines += ["", "| gateway: our functions (inclusive) | share |", "| --- | ---: |"]
        lines += [f"| `{name}` | {pct} % |" for name, pct in summary.get("ours_inclusive", [])]
    return lines


def write(out_dir: Path, stamp: str, meta: dict[str, Any], reports: list[ScenarioReport],
          profile: dict[str, Any] | None, hops: dict[str, Any] | None) -> tuple[Path, Path]:
    """Write ``<stamp>-<mode>.md`` and ``.json`` and refresh ``latest.*``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"{stamp}-{meta['mode']}"
    md_path, json_path = base.with_suffix(".md"), base.with_suffix(".json")
    md_path.write_text(render_markdown(meta, reports, profile, hops))
    doc = {**meta, "scenarios": [asdict(r) for r in reports], "profile": profile, "hops": hops}
    json_path.write_text(json.dumps(doc, indent=2, default=str))
    shutil.copyfile(md_path, out_dir / "latest.md")
    shutil.copyfile(json_path, out_dir / "latest.json")
    return md_path, json_path
