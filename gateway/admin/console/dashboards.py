"""The Overview, Usage, Providers, Cache and Audit pages.

Figures come from :mod:`gateway.admin.console.figures` (the ledger report the admin API
and the CLI share), provider health from :func:`gateway.admin.views.providers_view`
(what ``GET /admin/providers`` answers, which the Providers page polls to stay live),
the cache's from its handle's ``stats()`` (``GET /admin/cache``), the trail from
:class:`gateway.admin.audit.AuditLog` (``GET /admin/audit``).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from gateway.admin.audit import ACTIONS, AuditLog
from gateway.admin.console.auth import console_page
from gateway.admin.console.figures import csv_export, midnight, period_figures, row_label, top
from gateway.admin.console.layout import bar_chart, detail_json, esc, money, page, table
from gateway.admin.session import Session
from gateway.admin.views import providers_view
from gateway.billing.reports import GROUPS, UsageReport, query_from_params, usage_report
from gateway.http.state import STATE

__all__ = ["dashboard_routes"]


def _ms(value: float | None) -> str:
    return f"{value:,.0f} ms" if value is not None else "—"


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "—"


@console_page
async def overview(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/``: today and 7 days, top spenders, open breakers."""
    state = request.app[STATE]
    today = datetime.now(timezone.utc).date()
    day, week, by_day = await period_figures(state.pool, today)
    cards = "".join(
        f'<section class="card period" data-period="{"today" if p is day else "week"}"><h2>{esc(p.label)}</h2><dl>'
        f'<dt>Requests</dt><dd data-figure="requests">{p.total.requests:,}</dd>'
        f'<dt>Error rate</dt><dd data-figure="error_rate">{_pct(p.error_rate)}</dd>'
        f'<dt>Latency p50 / p99</dt><dd data-figure="latency">{_ms(p.p50_ms)} / {_ms(p.p99_ms)}</dd>'
        f'<dt>Tokens in / out</dt><dd data-figure="tokens">{p.total.prompt_tokens:,} / {p.total.completion_tokens:,}</dd>'
        f'<dt>Spend</dt><dd data-figure="cost_usd" data-value="{float(p.total.cost_usd):.6f}">'
        f"{money(float(p.total.cost_usd))}</dd></dl></section>"
        for p in (day, week)
    )
    week_start = midnight(today - timedelta(days=6))
    tops = ""
    for group_by, title in (("key", "Top keys"), ("model", "Top models"), ("subject", "Top subjects")):
        rows = await top(state.pool, group_by, week_start)
        tops += f'<section class="card"><h2>{title} by spend, 7 days</h2>' + table(
            ("Name", "Requests", "Spend"),
            [(esc(row_label(r)), f"{r.requests:,}", money(float(r.cost_usd))) for r in rows],
            id_=f"top-{group_by}", empty="No calls yet.",
        ) + "</section>"
    unhealthy = [d for d in providers_view(state)["deployments"] if d["circuit_state"] in ("open", "half-open")]
    breakers = table(
        ("Deployment", "Circuit", "Error rate"),
        [(esc(d["id"]), esc(d["circuit_state"]), _pct(d["error_rate"])) for d in unhealthy],
        id_="open-breakers", empty="Every circuit is closed.",
    )
    chart = bar_chart([(r.group, float(r.cost_usd)) for r in by_day.rows], label="Spend per day", unit="$")
    body = (
        f'<div class="grid">{cards}</div><h2>Spend per day (UTC)</h2>{chart or "<p>No calls in 7 days.</p>"}'
        f'<div class="grid">{tops}</div><h2>Providers with an open breaker</h2>{breakers}'
    )
    return page("Overview", body, session, active="/ui/")


def _usage_query(request: web.Request) -> tuple[dict[str, str], str]:
    """The page's parameters (empty ones dropped) and an error message, if any."""
    params = {k: v.strip() for k, v in request.query.items() if v.strip()}
    if "since" not in params and "until" not in params:
        params["since"] = (datetime.now(timezone.utc).date() - timedelta(days=6)).isoformat()
    params.setdefault("group_by", "day")
    return params, ""


async def _report(request: web.Request) -> tuple[dict[str, str], UsageReport | None, str]:
    params, _ = _usage_query(request)
    try:
        query = query_from_params(params)
    except ValueError as exc:
        return params, None, str(exc)
    return params, await usage_report(request.app[STATE].pool, query), ""


