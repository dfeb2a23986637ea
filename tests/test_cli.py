"""The ``llm-gateway`` command (contract §1-§2), run as a real process (``python -m gateway``).

keys create|list|revoke|rotate (with a grace period) and their ``--json`` shapes, migrate (idempotent, safe
when several run at once), one-line failures without tracebacks, ``serve`` refusing a
bad environment, and the embedded PostgreSQL with its development key.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from gateway.auth.keys import DEV_KEY
from gateway.core.db import migrations_dir
from tests.conftest import REPO, Gateway, _with_db, auth, chat_body, sse_payloads

#: Variables of contract §3 that must not leak from the developer's shell into these runs.
_CONTRACT_VARS = (
    "DATABASE_URL", "DATABASE_URL_FILE", "REDIS_URL", "GATEWAY_CONFIG", "VENICE_API_KEY",
    "VENICE_API_KEY_FILE", "VENICE_BASE_URL", "ADMIN_TOKEN", "BIND_ADDR", "MANAGEMENT_BIND_ADDR",
    "REQUEST_TIMEOUT_SECONDS", "REQUEST_BODY_LIMIT_BYTES", "SHUTDOWN_GRACE_SECONDS",
    "MANAGEMENT_CORS_ORIGINS", "CORS_ALLOWED_ORIGINS", "LLM_GATEWAY_HOME",
)
KEY_SHAPE = re.compile(r"llmg_[A-Za-z0-9_-]{43,}")


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str

    def one_line_error(self) -> str:
        """The single stderr line of a failed command (asserts the contract's shape)."""
        assert self.rc != 0, f"expected a failure, got rc=0: {self.stdout!r}"
        assert "Traceback" not in self.stderr, self.stderr
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, f"expected one line, got {lines!r}"
        return lines[0]


def cli_env(home: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in _CONTRACT_VARS and not k.startswith("OTEL_")}
    return {
        **base,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "LLM_GATEWAY_HOME": str(home),
        **env,
    }


@pytest.fixture
def run_cli(tmp_path: Path, database_url: str) -> Any:
    """``await run_cli("keys", "list", env={...})`` → Run; DATABASE_URL is the test database."""

    async def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
        environ = cli_env(tmp_path / "home", **{"DATABASE_URL": database_url, **(env or {})})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", *args, env=environ, cwd=str(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        assert proc.returncode is not None
        return Run(proc.returncode, out.decode(), err.decode())

    return run


@pytest.fixture
def fresh_database(pg_admin_dsn: str) -> Iterator[str]:
    """An empty database (no migrations), dropped afterwards."""
    name = f"llmg_cli_{uuid.uuid4().hex[:10]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(pg_admin_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    yield _with_db(pg_admin_dsn, name)
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


# ----------------------------------------------------------------------------- keys
async def test_keys_create_prints_the_key_once_in_the_contract_shape(
    run_cli: Any, db_pool: asyncpg.Pool, gateway: Gateway
) -> None:
    run = await run_cli("keys", "create", "--name", "ci", "--json")
    assert run.rc == 0, run.stderr
    created = json.loads(run.stdout)
    raw = created["api_key"]
    assert KEY_SHAPE.fullmatch(raw)
    assert created["key_prefix"] == raw[:12]
    assert created["name"] == "ci" and created["state"] == "active"
    assert created["rate_limit_requests"] == 60 and created["rate_limit_window_seconds"] == 60
    uuid.UUID(created["api_key_id"]), uuid.UUID(created["subject_id"])
    assert "key_hash" not in created
    row = await db_pool.fetchrow("SELECT * FROM api_keys WHERE api_key_id = $1", uuid.UUID(created["api_key_id"]))
    assert bytes(row["key_hash"]) == hashlib.sha256(raw.encode()).digest()
    assert not any(raw in str(value) for value in dict(row).values())  # never stored raw
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
    assert resp.status == 200


async def test_keys_create_takes_every_policy_option(run_cli: Any) -> None:
    subject = str(uuid.uuid4())
    run = await run_cli(
        "keys", "create", "--name", "full", "--subject", subject, "--rpm", "10", "--window-seconds", "30",
        "--tpm", "1000", "--max-concurrent", "2", "--budget-usd", "5.5", "--budget-period", "day",
        "--models", "gpt-4o, venice/*", "--expires-in-days", "3", "--json",
    )
    assert run.rc == 0, run.stderr
    created = json.loads(run.stdout)
    assert created["subject_id"] == subject
    assert (created["rate_limit_requests"], created["rate_limit_window_seconds"]) == (10, 30)
    assert (created["tokens_per_minute"], created["max_concurrent"]) == (1000, 2)
    assert (created["budget_usd"], created["budget_period"]) == (5.5, "day")
    assert created["allowed_models"] == ["gpt-4o", "venice/*"]
    expires = datetime.fromisoformat(created["expires_at"])
    assert abs(expires - (datetime.now(timezone.utc) + timedelta(days=3))) < timedelta(minutes=5)
    monthly = json.loads((await run_cli("keys", "create", "--name", "m", "--budget-usd", "1", "--json")).stdout)
    assert monthly["budget_period"] == "month"  # a budget without a period is monthly


async def test_keys_create_without_json_prints_only_the_key_on_stdout(run_cli: Any) -> None:
    run = await run_cli("keys", "create", "--name", "plain")
    assert run.rc == 0, run.stderr
    assert KEY_SHAPE.fullmatch(run.stdout.strip())
    assert "not shown again" in run.stderr and run.stdout.strip()[:12] in run.stderr


async def test_keys_list_shows_state_but_never_a_hash_or_raw_key(run_cli: Any, db_pool: asyncpg.Pool) -> None:
    active = json.loads((await run_cli("keys", "create", "--name", "listed-active", "--json")).stdout)
    revoked = json.loads((await run_cli("keys", "create", "--name", "listed-revoked", "--json")).stdout)
    assert (await run_cli("keys", "revoke", revoked["api_key_id"])).rc == 0
    run = await run_cli("keys", "list", "--json")
    assert run.rc == 0, run.stderr
    listed = {k["api_key_id"]: k for k in json.loads(run.stdout)}
    assert listed[active["api_key_id"]]["state"] == "active"
    assert listed[revoked["api_key_id"]]["state"] == "revoked"
    assert listed[active["api_key_id"]]["key_prefix"] == active["api_key"][:12]
    secrets = []
    for created in (active, revoked):
        digest = hashlib.sha256(created["api_key"].encode()).digest()
        secrets += [created["api_key"], created["api_key"][12:], digest.hex()]
    for entry in listed.values():
        assert "api_key" not in entry and "key_hash" not in entry
    text = await run_cli("keys", "list")
    assert text.rc == 0 and active["api_key"][:12] in text.stdout and "listed-revoked" in text.stdout
    for output in (run.stdout, text.stdout):
        assert not any(secret in output for secret in secrets)


async def test_keys_revoke_by_id_or_prefix_and_twice(run_cli: Any, db_pool: asyncpg.Pool) -> None:
    by_id = json.loads((await run_cli("keys", "create", "--name", "revoke-id", "--json")).stdout)
    by_prefix = json.loads((await run_cli("keys", "create", "--name", "revoke-prefix", "--json")).stdout)
    run = await run_cli("keys", "revoke", by_id["api_key_id"])
    assert run.rc == 0 and run.stdout.strip() == f"revoked {by_id['api_key_id']} ({by_id['key_prefix']})"
    assert (await run_cli("keys", "revoke", by_prefix["key_prefix"])).rc == 0
    rows = await db_pool.fetch(
        "SELECT is_active, revoked_at FROM api_keys WHERE api_key_id = ANY($1::uuid[])",
        [by_id["api_key_id"], by_prefix["api_key_id"]],
    )
    assert len(rows) == 2 and all(not r["is_active"] and r["revoked_at"] is not None for r in rows)
    first_revoked_at = await db_pool.fetchval(
        "SELECT revoked_at FROM api_keys WHERE api_key_id = $1", uuid.UUID(by_id["api_key_id"])
    )
    assert (await run_cli("keys", "revoke", by_id["api_key_id"])).rc == 0  # idempotent
    assert await db_pool.fetchval(
        "SELECT revoked_at FROM api_keys WHERE api_key_id = $1", uuid.UUID(by_id["api_key_id"])
    ) == first_revoked_at


async def test_keys_rotate_keeps_subject_and_limits_and_revokes_the_old_key(
    run_cli: Any, gateway: Gateway
) -> None:
    old = json.loads((await run_cli(
        "keys", "create", "--name", "rotating", "--rpm", "17", "--tpm", "900", "--models", "m1", "--json",
    )).stdout)
    run = await run_cli("keys", "rotate", old["key_prefix"], "--json")
    assert run.rc == 0, run.stderr
    new = json.loads(run.stdout)
    assert KEY_SHAPE.fullmatch(new["api_key"]) and new["api_key"] != old["api_key"]
    assert new["api_key_id"] != old["api_key_id"] and new["key_prefix"] == new["api_key"][:12]
    for field in ("subject_id", "name", "rate_limit_requests", "tokens_per_minute", "allowed_models"):
        assert new[field] == old[field], field
    listed = {k["api_key_id"]: k["state"] for k in json.loads((await run_cli("keys", "list", "--json")).stdout)}
    assert listed[old["api_key_id"]] == "revoked" and listed[new["api_key_id"]] == "active"
    body = chat_body(model="m1")
    assert (await gateway.data.post("/v1/chat/completions", json=body, headers=auth(new["api_key"]))).status == 200
    assert (await gateway.data.post("/v1/chat/completions", json=body, headers=auth(old["api_key"]))).status == 401
    again = await run_cli("keys", "rotate", old["api_key_id"])
    assert "revoked key cannot be rotated" in again.one_line_error()


async def test_keys_rotate_with_grace_keeps_the_old_key_working_until_it_ends(
    run_cli: Any, gateway: Gateway, db_pool: asyncpg.Pool
) -> None:
    old = json.loads((await run_cli("keys", "create", "--name", "graceful", "--json")).stdout)
    before = datetime.now(timezone.utc)
    run = await run_cli("keys", "rotate", old["key_prefix"], "--grace-seconds", "3600", "--json")
    assert run.rc == 0, run.stderr
    new = json.loads(run.stdout)
    previous = new["previous"]  # the shape POST /admin/keys/{id}/rotate answers
    assert previous["api_key_id"] == old["api_key_id"] and previous["state"] == "active"
    ends = datetime.fromisoformat(previous["expires_at"])
    assert before + timedelta(seconds=3600) <= ends <= datetime.now(timezone.utc) + timedelta(seconds=3600)
    assert previous["revoked_at"] is None and new["expires_at"] is None  # the new key never expires
    for raw in (old["api_key"], new["api_key"]):
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
        assert resp.status == 200
    # The grace ends (moved to the past rather than waiting an hour): only the new key works.
    await db_pool.execute(
        "UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE api_key_id = $1",
        uuid.UUID(old["api_key_id"]),
    )
    for _ in range(100):  # bounded: the change reaches the gateway's key cache within a second
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(old["api_key"]))
        if resp.status == 401:
            break
        await asyncio.sleep(0.05)
    assert resp.status == 401
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(new["api_key"]))
    assert resp.status == 200

    # Without --json: the new key on stdout, and when the old one stops on stderr.
    other = json.loads((await run_cli("keys", "create", "--name", "graceful-2", "--json")).stdout)
    run = await run_cli("keys", "rotate", other["api_key_id"], "--grace-seconds", "60")
    assert run.rc == 0 and KEY_SHAPE.fullmatch(run.stdout.strip())
    assert f"the old key {other['key_prefix']} keeps working until" in run.stderr
    # 0 is the default: revoked at once.
    run = await run_cli("keys", "rotate", other["api_key_id"], "--grace-seconds", "0", "--json")
    assert json.loads(run.stdout)["previous"]["state"] == "revoked"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("keys", "rotate", "llmg_abcdefg", "--grace-seconds", "-1"), "--grace-seconds"),
        (("keys", "rotate", "llmg_abcdefg", "--grace-seconds", "2592001"), "--grace-seconds"),
        (("keys", "rotate", "llmg_abcdefg", "--grace-seconds", "soon"), "--grace-seconds"),
        (("keys", "create", "--name", "x", "--rpm", "0"), "--rpm"),
        (("keys", "create", "--name", "x", "--rpm", "many"), "--rpm"),
        (("keys", "create", "--name", "x", "--rpm", "99999999999"), "--rpm"),
        (("keys", "create", "--name", "x", "--budget-usd", "-1"), "--budget-usd"),
        (("keys", "create", "--name", "x", "--subject", "not-a-uuid"), "--subject"),
        (("keys", "create", "--name", "x", "--expires-in-days", "99999999"), "--expires-in-days"),
        (("keys", "create", "--rpm", "5"), "--name"),
        (("keys", "create", "--name", "  "), "not blank"),
        (("keys", "revoke", str(uuid.UUID(int=1))), "no key with id or prefix"),
        (("keys", "rotate", "llmg_nothing"), "no key with id or prefix"),
        (("keys", "remove", "x"), "invalid choice"),
        ((), "COMMAND"),
    ],
)
async def test_bad_input_is_one_clear_line_without_a_traceback(run_cli: Any, args: tuple[str, ...], says: str) -> None:
    run = await run_cli(*args)
    assert says in run.one_line_error()
    assert run.stdout == ""


