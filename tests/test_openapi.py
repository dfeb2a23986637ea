"""The OpenAPI documents stay true: every route is documented (and vice versa), and
schemathesis calls every operation of both planes with generated input, finding no
server error and no answer the document does not describe.

Schemathesis is synchronous (requests); the gateway runs in-process on the test's event
loop, so each run goes to a worker thread while the loop serves it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from aiohttp import web

from gateway.edge.openapi import data_plane_document, management_document
from tests.conftest import FakeUpstream, Gateway, auth, config_for

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

ADMIN_TOKEN = "openapi-admin-token-0123456789abcdef"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
#: Examples per operation and generation mode: enough to find crashes, quick on 2 cores.
EXAMPLES = 15


def registered_routes(app: web.Application) -> set[tuple[str, str]]:
    """(METHOD, path template) of every route; HEAD twins of GET routes left out."""
    routes = set()
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        routes.add((route.method, route.resource.canonical))
    return routes


def documented_routes(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


@pytest.fixture
async def admin_gateway(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> Gateway:
    # Request logs on, so GET /admin/requests/{request_id} has a stored call to answer.
    config = config_for(fake.url, request_logs={"models": ["*"]})
    return await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config)  # type: ignore[no-any-return]


@pytest.mark.parametrize("plane", ["data", "management"])
async def test_every_route_is_documented_and_every_documented_route_exists(admin_gateway: Gateway, plane: str) -> None:
    client = admin_gateway.data if plane == "data" else admin_gateway.management
    resp = await client.get("/openapi.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    served = await resp.json()
    assert served == (data_plane_document() if plane == "data" else management_document())
    assert served["openapi"].startswith("3.1")
    registered = registered_routes(client.server.app)
    documented = documented_routes(served)
    missing = registered - documented
    assert not missing, f"routes not in gateway/edge/openapi.py ({plane} plane): {sorted(missing)}"
    stale = documented - registered
    assert not stale, f"documented but not registered ({plane} plane): {sorted(stale)}"
    # Every operation has an id and at least one documented answer.
    for path, item in served["paths"].items():
        for method, op in item.items():
            if method in HTTP_METHODS:
                assert op["operationId"] and op["responses"], (method, path)


async def test_no_admin_path_in_the_data_plane_document() -> None:
    assert not [p for p in data_plane_document()["paths"] if p.startswith("/admin")]


@dataclass
class FuzzReport:
    """What a schemathesis run saw: failures, and the statuses each operation answered."""

    failures: list[str] = field(default_factory=list)
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))

    def unreached(self) -> list[str]:
        """Operations that never answered 2xx: the fuzz never got past their checks."""
        return sorted(op for op, seen in self.statuses.items() if not any(200 <= s < 300 for s in seen))


def _fuzz(
    document: dict[str, Any], base_url: str, headers: dict[str, str],
    fresh: dict[str, Callable[[], str | dict[str, str]]] | None = None,
) -> FuzzReport:
    """Run every operation in both generation modes, and once more with each path
    parameter named in ``fresh`` (``{id}``: a key, ``{subject_id}``: a subject with a
    budget) made real by its factory (random ids only ever meet a 404). A factory may
    make several parameters real at once by answering them as a mapping."""
    schema = schemathesis.openapi.from_dict(document)
    session = requests.Session()
    report = FuzzReport()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    for result in schema.get_all_operations():
        operation = result.ok()
        if "console" in (operation.definition.raw.get("tags") or []):
            # The console's HTML pages want a browser session, not a bearer token: they
            # are driven by tests/test_console.py and tests/test_console_browser.py.
            continue
        runs: list[tuple[GenerationMode, dict[str, str] | None]] = [
            (GenerationMode.POSITIVE, None), (GenerationMode.NEGATIVE, None),
        ]
        for name, make in (fresh or {}).items():
            if "{" + name + "}" in operation.path:
                made = make()
                runs.append((GenerationMode.POSITIVE, made if isinstance(made, dict) else {name: made}))
        for mode, path_parameters in runs:
            mode_checks = [*checks, negative_data_rejection] if mode is GenerationMode.NEGATIVE else checks
            call = _property(
                operation.as_strategy(generation_mode=mode, path_parameters=path_parameters),
                lambda case, label=operation.label, checks_now=mode_checks: _call_and_check(
                    case, label, checks_now, base_url, headers, session, report
                ),
            )
            try:
                call()
            except Unsatisfiable:
                continue  # nothing to negate (no parameters, no body): positive mode covered it
            except Exception as exc:
                report.failures.append(f"{operation.label} [{mode.value}]: {str(exc)[:1500]}")
    session.close()
    return report


def _property(strategy: Any, test: Callable[[Any], None]) -> Callable[[], None]:
    """``test`` as a bounded, deterministic Hypothesis property over ``strategy`` (no shrinking)."""

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        test(case)

    return run  # type: ignore[no-any-return]


def _call_and_check(
    case: Any, label: str, checks: list[Any], base_url: str, headers: dict[str, str],
    session: requests.Session, report: FuzzReport,
) -> None:
    if case.headers is not None and not any(name.lower() == "authorization" for name in case.headers):
        # A negative case that left the required Authorization out must go without it;
        # adding ours back turned "missing header" into an accepted request.
        headers = {name: value for name, value in headers.items() if name.lower() != "authorization"}
    response = case.call(base_url=base_url, headers=headers, session=session, timeout=10)
    report.statuses[label][response.status_code] += 1
    case.validate_response(response, checks=checks, headers=headers)


def _create_key_over_http(base_url: str) -> str:
    resp = requests.post(f"{base_url}/admin/keys", json={"name": "fuzz-target"}, headers=auth(ADMIN_TOKEN), timeout=10)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["api_key_id"])


def _create_response_over_http(base_url: str, key: str) -> str:
    resp = requests.post(f"{base_url}/v1/responses", json={"model": "m", "input": "fuzz me"}, headers=auth(key),
                         timeout=10)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


def _create_request_log_over_http(base_url: str, data_url: str) -> str:
    """A chat call with a new key, stored by the request logs; its request id once readable."""
    made = requests.post(f"{base_url}/admin/keys", json={"name": "fuzz-logged"}, headers=auth(ADMIN_TOKEN), timeout=10)
    assert made.status_code == 201, made.text
    request_id = f"fuzz-{uuid.uuid4().hex[:12]}"
    resp = requests.post(f"{data_url}/v1/chat/completions", timeout=10,
                         json={"model": "m", "messages": [{"role": "user", "content": "fuzz me"}]},
                         headers={**auth(made.json()["api_key"]), "x-request-id": request_id})
    assert resp.status_code == 200, resp.text
    for _ in range(100):  # shipped within the ship interval (0.1 s)
        if requests.get(f"{base_url}/admin/requests/{request_id}", headers=auth(ADMIN_TOKEN), timeout=10).ok:
            return request_id
        time.sleep(0.05)
    raise AssertionError(f"request log {request_id} never stored")


def _create_budget_over_http(base_url: str) -> str:
    subject = str(uuid.uuid4())
    resp = requests.put(f"{base_url}/admin/budgets/{subject}", json={"budget_usd": 1}, headers=auth(ADMIN_TOKEN), timeout=10)
    assert resp.status_code == 201, resp.text
    return subject


async def test_schemathesis_finds_no_server_error_on_the_management_plane(admin_gateway: Gateway) -> None:
    base_url = str(admin_gateway.management.make_url("")).rstrip("/")
    data_url = str(admin_gateway.data.make_url("")).rstrip("/")
    report = await asyncio.to_thread(
        _fuzz, management_document(), base_url, auth(ADMIN_TOKEN), {
            "id": lambda: _create_key_over_http(base_url),
            "subject_id": lambda: _create_budget_over_http(base_url),
            "request_id": lambda: _create_request_log_over_http(base_url, data_url),
        },
    )
    assert not report.failures, "\n\n".join(report.failures)
    assert not report.unreached(), f"never answered 2xx: {report.unreached()} ({dict(report.statuses)})"


async def test_schemathesis_finds_no_server_error_on_the_data_plane(admin_gateway: Gateway, key_factory: Any) -> None:
    raw, _ = await key_factory(rate_limit_requests=1_000_000)
    base_url = str(admin_gateway.data.make_url("")).rstrip("/")
    # /passthrough/{provider}/{path}: the configured provider's echo route answers any method.
    real = {"provider": lambda: {"provider": "fake", "path": "echo"},
            # /v1/responses/{response_id}: a response stored by this key's subject.
            "response_id": lambda: _create_response_over_http(base_url, raw)}
    report = await asyncio.to_thread(_fuzz, data_plane_document(), base_url, auth(raw), real)
    assert not report.failures, "\n\n".join(report.failures)
    assert not report.unreached(), f"never answered 2xx: {report.unreached()} ({dict(report.statuses)})"