@console_page
async def usage_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/usage?since=&until=&group_by=&api_key_id=&subject_id=``: chart, table, CSV."""
    params, report, error = await _report(request)
    options = "".join(
        f'<option value="{g}"{" selected" if g == params.get("group_by") else ""}>{g}</option>' for g in GROUPS
    )
    form = (
        '<form method="get" action="/ui/usage" class="filters">'
        f'<label for="since">Since</label><input id="since" name="since" value="{esc(params.get("since", ""))}" '
        'placeholder="YYYY-MM-DD or ISO time">'
        f'<label for="until">Until</label><input id="until" name="until" value="{esc(params.get("until", ""))}" '
        'placeholder="empty: now">'
        f'<label for="group_by">Group by</label><select id="group_by" name="group_by">{options}</select>'
        f'<label for="api_key_id">Key id</label><input id="api_key_id" name="api_key_id" '
        f'value="{esc(params.get("api_key_id", ""))}">'
        f'<label for="subject_id">Subject</label><input id="subject_id" name="subject_id" '
        f'value="{esc(params.get("subject_id", ""))}">'
        '<button type="submit">Show</button></form>'
    )
    today = datetime.now(timezone.utc).date()
    presets = " · ".join(
        f'<a href="/ui/usage?{esc(urlencode({"since": (today - timedelta(days=days - 1)).isoformat(), "group_by": params["group_by"]}))}">'
        f"{label}</a>"
        for label, days in (("Today", 1), ("7 days", 7), ("30 days", 30), ("90 days", 90))
    )
    form += f'<p class="presets">Range: {presets} (UTC days)</p>'
    if report is None:
        return page("Usage", form + f'<p class="error" role="alert">{esc(error)}</p>', session, active="/ui/usage")
    csv_url = esc("/ui/usage.csv?" + urlencode(params))
    rows = [
        (esc(row_label(r)), f"{r.requests:,}", f"{r.errors:,}", f"{r.prompt_tokens:,}", f"{r.completion_tokens:,}",
         f'<span data-cost="{float(r.cost_usd):.6f}">{money(float(r.cost_usd))}</span>')
        for r in report.rows
    ]
    t = report.total
    rows.append(("<strong>Total</strong>", f"{t.requests:,}", f"{t.errors:,}", f"{t.prompt_tokens:,}",
                 f"{t.completion_tokens:,}", f'<strong data-total-cost="{float(t.cost_usd):.6f}">'
                 f"{money(float(t.cost_usd))}</strong>"))
    chart = bar_chart([(row_label(r), float(r.cost_usd)) for r in report.rows[:30]], label="Spend", unit="$")
    body = (
        form + f'<p><a class="button" href="{csv_url}" download>Export CSV</a></p>'
        + (chart or "") + table(("Group", "Requests", "Errors", "Tokens in", "Tokens out", "Cost (USD)"), rows,
                                id_="usage", empty="No calls in this range.")
    )
    return page("Usage", body, session, active="/ui/usage")


@console_page
async def usage_csv(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/usage.csv``: the Usage page's numbers (as ``llm-gateway usage`` prints them)."""
    params, report, error = await _report(request)
    if report is None:
        return web.Response(status=400, text=error + "\n", content_type="text/plain")
    name = f"usage-{params.get('group_by')}-{params.get('since', 'start')}.csv".replace(":", "")
    return web.Response(text=csv_export(report), content_type="text/csv", charset="utf-8",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})


def provider_rows(view: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (esc(d["id"]), esc(", ".join(g["name"] for g in d["model_groups"])),
         f'<span class="circuit circuit-{esc(d["circuit_state"])}">{esc(d["circuit_state"])}</span>',
         _ms(d["latency_ms"]), _pct(d["error_rate"]), str(d["recent_requests"] if d["recent_requests"] is not None else "—"))
        for d in view["deployments"]
    ]


@console_page
async def providers_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/providers``: every deployment's health; the script refreshes it every 3 s."""
    view = providers_view(request.app[STATE])
    body = (
        '<p>Refreshed every 3 seconds from <code>GET /admin/providers</code>. '
        '<span id="refreshed" role="status"></span></p>'
        + table(("Deployment", "Model groups", "Circuit", "Latency (recent)", "Error rate", "Recent calls"),
                provider_rows(view), numeric_from=3, id_="providers", empty="No deployment is configured.")
        + "<h2>Providers</h2>"
        + table(("Name", "Type", "Base URL"), [
            (esc(p["name"]), esc(p["type"]), f"<code>{esc(p['base_url'] or '')}</code>") for p in view["providers"]
        ], numeric_from=99)
    )
    return page("Providers", body, session, active="/ui/providers")


