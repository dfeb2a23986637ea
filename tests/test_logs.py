"""Structured logs: one JSON access line per request, request ids on errors, no secrets."""

from __future__ import annotations

import contextlib
import io
import logging
import logging.handlers
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import orjson
import pytest

from gateway.observability.logs import (
    ACCESS_LOGGER,
    JsonFormatter,
    LogSetup,
    Redactor,
    TextFormatter,
    bind_request_id,
    configure_logging,
    log_fields,
    reset_request_id,
)
from tests.conftest import REPO, FakeUpstream, Gateway, auth, chat_body, config_for

PROVIDER_SECRET = "sk-fake-provider-secret"  # what config_for gives the fake provider


@contextlib.contextmanager
def json_logs(level: str = "info") -> Iterator[tuple[io.StringIO, LogSetup]]:
    """Logging as ``serve`` configures it, written to a buffer; the old setup restored after."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    setup = configure_logging(level, "json", stream=out)
    try:
        yield out, setup
    finally:
        setup.stop()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    formatter = JsonFormatter()
    return [orjson.loads(formatter.format(r)) for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_one_access_line_per_request(
    gateway: Gateway, fake: FakeUpstream, key_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raw, key = await key_factory(name="logged")
    caplog.set_level(logging.DEBUG)
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body("log me"), headers={**auth(raw), "x-request-id": "req-1"})
    usage = (await resp.json())["usage"]
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body("stream me", stream=True), headers={**auth(raw), "x-request-id": "req-2"})
    await resp.read()
    await gateway.data.post("/v1/chat/completions", json=chat_body(), headers={**auth("llmg_" + "z" * 43), "x-request-id": "req-3"})
    await gateway.data.get("/healthz", headers={"x-request-id": "req-4"})

    lines = {line["request_id"]: line for line in access_lines(caplog)}
    assert set(lines) == {"req-1", "req-2", "req-3", "req-4"}
    whole = lines["req-1"]
    assert whole["logger"] == ACCESS_LOGGER and whole["msg"] == "access"
    assert whole["key_id"] == str(key.api_key_id)
    assert whole["model"] == "test-model" and whole["provider"] == "fake" and whole["status"] == 200
    assert whole["input_tokens"] == usage["prompt_tokens"] and whole["output_tokens"] == usage["completion_tokens"]
    assert whole["latency_ms"] > 0 and whole["cost_usd"] == 0.0 and whole["route"] == "/v1/chat/completions"
    stream = lines["req-2"]
    assert stream["stream"] is True and stream["ttft_ms"] > 0 and stream["output_tokens"] > 0
    refused = lines["req-3"]
    assert refused["status"] == 401 and "key_id" not in refused
    assert lines["req-4"]["route"] == "/healthz" and lines["req-4"]["status"] == 200
    # Never the key, at any level, in any logger.
    everything = "\n".join(JsonFormatter().format(r) for r in caplog.records)
    assert raw not in everything and raw[:20] not in everything and PROVIDER_SECRET not in everything


async def test_every_authenticated_route_names_the_key_on_its_access_line(
    gateway: Gateway, key_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raw, key = await key_factory(name="logged-everywhere", rate_limit_requests=4)
    caplog.set_level(logging.INFO)
    calls = [
        ("GET", "/v1/models", None, "models"),
        ("POST", "/v1/embeddings", {"model": "emb", "input": "hi"}, "embeddings"),
        ("POST", "/v1/chat/completions", {"model": "m"}, "refused-body"),  # 400 after the key was verified
        ("POST", "/v1/embeddings", {"model": "emb"}, "refused-embeddings"),
        ("GET", "/v1/models", None, "rate-limited"),  # the fifth request of a 4-per-window key
    ]
    for method, path, body, request_id in calls:
        resp = await gateway.data.request(method, path, json=body, headers={**auth(raw), "x-request-id": request_id})
        await resp.read()
    await gateway.data.get("/v1/models", headers={"x-request-id": "no-key"})
    lines = {line["request_id"]: line for line in access_lines(caplog)}
    statuses = {rid: lines[rid]["status"] for _, _, _, rid in calls}
    assert statuses == {"models": 200, "embeddings": 200, "refused-body": 400, "refused-embeddings": 400, "rate-limited": 429}
    for _, _, _, rid in calls:
        assert lines[rid]["key_id"] == str(key.api_key_id), rid
    assert lines["no-key"]["status"] == 401 and "key_id" not in lines["no-key"]
    everything = "\n".join(JsonFormatter().format(r) for r in caplog.records)
    assert raw not in everything


async def test_errors_carry_the_request_id(gateway: Gateway, api_key: str) -> None:
    def broken_listener(_record: Any) -> None:
        raise RuntimeError(f"listener saw key {api_key}")

    gateway.state.call_listeners.append(broken_listener)
    with json_logs() as (out, _):
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers={**auth(api_key), "x-request-id": "oops-1"})
        assert resp.status == 200  # a listener never fails the request it observes
    lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    [line] = [x for x in lines if x["level"] == "error"]
    assert line["request_id"] == "oops-1" and line["level"] == "error"
    assert "RuntimeError" in line["exception"]
    assert api_key not in line["exception"] and "llmg_[REDACTED]" in line["exception"]


def test_redactor_masks_keys_tokens_and_known_secrets() -> None:
    redact = Redactor(["hunter2-admin-token", "abc"])  # too short to mask safely: ignored
    text = ("key llmg_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcdefg, Authorization: Bearer eyJhbGciOi.x.y, "
            "provider sk-proj-1234567890abcdef, admin hunter2-admin-token, prefix llmg_AbCdEfG, abc")
    out = redact(text)
    for secret in ("AbCdEfGhIjKlMnOp", "eyJhbGciOi", "sk-proj-1234567890", "hunter2-admin-token"):
        assert secret not in out
    assert "llmg_AbCdEfG," in out  # a 12-character prefix is not a secret (key listings show it)
    assert out.endswith(", abc")


def test_a_bearer_token_is_masked_however_the_word_is_cased() -> None:
    # The pattern is case-insensitive; the cheap pre-check before it must be too.
    redact = Redactor()
    for word in ("Bearer", "bearer", "BEARER", "BeArEr", "bEARER"):
        out = redact(f"Authorization: {word} tok-abcdefghij123")
        assert out == "Authorization: Bearer [REDACTED]", word


def test_known_secrets_holding_a_marker_are_masked_whole() -> None:
    # Secrets with "sk-" or "llmg_" in them are searched only in texts holding that marker:
    # found whole (not as the pattern's "sk-[REDACTED]"), and the patterns still apply after.
    redact = Redactor(["sk-live-provider-key-0001", "llmg_operator_token_0000000000", "plain-admin-secret"])
    text = ("a sk-live-provider-key-0001 b llmg_operator_token_0000000000 c plain-admin-secret "
            "d Bearer abcdefghijkl e sk-otherkey12345678")
    assert redact(text) == "a [REDACTED] b [REDACTED] c [REDACTED] d Bearer [REDACTED] e sk-[REDACTED]"
    assert redact("only sk-live-provider-key-0001 here") == "only [REDACTED] here"
    assert redact('json "sk-live-provider-key-0001"') == 'json "[REDACTED]"'
    assert redact("nothing secret, no marker") == "nothing secret, no marker"


def test_redacting_a_json_line_gives_what_the_general_redactor_gives() -> None:
    # json_line skips scans a line orjson made cannot need; the result must be __call__'s.
    import random

    rng = random.Random(23)
    secrets = ["sk-live-provider-key-0001", "llmg_operator_token_0000000000", "plain-admin-secret",
               'quo"ted-secret', "sk-", "bearer-like-secret", "ünïcode-secret"]
    # Raw pieces of field values: markers, spaces and other whitespace (escaped or not by
    # orjson), control characters (a \x1b before "earer" reads "\u001bearer" once escaped),
    # non-ASCII, quotes and backslashes.
    pieces = ["sk-", "llmg_", "Bearer ", "bEaReR\t", "bearer", "\x1bearer ", "\x08earer ", " ", "\n", "\t", "é",
              "\xa0", "\u2003", "\x85", "\x1c", "abcdefghijkl0123", "[REDACTED]", "=", "s", "k-", "llmg",
              "_AbCdEfGhIjKlMnOpQr", '"', "\\", *secrets]
    for redactor in (Redactor(), Redactor(secrets), Redactor(secrets[:3])):
        for _ in range(4000):
            fields = {
                rng.choice(["a", "sk-key", "note", "bearer"]) + str(i): "".join(
                    rng.choice(pieces) for _ in range(rng.randrange(6)))
                for i in range(rng.randrange(4))
            }
            line = orjson.dumps(fields).decode()
            assert redactor.json_line(line) == redactor(line), line


def test_formatters_redact_messages_fields_and_tracebacks() -> None:
    redactor = Redactor(["hunter2-admin-token"])
    try:
        raise ValueError("token hunter2-admin-token leaked")
    except ValueError:
        record = logging.getLogger("t").makeRecord(
            "t", logging.ERROR, __file__, 1, "bad %s", ("Bearer abcdefghijkl",), exc_info=sys.exc_info(),
            extra={"fields": {"note": "llmg_AbCdEfGhIjKlMnOpQrStUvWx"}},
        )
    for formatter in (JsonFormatter(redactor), TextFormatter(redactor)):
        out = formatter.format(record)
        assert "hunter2" not in out and "abcdefghijkl" not in out and "AbCdEfGhIjKlMnOp" not in out
    line = orjson.loads(JsonFormatter(redactor).format(record))
    assert line["msg"] == "bad Bearer [REDACTED]" and line["note"] == "llmg_[REDACTED]"


def test_configure_logging_writes_json_lines_off_the_calling_thread() -> None:
    with json_logs("debug") as (out, setup):
        [handoff] = logging.getLogger().handlers
        assert isinstance(handoff, logging.handlers.QueueHandler)  # a writer thread does the I/O
        setup.add_secrets(["the-admin-token-value"])
        logging.getLogger("gateway.test").info("hello %s", "the-admin-token-value", extra={"fields": {"n": 1}})
    [line] = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert line["msg"] == "hello [REDACTED]" and line["n"] == 1 and line["logger"] == "gateway.test"
    with pytest.raises(ValueError):
        configure_logging("info", "xml")


async def test_log_fields_writes_the_line_logger_info_would_and_stays_visible_to_other_handlers() -> None:
    fields = {"status": 200, "key_id": "k-1", "cost_usd": 0.25, "note": "sk-abcdefghijklmnop"}
    logger = logging.getLogger("gateway.test.fields")
    with json_logs() as (out, _setup):
        token = bind_request_id("req-fast")
        try:
            log_fields(logger, "access", fields)  # the hand-off alone: built and batched directly
            logger.info("access", extra={"fields": fields})  # the standard path, for comparison
            seen: list[logging.LogRecord] = []
            other = logging.Handler()
            other.emit = seen.append  # type: ignore[method-assign]
            logger.addHandler(other)  # another handler attached: the standard path, so it sees the line
            try:
                log_fields(logger, "access", {"status": 201})
            finally:
                logger.removeHandler(other)
            logger.setLevel(logging.WARNING)
            try:
                log_fields(logger, "access", {"status": 202})  # below the level: nothing
            finally:
                logger.setLevel(logging.NOTSET)
        finally:
            reset_request_id(token)
    fast, standard, third = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert fast["ts"][:16] == standard["ts"][:16]
    del fast["ts"], standard["ts"]
    assert fast == standard
    assert fast["request_id"] == "req-fast" and fast["note"] == "sk-[REDACTED]" and fast["level"] == "info"
    assert third["status"] == 201 and [r.fields for r in seen] == [{"status": 201}]  # type: ignore[attr-defined]


@pytest.mark.parametrize("request_id", [None, "req-ctx"])
async def test_log_fields_lines_are_the_standard_lines_byte_for_byte(request_id: str | None) -> None:
    key = uuid.UUID("12345678-1234-5678-1234-567812345678")
    cases: list[dict[str, Any]] = [
        {},
        {"request_id": "req-field", "status": 200, "key_id": key},  # the access line's shape
        {"api_key_id": str(key), "request_id": "req-field", "cost_usd": Decimal("0.25")},  # the billing line's
        {"status": 200, "note": "sk-abcdefghijklmnop", "admin": "the-admin-token-value", "quote": 'a"b\\c\n'},
        {"msg": "a field named like the head", "level": "warning", "n": 1},
    ]
    logger = logging.getLogger("gateway.test.bytes")
    with json_logs() as (out, setup):
        setup.add_secrets(["the-admin-token-value"])
        token = bind_request_id(request_id) if request_id is not None else None
        try:
            for fields in cases:
                log_fields(logger, "line", dict(fields))  # the hand-off alone: made on the loop
                logger.info("line", extra={"fields": dict(fields)})  # the writer's formatter
        finally:
            if token is not None:
                reset_request_id(token)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 * len(cases)
    untimed = [re.sub(r'^\{"ts":"[^"]*"', "", line) for line in lines]
    for fast, standard in zip(untimed[::2], untimed[1::2], strict=True):
        assert fast == standard
    assert "the-admin-token-value" not in out.getvalue() and "abcdefghijklmnop" not in out.getvalue()
    first = orjson.loads(lines[2])
    assert list(first)[:5] == ["ts", "level", "logger", "msg", "request_id"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])


async def test_log_fields_in_the_text_format_writes_the_standard_line() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    setup = configure_logging("info", "text", stream=out)
    try:
        from gateway.observability.logs import hand_off_fields

        # The lines are not made by the gateway's JSON writer: hand_off_fields takes none.
        assert not hand_off_fields(logging.getLogger("gateway.test.text"), "access", {"status": 200})
        log_fields(logging.getLogger("gateway.test.text"), "access", {"status": 200, "key": "sk-abcdefghijklmnop"})
    finally:
        setup.stop()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
    [line] = out.getvalue().splitlines()
    assert line.endswith("INFO gateway.test.text: access status=200 key=sk-[REDACTED]"), line


async def test_served_process_logs_json_without_secrets(process_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    admin_token = "admin-token-that-must-not-leak"
    gp = await process_factory(
        env={"LOG_LEVEL": "debug", "ADMIN_TOKEN": admin_token, "PYTHONPATH": str(REPO)},
        config_yaml=config_for(fake.url),
    )
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for i in range(2):
            async with session.post(f"{gp.url}/v1/chat/completions", json=chat_body(f"hi {i}"),
                                    headers={**auth(api_key), "x-request-id": f"proc-{i}"}) as r:
                assert r.status == 200
        async with session.post(f"{gp.url}/v1/chat/completions", json=chat_body(),
                                headers={"Authorization": f"Bearer {admin_token}"}) as r:
            assert r.status == 401
    gp.signal(signal.SIGTERM)
    assert gp.wait(timeout=30) == 0
    log = gp.log()
    json_lines = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    access = [line for line in json_lines if line["logger"] == ACCESS_LOGGER]
    assert {a["request_id"] for a in access} >= {"proc-0", "proc-1"}
    assert all(set(a) >= {"ts", "level", "request_id", "status", "latency_ms"} for a in access)
    assert api_key not in log and admin_token not in log and PROVIDER_SECRET not in log


@pytest.mark.parametrize("request_id", [None, "req-ctx"])
async def test_the_billing_line_is_the_line_of_its_standard_fields_byte_for_byte(request_id: str | None) -> None:
    # _log_billing builds its fields the cheap way when the line is made on the loop (ids
    # as they are, in the line's order); the reference is its old payload, logged by logging.
    from asyncpg.pgproto.pgproto import UUID as PgUUID

    from actors.billing import _log_billing
    from gateway.billing.ledger import NIL_UUID, UsageEvent

    def reference(event: UsageEvent) -> None:
        logging.getLogger("gateway.billing").info("billing", extra={"fields": {
            "api_key_id": str(event.api_key_id), "subject_id": str(event.subject_id),
            "request_id": event.request_id, "response_id": event.response_id, "model": event.requested_model,
            "served_model": event.served_model, "provider": event.provider, "prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens, "cost_usd": event.cost_usd, "cost_diem": event.cost_diem,
            "cost_source": event.cost_source, "status": event.status,
        }})  # the writer's formatter: the line as logging makes it

    def event(api_key_id: Any, subject_id: Any, **changes: Any) -> UsageEvent:
        values: dict[str, Any] = dict(
            call_id=uuid.uuid4(), request_id="req-field", response_id="chatcmpl-1", api_key_id=api_key_id,
            subject_id=subject_id, requested_model="fast-model", served_model="fast-model-2024", provider="fast",
            deployment="fast/fast-model", prompt_tokens=14, completion_tokens=9, usage_estimated=False,
            cost_usd=3.2e-05, cost_diem=None, cost_source="price", latency_seconds=0.001, ttft_seconds=None,
            status=200, outcome="ok", streamed=False, retries=0, failovers=0, error_type=None, finish_reason="stop",
            created_at=1.5e9,
        )
        values.update(changes)
        return UsageEvent(**values)

    events = [
        event(uuid.uuid4(), uuid.uuid4()),
        event(PgUUID(str(uuid.uuid4())), PgUUID(str(uuid.uuid4()))),  # the key cache's ids
        event(NIL_UUID, NIL_UUID, response_id=None, served_model=None, provider=None, cost_diem=0.5,
              cost_usd=0.0, cost_source="unpriced", status=502),
        event(uuid.uuid4(), PgUUID(str(uuid.uuid4())), request_id='odd "id"\\\n é', requested_model="sk-abcdefghijklmnop",
              served_model="Bearer abcdefghijkl", cost_usd=1e-300, prompt_tokens=2**31 - 1),
    ]
    with json_logs() as (out, setup):
        setup.add_secrets(["fast-model-2024"])
        token = bind_request_id(request_id) if request_id is not None else None
        try:
            for one in events:
                _log_billing(one.row())  # the loop's own way, from the row
                reference(one)
        finally:
            if token is not None:
                reset_request_id(token)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 * len(events)
    untimed = [re.sub(r'^\{"ts":"[^"]*"', "", line) for line in lines]
    for fast, standard in zip(untimed[::2], untimed[1::2], strict=True):
        assert fast == standard
    assert '"logger":"gateway.billing","msg":"billing"' in lines[0]
    assert list(orjson.loads(lines[0]))[4] == ("request_id" if request_id else "api_key_id")


def test_a_change_of_logging_after_a_line_was_made_here_is_seen_at_the_next_line() -> None:
    # Whether a line may be made on the loop is remembered per logger (the walk of the
    # logger tree is not repeated per line): every change the walk would see, made after
    # the answer was remembered, in place or by assignment, must be seen at once.
    from gateway.observability import logs

    parent = logging.getLogger("gateway.test.memo")
    logger = logging.getLogger("gateway.test.memo.child")
    root = logging.getLogger()
    other = logging.Handler()
    only_a = logging.Filter("a")
    elsewhere = logging.getLogger("gateway.test.memo_elsewhere")

    def add_handler(node: logging.Logger) -> Any:
        node.addHandler(other)
        return lambda: node.removeHandler(other)

    def append_handler(node: logging.Logger) -> Any:
        node.handlers.append(other)
        return lambda: node.handlers.remove(other)

    def add_filter(node: logging.Filterer) -> Any:
        node.addFilter(only_a)
        return lambda: node.removeFilter(only_a)

    def set_attribute(node: Any, name: str, value: Any) -> Any:
        old = getattr(node, name)
        setattr(node, name, value)
        return lambda: setattr(node, name, old)

    with json_logs():
        handoff = logs._installed
        assert handoff is not None
        changes = [
            lambda: add_handler(logger), lambda: add_handler(parent), lambda: add_handler(root),
            lambda: append_handler(logger), lambda: append_handler(parent), lambda: append_handler(root),
            lambda: add_filter(logger), lambda: add_filter(parent), lambda: add_filter(root), lambda: add_filter(handoff),
            lambda: set_attribute(logger, "disabled", True), lambda: set_attribute(parent, "disabled", True),
            lambda: set_attribute(root, "disabled", True),
            lambda: set_attribute(logger, "propagate", False), lambda: set_attribute(parent, "propagate", False),
            lambda: set_attribute(handoff, "level", logging.WARNING),
            lambda: set_attribute(root, "handlers", [other]),
            lambda: set_attribute(logger, "parent", elsewhere),  # a parent with a handler of its own
        ]
        elsewhere.addHandler(other)
        try:
            for change in changes:
                assert logs.lines_made_here(logger)  # remembered (again)
                undo = change()
                try:
                    assert not logs.lines_made_here(logger) and not logs._walk(logger, handoff)
                    assert not logs.lines_made_here(logger)
                finally:
                    undo()
            assert logs.lines_made_here(logger)
            set_attribute(logger, "parent", root)  # a shorter chain than remembered, still only the hand-off
            assert logs.lines_made_here(logger) and logs.lines_made_here(logger)
        finally:
            elsewhere.removeHandler(other)
            logger.parent = parent
        assert logs.lines_made_here(logger)
        outer = logs._installed
        with json_logs():  # a setup inside (lines go to its hand-off), then the outer's again...
            assert logs._installed is not outer
        # ...whose hand-off is the root's again, but not the one lines are made for (the
        # inner's, stopped): the standard path, as the walk says, not the outer's remembered yes.
        assert logs._installed is not outer and logging.getLogger().handlers == [outer]
        assert not logs.lines_made_here(logger)
    assert not logs.lines_made_here(logger)  # another setup: the hand-off is no longer the root's


def test_lines_batched_on_a_loop_that_ended_are_written_before_the_next_line_in_order() -> None:
    # A batch is begun on a loop; that loop ends before its flush timer. A line logged
    # afterwards (no loop, or another loop on the same thread) must not join the dead
    # loop's batch: the batch goes first, then the line, nothing lost.
    import asyncio

    logger = logging.getLogger("gateway.test.batches")

    async def on_a_loop(n: int) -> None:
        log_fields(logger, "batched", {"n": n})
        log_fields(logger, "batched", {"n": n + 1})

    with json_logs() as (out, setup):
        asyncio.run(on_a_loop(0))
        log_fields(logger, "after", {"n": 2})  # no loop: written at once, after the batch
        asyncio.run(on_a_loop(3))
        asyncio.run(on_a_loop(5))  # a new loop on the same thread, the old batch still pending
        setup.stop()
        lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert [line["n"] for line in lines] == [0, 1, 2, 3, 4, 5, 6]


def test_a_line_from_another_thread_leaves_the_loops_batch_alone_and_nothing_is_lost() -> None:
    # The loop's batch is its own: a line logged on another thread (a span exporter's
    # warning, a worker's) is handed over by itself and never swaps the batch out from
    # under the loop, which could otherwise append a line to a list already handed over.
    import asyncio
    import threading

    from gateway.observability import logs

    logger = logging.getLogger("gateway.test.threads")

    async def on_a_loop() -> list[Any]:
        log_fields(logger, "loop", {"n": 0})
        assert logs._installed is not None
        batch = logs._installed._batch
        pending = list(batch)
        worker = threading.Thread(target=lambda: logger.warning("from another thread"))
        worker.start()
        worker.join()
        assert logs._installed._batch is batch and list(batch) == pending  # not flushed by the other thread
        log_fields(logger, "loop", {"n": 1})
        return list(batch)

    with json_logs() as (out, setup):
        batched = asyncio.run(on_a_loop())
        setup.stop()
        lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert len(batched) == 2
    assert sorted(line["msg"] for line in lines) == ["from another thread", "loop", "loop"]
    assert [line["n"] for line in lines if line["msg"] == "loop"] == [0, 1]


@pytest.mark.parametrize("bound", [False, True])
async def test_the_access_line_is_the_line_of_its_fields_byte_for_byte(monkeypatch: pytest.MonkeyPatch, bound: bool) -> None:
    # The access line's fields are handed over as they are (hand_off_fields); the
    # reference is the same fields logged by logging (the writer's formatter).
    from aiohttp.test_utils import make_mocked_request

    from gateway.core.usage import CallRecord, Usage
    from gateway.edge import telemetry
    from gateway.http.middleware import request_id_of
    from gateway.observability import logs

    handed: list[dict[str, Any]] = []
    real = logs.hand_off_fields

    def spy(logger: logging.Logger, msg: str, fields: dict[str, Any]) -> bool:
        handed.append(dict(fields))
        return real(logger, msg, fields)

    monkeypatch.setattr(logs, "hand_off_fields", spy)
    access = logging.getLogger(ACCESS_LOGGER)
    requests = []
    for headers, record in (
        ({"x-request-id": "plain-1"}, None),
        ({}, CallRecord(request_id="r", api_key_id=uuid.uuid4(), subject_id=uuid.uuid4(), requested_model="m é",
                        served_model='odd "served"', provider="sk-abcdefghijklmnop", usage=Usage(14, 9), ttft=0.0123456)),
        ({}, CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model="Bearer abcdefghijkl x",
                        outcome="cut", error_type="_StreamCut", retries=2, failovers=1)),
    ):
        request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
        if record is not None:
            request[telemetry.CALL_RECORD] = record
        requests.append(request)
    key_only = make_mocked_request("GET", "/v1/models")
    key_only[telemetry.KEY_ID] = uuid.uuid4()
    requests.append(key_only)
    with json_logs() as (out, setup):
        setup.add_secrets(["the-admin-token-value"])
        for request in requests:
            token = bind_request_id(request_id_of(request)) if bound else None
            try:
                telemetry._access_line(request, request_id_of(request), "/v1/chat/completions", 200, 0.0123)
                access.info("access", extra={"fields": handed[-1]})
            finally:
                if token is not None:
                    reset_request_id(token)
    lines = out.getvalue().splitlines()
    assert len(handed) == len(requests) and len(lines) == 2 * len(requests)
    untimed = [re.sub(r'^\{"ts":"[^"]*"', "", line) for line in lines]
    for fast, standard in zip(untimed[::2], untimed[1::2], strict=True):
        assert fast == standard
    assert "abcdefghijklmnop" not in out.getvalue() and "abcdefghijkl x" not in out.getvalue()


def test_the_billing_line_through_the_standard_path_has_every_field_in_order() -> None:
    # Where the line is not made on the loop (here a handler of the logger's own), its fields
    # go to logging as a dict: every field, its ledger column's value, ids as text, in order.
    from actors.billing import _log_billing
    from gateway.billing.ledger import UsageEvent

    key, subject = uuid.uuid4(), uuid.uuid4()
    event = UsageEvent(
        call_id=uuid.uuid4(), request_id="req-std", response_id="chatcmpl-9", api_key_id=key, subject_id=subject,
        requested_model="asked", served_model="served", provider="prov", deployment="prov/served",
        prompt_tokens=3, completion_tokens=4, usage_estimated=False, cost_usd=1e-05, cost_diem=0.25,
        cost_source="price", latency_seconds=0.01, ttft_seconds=None, status=200, outcome="ok", streamed=False,
        retries=0, failovers=0, error_type=None, finish_reason="stop", created_at=1.5e9,
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("gateway.billing")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        _log_billing(event.row())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (record,) = records
    assert list(record.fields.items()) == [  # type: ignore[attr-defined]
        ("api_key_id", str(key)), ("subject_id", str(subject)), ("request_id", "req-std"),
        ("response_id", "chatcmpl-9"), ("model", "asked"), ("served_model", "served"), ("provider", "prov"),
        ("prompt_tokens", 3), ("completion_tokens", 4), ("cost_usd", 1e-05), ("cost_diem", 0.25),
        ("cost_source", "price"), ("status", 200),
    ]


def test_a_batch_of_line_parts_is_written_as_each_line_made_and_redacted_alone() -> None:
    # hand_off_fields hands the writer a line's parts; the writer makes a batch's lines
    # and redacts them with one scan of the batch (Redactor.keeps_json_lines), each line
    # alone only when that finds something. The text must be JsonFormatter.ordered_line's,
    # line by line, in order with the records and ready lines around them.
    import random

    from gateway.observability.logs import _write_batch

    rng = random.Random(29)
    secrets = ["sk-live-provider-key-0001", "llmg_operator_token_0000000000", "plain-admin-secret", 'quo"ted-secret']
    clean = ["abc", "0123", "-", "_", "/v1/chat", "é", "\u2003", "\\", '"', "x-y_z", "Bear", "er"]
    risky = ["sk-", "llmg_", "Bearer ", "bEaReR\t", " ", "abcdefghijkl0123", "sk-abcdefghij", *secrets]
    redactor = Redactor(secrets)
    formatter = JsonFormatter(redactor)
    for _ in range(400):
        pieces = clean if rng.random() < 0.5 else clean + risky
        records: list[Any] = []
        expected: list[str] = []
        for _ in range(rng.randrange(1, 12)):
            created = 1_700_000_000 + rng.random() * 3
            if rng.random() < 0.8:
                fields: dict[str, Any] = {
                    "k" + str(i): rng.choice([None, 3, 1.5, uuid.UUID(int=i), Decimal("0.25"),
                                              "".join(rng.choice(pieces) for _ in range(rng.randrange(4)))])
                    for i in range(rng.randrange(4))
                }
                name, msg = rng.choice([("gateway.access", "access"), ("gateway.billing", "billing"),
                                        ("gateway.x", "".join(rng.choice(pieces) for _ in range(2)))])
                records.append((name, msg, fields, created))
                expected.append(formatter.ordered_line(name, msg, fields, created))
            elif rng.random() < 0.5:
                record = logging.makeLogRecord({"name": "gateway.other", "msg": rng.choice(pieces) + " said",
                                                "levelno": logging.WARNING, "levelname": "WARNING", "created": created})
                records.append(record)
                expected.append(formatter.format(record))
            else:
                ready = formatter.ordered_line("gateway.ready", "ready", {"n": rng.choice(pieces)}, created)
                records.append(ready)
                expected.append(ready)
        out = io.StringIO()
        handler = logging.StreamHandler(out)
        handler.setFormatter(formatter)
        _write_batch(handler, records)
        assert out.getvalue().splitlines() == expected


def test_a_line_whose_parts_cannot_be_encoded_is_reported_and_the_rest_of_its_batch_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gateway.observability.logs import _write_batch

    formatter = JsonFormatter(Redactor(["plain-admin-secret"]))
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    good = ("gateway.access", "access", {"n": 1, "note": "plain-admin-secret"}, 1_700_000_000.5)
    unencodable: dict[Any, Any] = {1: "not a str key"}
    _write_batch(handler, [good, ("gateway.access", "access", unencodable, 1_700_000_000.6), "ready", good])
    line = formatter.ordered_line(*good)
    assert out.getvalue() == f"{line}\nready\n{line}\n" and "[REDACTED]" in line
    assert "Logging error" in capsys.readouterr().err


def test_line_parts_handed_over_off_any_loop_are_written_at_once_in_order_with_records() -> None:
    # Off an event loop (no batch), hand_off_fields' parts go to the writer by themselves,
    # between the records logged before and after them, and a stop writes them all.
    from gateway.observability.logs import hand_off_fields

    logger = logging.getLogger("gateway.test.parts")
    with json_logs() as (out, setup):
        logger.info("before")
        assert hand_off_fields(logger, "parts", {"n": 1})
        logger.info("after")
        assert hand_off_fields(logger, "parts", {"n": 2})
        setup.stop()
        lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert [(line["msg"], line.get("n")) for line in lines] == [("before", None), ("parts", 1), ("after", None), ("parts", 2)]


def test_a_full_batch_of_line_parts_is_handed_over_at_once_and_every_line_written_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from gateway.observability import logs

    monkeypatch.setattr(logs, "MAX_BATCH", 3)
    logger = logging.getLogger("gateway.test.full")

    async def on_a_loop() -> int:
        for n in range(7):
            assert logs.hand_off_fields(logger, "parts", {"n": n})
        assert logs._installed is not None
        return len(logs._installed._batch)

    with json_logs() as (out, setup):
        assert asyncio.run(on_a_loop()) == 1  # two full batches went, the seventh line waits
        setup.stop()
        lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert [line["n"] for line in lines] == list(range(7))
