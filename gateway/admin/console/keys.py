"""The Keys and Subjects pages: list, search, create, edit, revoke, rotate; budgets.

Reads go through the same stores as the admin API (:class:`gateway.auth.keys.KeyStore`,
:func:`gateway.billing.budgets.fetch_spend`). Changes are made by the page's script
calling the admin API itself (``POST /admin/keys``, ``PATCH``, ``/revoke``,
``/rotate``, ``PUT /admin/budgets/...``) with the session and its CSRF token, so each
one is checked, role-enforced and audited exactly as a curl call would be.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from aiohttp import web

from gateway.admin.audit import AuditLog
from gateway.admin.console.auth import console_page
from gateway.admin.console.figures import midnight
from gateway.admin.console.layout import detail_json, esc, money, page, table
from gateway.admin.session import Session
from gateway.auth.keys import BUDGET_PERIODS, KEY_STATES, KeyNotFound, KeyRecord
from gateway.billing.budgets import SubjectBudgetStore, fetch_spend
from gateway.billing.reports import UsageQuery, usage_report
from gateway.http.state import STATE

__all__ = ["key_routes"]

#: At most this many keys are listed (newest first); the search narrows them.
MAX_LISTED = 500


def _when(value: datetime | None) -> str:
    return esc(value.strftime("%Y-%m-%d %H:%M UTC")) if value else "—"


def _limits(r: KeyRecord) -> str:
    p = r.policy
    parts = [f"{p.rate_limit_requests}/{p.rate_limit_window_seconds}s"]
    if p.tokens_per_minute:
        parts.append(f"{p.tokens_per_minute} tpm")
    if p.max_concurrent:
        parts.append(f"{p.max_concurrent} concurrent")
    return esc(", ".join(parts))


def _budget(r: KeyRecord) -> str:
    p = r.policy
    return esc(f"{money(float(p.budget_usd))} / {p.budget_period}") if p.budget_usd is not None else "—"


def _field(name: str, label: str, *, kind: str = "text", value: str = "", hint: str = "", data: str = "",
           required: bool = False) -> str:
    return (
        f'<label for="f-{name}">{esc(label)}</label>'
        f'<input id="f-{name}" name="{name}" type="{kind}" value="{esc(value)}"{" required" if required else ""}'
        f'{f" data-type={data}" if data else ""}{" step=any" if kind == "number" else ""}>'
        + (f'<small>{esc(hint)}</small>' if hint else "")
    )


def _period_select(value: str | None, *, name: str = "budget_period") -> str:
    options = "".join(
        f'<option value="{p}"{" selected" if p == value else ""}>{p}</option>' for p in ("", *BUDGET_PERIODS)
    )
    return f'<label for="f-{name}">Budget period</label><select id="f-{name}" name="{name}">{options}</select>'


def _policy_fields(r: KeyRecord | None) -> str:
    p = r.policy if r is not None else None
    models = ",".join(p.allowed_models) if p is not None and p.allowed_models is not None else ""
    return "".join((
        _field("rate_limit_requests", "Requests per window", kind="number", data="int",
               value=str(p.rate_limit_requests) if p else ""),
        _field("rate_limit_window_seconds", "Window (seconds)", kind="number", data="int",
               value=str(p.rate_limit_window_seconds) if p else ""),
        _field("tokens_per_minute", "Tokens per minute", kind="number", data="int",
               value=str(p.tokens_per_minute or "") if p else "", hint="empty: no limit"),
        _field("max_concurrent", "Concurrent requests", kind="number", data="int",
               value=str(p.max_concurrent or "") if p else "", hint="empty: no limit"),
        _field("budget_usd", "Budget (USD)", kind="number", data="number",
               value=str(p.budget_usd) if p and p.budget_usd is not None else "", hint="empty: none"),
        _period_select(p.budget_period if p else None),
        _field("allowed_models", "Allowed models", data="list", value=models,
               hint="comma-separated; empty: every model"),
    ))


@console_page
async def keys_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/keys?q=&state=&subject_id=``: search and filter, and a create form."""
    q = request.query.get("q", "").strip().lower()
    state = request.query.get("state") or None
    subject_raw = request.query.get("subject_id", "").strip()
    message = ""
    subject_id = None
    if state not in (None, *KEY_STATES):
        message, state = f"state must be one of {', '.join(KEY_STATES)}", None
    if subject_raw:
        try:
            subject_id = uuid.UUID(subject_raw)
        except ValueError:
            message = "subject must be a UUID"
    records = await request.app[STATE].keys.list(subject_id=subject_id, state=state, limit=MAX_LISTED + 1)
    truncated = len(records) > MAX_LISTED
    records = records[:MAX_LISTED]
    if q:
        records = [r for r in records if q in r.name.lower() or q in r.key_prefix.lower() or q in str(r.api_key_id)]
    rows = [
        (
            f'<a href="/ui/keys/{r.api_key_id}">{esc(r.name)}</a>',
            f"<code>{esc(r.key_prefix)}</code>",
            f'<span class="state state-{esc(r.state)}">{esc(r.state)}</span>',
            f'<a href="/ui/keys?subject_id={r.subject_id}"><code>{esc(str(r.subject_id)[:8])}</code></a>',
            _limits(r), _budget(r), _when(r.last_used_at), _when(r.expires_at),
        )
        for r in records
    ]
    state_options = "".join(
        f'<option value="{s}"{" selected" if s == (state or "") else ""}>{s or "any"}</option>' for s in ("", *KEY_STATES)
    )
    search = (
        '<form method="get" action="/ui/keys" class="filters" role="search">'
        f'<label for="q">Search</label><input id="q" name="q" value="{esc(q)}" placeholder="name, prefix or id">'
        f'<label for="state">State</label><select id="state" name="state">{state_options}</select>'
        f'<label for="subject_id">Subject</label><input id="subject_id" name="subject_id" value="{esc(subject_raw)}" '
        'placeholder="UUID"><button type="submit">Filter</button></form>'
    )
    create = ""
    if session.may_change:
        create = (
            '<details class="card"><summary>Create a key</summary>'
            '<form id="create-key" data-api-method="POST" data-api-path="/admin/keys" data-show-key>'
            + _field("name", "Name", required=True)
            + _field("subject_id", "Subject (UUID)", hint="empty: a new subject")
            + _policy_fields(None)
            + _field("expires_in_days", "Expires in (days)", kind="number", data="int", hint="empty: never")
            + '<button type="submit" class="primary">Create</button></form></details>'
        )
    body = (
        (f'<p class="error" role="alert">{esc(message)}</p>' if message else "")
        + search + create + _raw_key_panel()
        + f'<p class="count">{len(records)} key(s)'
        + (f" (the newest {MAX_LISTED}: narrow by subject or state to see others)" if truncated else "") + "</p>"
        + table(("Name", "Prefix", "State", "Subject", "Limits", "Budget", "Last used", "Expires"), rows,
                numeric_from=99, id_="keys", empty="No key matches.")
    )
    return page("Keys", body, session, active="/ui/keys")


