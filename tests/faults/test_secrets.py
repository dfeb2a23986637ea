"""Secrets: a representative session scanned for every secret it knows, the constant-
time comparisons of keys and the admin token, and a provider key rotated through its
file without a restart.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from actors.auth import Unauthenticated
from gateway.admin.routes import AdminAuth, AdminUnauthorized
from gateway.testing.fake_provider import STATE_KEY, FakeConfig
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for
from tests.faults.conftest import NO_IP_GUARD
from tests.otlp import OtlpReceiver


def _dsn_with_password(dsn: str, password: str) -> str:
    """The test database's DSN with a password added (trust auth ignores it; the gateway
    still holds it as a secret)."""
    scheme, rest = dsn.split("://", 1)
    userinfo, host = rest.split("@", 1) if "@" in rest else ("postgres", rest)
    return f"{scheme}://{userinfo.split(':')[0]}:{password}@{host}"


async def test_a_representative_session_leaks_no_secret_anywhere(
    process_factory: Any, fake_factory: Any, api_key: str, database_url: str
) -> None:
    """Fault: none; the adversary is whoever reads the logs, the metrics, the traces or
    an error body. Known secrets: the provider key (and a wrong one for another
    provider), the gateway keys in use, the keys the admin API creates and rotates, the
    admin token and the database password; also a marker word in every prompt.

    Visible: after streams, whole calls, provider errors (500, 401), gateway errors (400,
    401, 404), a revoked key, admin calls (create, list, get, rotate, revoke, usage,
    providers, a wrong token) and a drained shutdown, none of the secrets appears in the
    process's stdout/stderr (at debug level), in ``/metrics``, in the spans exported
    over OTLP, or in any body or header a client got, except each raw key in the one
    answer that hands it over; the prompt marker appears in neither logs, metrics nor
    spans (CAPTURE_GENAI_CONTENT is off). No ledger check: a session, not a fault.
    """
    run = uuid.uuid4().hex
    provider_key = f"vnc-provider-{run}"
    wrong_provider_key = f"vnc-wrong-{run}"
    admin_token = f"adm-{run}-{uuid.uuid4().hex}"
    db_password = f"pgpw{run}"
    marker = f"promptmarker{run}"
    fake: FakeUpstream = await fake_factory(require_key=provider_key)
    other: FakeUpstream = await fake_factory(require_key=f"something-else-{run}")
    receiver = await OtlpReceiver.start()
    config = yaml.safe_dump({
        "providers": {
            "fake": {"type": "openai", "base_url": fake.url, "api_key": "${FAULTS_PROVIDER_KEY}"},
            "other": {"type": "openai", "base_url": other.url, "api_key": wrong_provider_key},
        },
        "models": [
            {"name": "test-model", "deployments": [{"provider": "fake", "model": "m"}]},
            {"name": "other-model", "deployments": [{"provider": "other", "model": "m"}]},
        ],
        "rate_limits": NO_IP_GUARD,
    })
    gw = await process_factory(
        env={
            "FAULTS_PROVIDER_KEY": provider_key,
            "ADMIN_TOKEN": admin_token,
            "DATABASE_URL": _dsn_with_password(database_url, db_password),
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "UPSTREAM_MAX_RETRIES": "0",
        },
        config_yaml=config, args=("--log-level", "debug"),
    )
    secrets = {provider_key, wrong_provider_key, admin_token, db_password, api_key}
    seen: list[bytes] = []  # every body and header block a client got
    handed_over: dict[str, bytes] = {}  # raw key -> the one body that may carry it
    admin = {"Authorization": f"Bearer {admin_token}"}

    async with aiohttp.ClientSession() as s:
        async def call(method: str, url: str, **kw: Any) -> tuple[int, bytes]:
            async with s.request(method, url, **kw) as r:
                body = await r.read()
                seen.append(body)
                seen.append(repr(dict(r.headers)).encode())
                return r.status, body

        data, mgmt = gw.url, gw.management_url
        prompt = f"hello {marker} there"
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt), headers=auth(api_key)))[0] == 200
        for extra in ({}, {"stream_options": {"include_usage": True}}):
            status, _ = await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt, stream=True, **extra), headers=auth(api_key))
            assert status == 200
        await fake.script({"status": 500})
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt), headers=auth(api_key)))[0] == 500
        # The other provider refuses the gateway's (wrong) key: a 502, never the client's 401.
        status, body = await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt, model="other-model"), headers=auth(api_key))
        assert status == 502 and b"upstream_auth_failed" in body, body
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt, model="nowhere"), headers=auth(api_key)))[0] == 404
        assert (await call("POST", f"{data}/v1/chat/completions", data=b"{not json " + marker.encode(), headers=auth(api_key)))[0] == 400
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt), headers=auth(f"llmg_wrong{run}")))[0] == 401
        assert (await call("GET", f"{data}/v1/models", headers=auth(api_key)))[0] == 200

        status, body = await call("POST", f"{mgmt}/admin/keys", json={"name": "session"}, headers=admin)
        assert status == 201, body
        created = yaml.safe_load(body)
        handed_over[created["api_key"]] = body
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt), headers=auth(created["api_key"])))[0] == 200
        status, body = await call("POST", f"{mgmt}/admin/keys/{created['api_key_id']}/rotate", headers=admin)
        assert status == 201, body
        rotated = yaml.safe_load(body)
        handed_over[rotated["api_key"]] = body
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt, stream=True), headers=auth(rotated["api_key"])))[0] == 200
        assert (await call("POST", f"{mgmt}/admin/keys/{rotated['api_key_id']}/revoke", headers=admin))[0] == 200
        await asyncio.sleep(1.2)  # revocation reaches every replica within a second
        assert (await call("POST", f"{data}/v1/chat/completions", json=chat_body(prompt), headers=auth(rotated["api_key"])))[0] == 401
        for path in ("/admin/keys", f"/admin/keys/{created['api_key_id']}", "/admin/usage", "/admin/providers", "/admin/audit"):
            assert (await call("GET", f"{mgmt}{path}", headers=admin))[0] == 200, path
        assert (await call("GET", f"{mgmt}/admin/keys", headers={"Authorization": f"Bearer {admin_token}x"}))[0] == 401
        status, metrics = await call("GET", f"{mgmt}/metrics")
        assert status == 200
    secrets |= set(handed_over)

    gw.signal(signal.SIGTERM)  # drained: the last spans are exported, the last lines written
    assert await asyncio.to_thread(gw.wait, 30) == 0
    await receiver.close()
    log = gw.log()
    spans = b"".join(receiver.raw)
    assert receiver.spans, "no spans were exported: the scan of spans would prove nothing"
    print(f"scanned: {len(log)} B of log, {len(metrics)} B of metrics, {len(receiver.spans)} spans, {len(seen)} answers")

    for secret in sorted(secrets):
        needle = secret.encode()
        assert secret not in log, f"secret in the log: {secret[:12]}..."
        assert needle not in metrics, f"secret in /metrics: {secret[:12]}..."
        assert needle not in spans, f"secret in a span: {secret[:12]}..."
        for body in seen:
            if needle in body:
                assert handed_over.get(secret) == body, f"secret in an answer: {secret[:12]}... in {body[:200]!r}"
    for place, text in (("log", log.encode()), ("metrics", metrics), ("spans", spans)):
        assert marker.encode() not in text, f"a prompt reached the {place}"
    assert "Traceback" not in log


async def test_key_and_admin_token_checks_compare_in_constant_time(
    gateway: Gateway, key_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review made executable: a gateway key (cached or looked up) and the admin token
    are checked with ``hmac.compare_digest`` over digests, never ``==`` on secrets, so
    the time taken does not tell how much of a guess was right.

    (actors/auth.py ``_ok``: SHA-256 of the presented token against the stored hash;
    gateway/admin/routes.py ``AdminAuth.check``: SHA-256 of the presented token against the
    configured one's; both only then compare.)
    """
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    raw, _ = await key_factory(name="timing")
    guess = raw[:-4] + ("AAAA" if not raw.endswith("AAAA") else "BBBB")  # same prefix, wrong tail

    assert await gateway.state.auth.authenticate(raw)  # looked up through the actor
    assert await gateway.state.auth.authenticate(raw)  # from the published cache
    with pytest.raises(Unauthenticated):
        await gateway.state.auth.authenticate(guess)
    assert len(calls) >= 3 and all(len(a) == len(b) == 32 for a, b in calls)  # digests, not tokens

    calls.clear()
    admin = AdminAuth(f"admin-{uuid.uuid4().hex}")
    with pytest.raises(AdminUnauthorized):
        admin.check("Bearer not-the-token")
    assert len(calls) == 1 and all(len(a) == len(b) == 32 for a, b in calls)