async def test_an_unreachable_database_is_one_line_for_every_command(run_cli: Any) -> None:
    nowhere = {"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none"}
    commands = [("migrate",), ("keys", "list"), ("keys", "create", "--name", "x"),
                ("keys", "revoke", "llmg_abcdefg"), ("keys", "rotate", "llmg_abcdefg"), ("serve",)]
    runs = await asyncio.gather(*(run_cli(*c, env=nowhere) for c in commands))
    for command, run in zip(commands, runs, strict=True):
        assert "cannot connect to the database" in run.one_line_error(), command


# ----------------------------------------------------------------------------- migrate
async def _applied(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations ORDER BY name")]
    finally:
        await conn.close()


async def test_migrate_applies_each_file_once_and_is_idempotent(run_cli: Any, fresh_database: str) -> None:
    expected = sorted(p.name for p in migrations_dir().glob("*.sql"))
    first = await run_cli("migrate", env={"DATABASE_URL": fresh_database})
    assert first.rc == 0, first.stderr
    assert first.stdout.strip() == f"applied {len(expected)} migration(s): " + ", ".join(expected)
    second = await run_cli("migrate", env={"DATABASE_URL": fresh_database})
    assert second.rc == 0 and second.stdout.strip() == "applied 0 migration(s)"
    assert await _applied(fresh_database) == expected


async def test_concurrent_migrations_apply_each_file_exactly_once(run_cli: Any, fresh_database: str) -> None:
    expected = sorted(p.name for p in migrations_dir().glob("*.sql"))
    runs = await asyncio.gather(*(run_cli("migrate", env={"DATABASE_URL": fresh_database}) for _ in range(3)))
    assert all(r.rc == 0 for r in runs), [r.stderr for r in runs]
    counts = [int(re.match(r"applied (\d+) migration", r.stdout).group(1)) for r in runs]  # type: ignore[union-attr]
    assert sum(counts) == len(expected)  # one replica did the work; the others found it done
    assert await _applied(fresh_database) == expected
    created = await run_cli("keys", "create", "--name", "after", "--json", env={"DATABASE_URL": fresh_database})
    assert created.rc == 0, created.stderr


# ----------------------------------------------------------------------------- serve
@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"BIND_ADDR": "nope"}, "BIND_ADDR"),
        ({"MANAGEMENT_BIND_ADDR": "127.0.0.1:99999"}, "MANAGEMENT_BIND_ADDR"),
        ({"REQUEST_TIMEOUT_SECONDS": "abc"}, "REQUEST_TIMEOUT_SECONDS"),
        ({"REQUEST_BODY_LIMIT_BYTES": "1.5"}, "REQUEST_BODY_LIMIT_BYTES"),
        ({"SHUTDOWN_GRACE_SECONDS": "-1"}, "SHUTDOWN_GRACE_SECONDS"),
        ({"MANAGEMENT_CORS_ORIGINS": "*"}, "MANAGEMENT_CORS_ORIGINS"),
        ({"CAPTURE_GENAI_CONTENT": "maybe"}, "CAPTURE_GENAI_CONTENT"),
        ({"DATABASE_URL": "mysql://db/x"}, "DATABASE_URL"),
        ({"GATEWAY_CONFIG": "/nonexistent/gateway.yaml"}, "GATEWAY_CONFIG"),
    ],
)
async def test_serve_refuses_a_bad_environment_with_one_line_naming_the_variable(
    run_cli: Any, env: dict[str, str], variable: str
) -> None:
    run = await run_cli("serve", env=env, timeout=30)
    line = run.one_line_error()
    assert variable in line and "configuration error" in line