@console_page
async def cache_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/cache``: sizes, hit rate, policies; purge through ``DELETE /admin/cache``."""
    cache = request.app[STATE].cache
    if cache is None:
        return page("Cache", "<p>The response cache is not running.</p>", session, active="/ui/cache")
    stats = cache.stats()
    counters: dict[str, Any] = stats.get("counters", {})
    hits, misses = counters.get("hits", 0), counters.get("misses", 0)
    rate = hits / (hits + misses) if hits + misses else None
    sizes = [(esc(k), esc(v)) for k, v in stats.items() if not isinstance(v, dict)]
    body = (
        f'<section class="card"><dl><dt>Hit rate</dt><dd id="hit-rate">{_pct(rate)}</dd>'
        f"<dt>Hits / misses</dt><dd>{hits:,} / {misses:,}</dd></dl></section>"
        + table(("Figure", "Value"), sizes, id_="cache-sizes")
        + "<h2>Counters</h2>" + table(("Counter", "Value"), [(esc(k), esc(v)) for k, v in counters.items()])
        + "<h2>Policies</h2>" + table(("Model group", "Policy"), [
            (esc(name), f"<code>{esc(p)}</code>") for name, p in stats.get("policies", {}).items()
        ], numeric_from=99, empty="No group has a cache policy.")
    )
    if session.may_change:
        body += (
            '<h2>Purge</h2><form id="purge-cache" class="card" data-api-method="DELETE" data-api-path="/admin/cache" '
            'data-query data-confirm="Purge these cached answers on every replica?">'
            '<label for="f-group">Model group</label><input id="f-group" name="group">'
            '<label for="f-subject">Subject (UUID)</label><input id="f-subject" name="subject">'
            '<label for="f-all"><input id="f-all" name="all" type="checkbox" value="true"> Everything</label>'
            '<button type="submit" class="danger">Purge</button></form><p id="form-status" role="status"></p>'
        )
    return page("Cache", body, session, active="/ui/cache")


@console_page
async def audit_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/audit?action=&api_key_id=&after=``: the trail, newest first, 50 a page."""
    action = request.query.get("action") or None
    message = ""
    key_id = after = None
    if action is not None and action not in ACTIONS:
        message, action = "unknown action", None
    try:
        key_id = uuid.UUID(request.query["api_key_id"]) if request.query.get("api_key_id") else None
        after = int(request.query["after"]) if request.query.get("after") else None
    except ValueError:
        message = "api_key_id must be a UUID and after a number"
    entries = await AuditLog(request.app[STATE].pool).page(limit=51, after=after, api_key_id=key_id, action=action)
    shown = entries[:50]
    options = "".join(
        f'<option value="{a}"{" selected" if a == action else ""}>{a or "any"}</option>' for a in ("", *ACTIONS)
    )
    form = (
        '<form method="get" action="/ui/audit" class="filters">'
        f'<label for="action">Action</label><select id="action" name="action">{options}</select>'
        f'<label for="api_key_id">Key id</label><input id="api_key_id" name="api_key_id" '
        f'value="{esc(key_id or "")}"><button type="submit">Filter</button></form>'
    )
    rows = [
        (esc(e.at.strftime("%Y-%m-%d %H:%M:%S")), esc(e.actor), esc(e.action),
         f'<a href="/ui/keys/{e.api_key_id}"><code>{esc(str(e.api_key_id)[:8])}</code></a>' if e.api_key_id else "—",
         f"<code>{esc(detail_json(e.detail))}</code>", esc(e.remote))
        for e in shown
    ]
    more = ""
    if len(entries) > 50:
        more_q = urlencode({"after": shown[-1].audit_id, **{k: str(v) for k, v in (
            ("action", action), ("api_key_id", key_id)) if v}})
        more = f'<p><a href="/ui/audit?{esc(more_q)}">Older entries</a></p>'
    body = ((f'<p class="error" role="alert">{esc(message)}</p>' if message else "") + form
            + table(("When (UTC)", "Who", "Action", "Key", "Detail", "From"), rows, numeric_from=99, id_="audit")
            + more)
    return page("Audit", body, session, active="/ui/audit")


def dashboard_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/ui/", overview)
    router.add_get("/ui/usage", usage_page)
    router.add_get("/ui/usage.csv", usage_csv)
    router.add_get("/ui/providers", providers_page)
    router.add_get("/ui/cache", cache_page)
    router.add_get("/ui/audit", audit_page)