async def test_a_provider_key_file_rotated_is_used_without_a_restart(
    process_factory: Any, fake_factory: Any, api_key: str, tmp_path: Path
) -> None:
    """Fault: the provider's key is rotated (the old one stops working upstream) while
    the gateway runs; the operator replaces the content of the key file it was given as
    ``${NAME}`` with ``NAME_FILE`` (the Docker/Kubernetes secrets convention).

    Visible: calls fail with 502 upstream_auth_failed while the file holds the old key,
    and succeed again within about a second of the file's change, with no restart (the
    same process id answers). The new key appears nowhere in the gateway's log. No
    ledger check (the calls are ordinary).
    """
    run = uuid.uuid4().hex
    old_key, new_key = f"rotating-old-{run}", f"rotating-new-{run}"
    key_file = tmp_path / "provider.key"
    key_file.write_text(old_key + "\n")
    fake: FakeUpstream = await fake_factory(require_key=old_key)
    config = config_for(fake.url, rate_limits=NO_IP_GUARD).replace("sk-fake-provider-secret", "${FAULTS_ROTATING_KEY}")
    gw = await process_factory(env={"FAULTS_ROTATING_KEY_FILE": str(key_file)}, config_yaml=config)
    pid = gw.proc.pid
    async with aiohttp.ClientSession() as s:
        async def status() -> int:
            async with s.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key)) as r:
                await r.read()
                return r.status

        assert await status() == 200
        fake.server.app[STATE_KEY].config = FakeConfig(require_key=new_key)  # rotated upstream
        assert await status() == 502  # the provider refused our key: upstream_auth_failed, not the client's 401
        staged = tmp_path / "provider.key.new"
        staged.write_text(new_key + "\n")
        os.replace(staged, key_file)  # atomically, as secret mounts do
        statuses = []
        for _ in range(40):  # bounded: re-read at most a second after the change
            statuses.append(await status())
            if statuses[-1] == 200:
                break
            await asyncio.sleep(0.1)
    assert statuses[-1] == 200, statuses
    assert (await fake.stats())["last_request"]["headers"]["authorization"] == f"Bearer {new_key}"
    assert gw.proc.pid == pid and gw.proc.poll() is None
    assert new_key not in gw.log() and old_key not in gw.log()