async def test_serve_refuses_a_bad_config_file_with_the_path_of_the_entry(run_cli: Any, tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "providers: {up: {type: openai, base_url: 'http://127.0.0.1:9'}}\n"
        "models:\n  - {name: m, deployments: [{provider: up, model: a}, {provider: x, model: b}]}\n"
    )
    run = await run_cli("serve", env={"GATEWAY_CONFIG": str(config)}, timeout=30)
    assert "models[0].deployments[1].provider: unknown provider 'x'" in run.one_line_error()


async def test_serve_on_a_busy_port_is_one_line(run_cli: Any) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The addresses are checked before anything starts or logs (tests/test_front_door.py).
        run = await run_cli("serve", "--log-level", "warning",
                            env={"BIND_ADDR": f"127.0.0.1:{port}", "MANAGEMENT_BIND_ADDR": "127.0.0.1:0"})
    assert run.one_line_error() == f"llm-gateway: BIND_ADDR 127.0.0.1:{port} is in use (set BIND_ADDR to another port)"


async def test_serve_with_a_database_url_never_seeds_the_development_key(
    process_factory: Any, db_pool: asyncpg.Pool
) -> None:
    gp = await process_factory()
    async with aiohttp.ClientSession() as session, session.get(
        f"{gp.url}/v1/models", headers=auth(DEV_KEY)
    ) as resp:
        assert resp.status == 401
    assert DEV_KEY not in gp.log()
    assert await db_pool.fetchval("SELECT count(*) FROM api_keys WHERE key_prefix = $1", DEV_KEY[:12]) == 0