def _raw_key_panel() -> str:
    """Where the script shows a new raw key, once, with a copy button."""
    return (
        '<section id="raw-key" class="card notice" hidden aria-live="polite">'
        "<h2>Copy the new key now</h2><p>It is shown this once; the gateway keeps only its hash.</p>"
        '<p><code id="raw-key-value"></code> <button type="button" id="copy-key">Copy</button> '
        '<span id="copy-state"></span></p><p><a id="raw-key-link" href="/ui/keys">Done</a></p></section>'
    )


@console_page
async def key_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/keys/{id}``: one key, its usage over 7 days, its audit trail, and changes."""
    state = request.app[STATE]
    try:
        record = await state.keys.get(str(uuid.UUID(request.match_info["id"])))
    except (ValueError, KeyNotFound):
        return page("Key not found", '<p><a href="/ui/keys">Back to the keys</a></p>', session, active="/ui/keys")
    week = midnight(datetime.now(timezone.utc).date() - timedelta(days=6))
    usage = await usage_report(state.pool, UsageQuery(group_by="model", since=week, api_key_id=record.api_key_id))
    trail = await AuditLog(state.pool).page(limit=20, api_key_id=record.api_key_id)
    facts = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in (
        ("Id", f"<code>{record.api_key_id}</code>"), ("Prefix", f"<code>{esc(record.key_prefix)}</code>"),
        ("State", f'<span class="state state-{esc(record.state)}">{esc(record.state)}</span>'),
        ("Subject", f'<a href="/ui/keys?subject_id={record.subject_id}"><code>{record.subject_id}</code></a>'),
        ("Limits", _limits(record)), ("Budget", _budget(record)),
        ("Models", esc(", ".join(record.policy.allowed_models)) if record.policy.allowed_models is not None else "any"),
        ("Created", _when(record.created_at)), ("Last used", _when(record.last_used_at)),
        ("Expires", _when(record.expires_at)), ("Revoked", _when(record.revoked_at)),
    ))
    actions = ""
    path = f"/admin/keys/{record.api_key_id}"
    if session.may_change:
        actions = (
            '<div class="actions">'
            f'<details class="card"><summary>Edit</summary><form id="edit-key" data-api-method="PATCH" data-api-path="{path}">'
            + _field("name", "Name", value=record.name, required=True) + _policy_fields(record)
            + _field("expires_at", "Expires at (ISO 8601)", value=record.expires_at.isoformat() if record.expires_at else "",
                     hint="empty: never")
            + '<button type="submit" class="primary">Save</button></form></details>'
            f'<details class="card"><summary>Rotate</summary><form id="rotate-key" data-api-method="POST" '
            f'data-api-path="{path}/rotate" data-show-key>'
            + _field("grace_seconds", "Old key keeps working for (seconds)", kind="number", data="int", value="0",
                     hint="0: revoked at once")
            + _field("reason", "Reason")
            + '<button type="submit">Rotate</button></form></details>'
            f'<form id="revoke-key" class="card" data-api-method="POST" data-api-path="{path}/revoke" '
            'data-confirm="Revoke this key? Calls with it are refused within a second.">'
            + _field("reason", "Reason for revoking")
            + '<button type="submit" class="danger">Revoke</button></form></div>'
        )
    body = (
        f'<dl class="facts">{facts}</dl><p id="form-status" role="status"></p>{_raw_key_panel()}{actions}'
        "<h2>Usage, last 7 days</h2>"
        + table(("Model", "Requests", "Errors", "Tokens in", "Tokens out", "Cost"), [
            (esc(r.group), str(r.requests), str(r.errors), str(r.prompt_tokens), str(r.completion_tokens),
             money(float(r.cost_usd))) for r in usage.rows
        ], empty="No calls in the last 7 days.")
        + "<h2>Audit</h2>"
        + table(("When", "Who", "Action", "Detail"), [
            (_when(e.at), esc(e.actor), esc(e.action), f"<code>{esc(detail_json(e.detail))}</code>") for e in trail
        ], numeric_from=99)
    )
    return page(f"Key {record.name}", body, session, active="/ui/keys")


@console_page
async def subjects_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/subjects``: spend against budget per subject and per key, with the period."""
    state = request.app[STATE]
    spend = await fetch_spend(state.pool)
    budgets = {b.subject_id: b for b in await SubjectBudgetStore(state.pool).list()}

    def meter(spent: float, budget: float) -> str:
        return (f'<meter min="0" max="{budget}" high="{budget * 0.8}" value="{min(spent, budget)}">'
                f"{spent:.2f}</meter>")

    subject_rows = []
    for subject_id, (subject_budget, period) in sorted(spend.subject_budgets.items(), key=lambda kv: str(kv[0])):
        # Budgets are exact (Decimal); the page shows dollars and cents.
        budget, spent = float(subject_budget), float(spend.subject_spend.get(subject_id, 0))
        updated = budgets[subject_id].updated_at if subject_id in budgets else None
        subject_rows.append((
            f'<a href="/ui/keys?subject_id={subject_id}"><code>{subject_id}</code></a>', esc(period),
            money(spent), money(budget), meter(spent, budget), _when(updated),
        ))
    keys = {r.api_key_id: r for r in await state.keys.list(state="active", limit=MAX_LISTED)}
    key_rows = []
    for key_id, key_spent in sorted(spend.key_spend.items(), key=lambda kv: -kv[1]):
        spent = float(key_spent)
        r = keys.get(key_id)
        if r is None or r.policy.budget_usd is None:
            continue
        budget = float(r.policy.budget_usd)
        key_rows.append((
            f'<a href="/ui/keys/{key_id}">{esc(r.name)}</a> <code>{esc(r.key_prefix)}</code>',
            esc(r.policy.budget_period), money(spent), money(budget), meter(spent, budget), _when(None),
        ))
    form = ""
    if session.may_change:
        form = (
            '<details class="card"><summary>Set a subject budget</summary>'
            '<form id="set-budget" data-api-method="PUT" data-api-path="/admin/budgets/{subject_id}">'
            + _field("subject_id", "Subject (UUID)", required=True, data="path")
            + _field("budget_usd", "Budget (USD)", kind="number", data="number", required=True)
            + _period_select("month")
            + '<button type="submit" class="primary">Save</button></form></details>'
        )
    body = (
        form + '<p id="form-status" role="status"></p>'
        "<h2>Subjects with a budget</h2>"
        + table(("Subject", "Period", "Spent", "Budget", "Used", "Budget set"), subject_rows, numeric_from=2,
                id_="subjects", empty="No subject has a budget.")
        + "<h2>Keys with a budget</h2>"
        + table(("Key", "Period", "Spent", "Budget", "Used", ""), key_rows, numeric_from=2, id_="key-budgets",
                empty="No active key has a budget.")
        + "<p><small>Spent: the ledger's spend in the budget's current period (UTC day, month, or all time).</small></p>"
    )
    return page("Subjects and budgets", body, session, active="/ui/subjects")


def key_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/ui/keys", keys_page)
    router.add_get("/ui/keys/{id}", key_page)
    router.add_get("/ui/subjects", subjects_page)