@pytest.fixture
def embedded_home() -> Iterator[Path]:
    """A data directory under /tmp (as root, pgserver opens up every parent directory's
    permissions, so never one under a home or pytest's private directory); its PostgreSQL
    is stopped and the directory removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="llmg-embedded-", dir="/tmp"))
    yield home
    pid_file = home / "pgdata" / "postmaster.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text().split()[0])
        try:
            os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast" shutdown
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.05)
        except ProcessLookupError:
            pass
    shutil.rmtree(home, ignore_errors=True)


async def test_serve_without_a_database_url_runs_embedded_postgres_with_the_dev_key(
    process_factory: Any, embedded_home: Path
) -> None:
    pytest.importorskip("pgserver", reason="no embedded PostgreSQL on this platform")
    env = {"DATABASE_URL": "", "LLM_GATEWAY_HOME": str(embedded_home), "VENICE_API_KEY": "", "XDG_RUNTIME_DIR": ""}
    gp = await process_factory(env=env)
    assert f"seeded development key: {DEV_KEY}" in gp.log()
    # pgserver's import warns about XDG_RUNTIME_DIR wherever it is unset (root, containers).
    assert "Warning" not in gp.log() and "XDG_RUNTIME_DIR" not in gp.log(), gp.log()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gp.url}/v1/chat/completions", json=chat_body("offline"), headers=auth(DEV_KEY)) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["total_tokens"] > 0  # the mock provider, no network
        async with session.post(
            f"{gp.url}/v1/chat/completions", json=chat_body("offline", stream=True), headers=auth(DEV_KEY)
        ) as r:
            assert r.status == 200 and sse_payloads(await r.read())[-1] == b"[DONE]"
    gp.signal(signal.SIGTERM)
    assert await asyncio.to_thread(gp.wait, 30) == 0
    # A second start reuses the same server and key, and does not seed it again.
    again = await process_factory(env=env)
    assert f"development key: {DEV_KEY}" in again.log() and "seeded" not in again.log()
    again.signal(signal.SIGTERM)
    assert await asyncio.to_thread(again.wait, 30) == 0

