"""``serve --workers N``: one data port shared by N processes, metrics of all workers on
one management plane, supervision, and a joint drain on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.server import SUPERVISOR_PID_ENV
from gateway.edge.workers import merge_expositions
from tests.conftest import FakeUpstream, auth, chat_body, config_for


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.update(int(p) for p in text)
    return found


async def _two_workers(process_factory: Any, fake: FakeUpstream) -> tuple[Any, set[int]]:
    """A ``serve --workers 2`` process, once both of its workers exist."""
    gw = await process_factory(config_yaml=config_for(fake.url), args=("--workers", "2", "--per-worker-limits"))
    for _ in range(100):
        if len(_children(gw.proc.pid)) == 2:
            break
        await asyncio.sleep(0.05)
    workers = _children(gw.proc.pid)
    assert len(workers) == 2
    return gw, workers


async def _until_both_workers_serve(management_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            async with session.get(f"{management_url}/metrics") as r:
                text = await r.text()
            if 'worker="0"' in text and 'worker="1"' in text:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("both workers never reported")


def _requests_by_worker(text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "gateway_requests":
            continue
        for s in family.samples:
            if s.name == "gateway_requests_total" and s.labels.get("route") == "/v1/chat/completions":
                counts[s.labels["worker"]] = counts.get(s.labels["worker"], 0) + s.value
    return counts


async def test_two_workers_share_the_port_report_metrics_together_and_restart(
    process_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory()
    gw, workers = await _two_workers(process_factory, fake)
    await _until_both_workers_serve(gw.management_url)

    # New connections each time, so the kernel spreads them over both workers.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(60):
            async with session.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key)) as r:
                assert r.status == 200
        async with session.get(f"{gw.management_url}/metrics") as r:
            assert r.status == 200
            by_worker = _requests_by_worker(await r.text())
    assert sum(by_worker.values()) == 60, by_worker
    assert set(by_worker) == {"0", "1"} and min(by_worker.values()) > 0, by_worker

    # A worker that dies is restarted, and the port keeps serving meanwhile.
    victim = sorted(workers)[0]
    os.kill(victim, signal.SIGKILL)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(100):
            now = _children(gw.proc.pid)
            if len(now) == 2 and victim not in now:
                break
            await asyncio.sleep(0.1)
        assert victim not in _children(gw.proc.pid) and len(_children(gw.proc.pid)) == 2
        for _ in range(100):
            try:
                async with session.get(f"{gw.url}/readyz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        for _ in range(10):
            async with session.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key)) as r:
                assert r.status == 200

    # SIGTERM drains every worker and the supervisor exits 0.
    children = _children(gw.proc.pid)
    gw.signal(signal.SIGTERM)
    assert await asyncio.to_thread(gw.wait, 60) == 0, gw.log()
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text() for pid in children)


def test_merged_exposition_labels_each_worker() -> None:
    one = "# HELP c_total things\n# TYPE c_total counter\nc_total{route=\"/a\"} 2.0\n"
    two = "# HELP c_total things\n# TYPE c_total counter\nc_total{route=\"/a\"} 3.0\n"
    merged = merge_expositions([(0, one), (1, two)]).decode()
    samples = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(merged) for s in f.samples}
    assert samples == {(("route", "/a"), ("worker", "0")): 2.0, (("route", "/a"), ("worker", "1")): 3.0}
    assert merged.count("# TYPE c_total counter") == 1


async def test_workers_exit_when_the_supervisor_is_killed(process_factory: Any, fake_factory: Any) -> None:
    fake: FakeUpstream = await fake_factory()
    gw, workers = await _two_workers(process_factory, fake)
    await _until_both_workers_serve(gw.management_url)
    gw.signal(signal.SIGKILL)  # no chance to pass SIGTERM on
    await asyncio.to_thread(gw.wait, 10)

    def alive(pid: int) -> bool:
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False

    for _ in range(200):  # each worker notices within a second, then drains
        if not any(alive(pid) for pid in workers):
            break
        await asyncio.sleep(0.05)
    assert not any(alive(pid) for pid in workers), "orphaned workers keep running"


async def test_a_worker_whose_supervisor_died_before_it_started_stops_at_once(tmp_path: Path) -> None:
    """The supervisor's pid is handed over, not read late: a worker started under a pid
    that is no longer its parent (its supervisor died first) stops without serving."""
    import sys

    env = {**os.environ, SUPERVISOR_PID_ENV: "999999999", "DATABASE_URL": "postgresql://127.0.0.1:1/none"}
    env.pop("GATEWAY_CONFIG", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--no-migrate", "--worker-socket", str(tmp_path / "w.sock"),
        env={**env, "BIND_ADDR": "127.0.0.1:0", "MANAGEMENT_BIND_ADDR": "127.0.0.1:0"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(20):
        out, _ = await proc.communicate()
    assert b"supervisor 999999999 is gone" in out, out.decode(errors="replace")
    assert b"serving data plane" not in out


async def test_workers_with_memory_limits_are_refused_unless_the_operator_opts_in(
    process_factory: Any, fake_factory: Any
) -> None:
    fake: FakeUpstream = await fake_factory()
    gw = await process_factory(config_yaml=config_for(fake.url), args=("--workers", "2"), ready=False)
    assert await asyncio.to_thread(gw.wait, 30) == 2
    log = gw.log()
    assert "configuration error: serve --workers 2: rate limits are kept in memory" in log, log
    assert "--per-worker-limits" in log and "Traceback" not in log


def test_shared_limit_storages_need_no_opt_in(tmp_path: Path) -> None:
    from gateway.core.config import load_config, load_settings
    from gateway.edge.workers import per_worker_limits_refusal

    def refusal(env: dict[str, str], yaml_text: str | None = None) -> str | None:
        if yaml_text is not None:
            path = tmp_path / "gw.yaml"
            path.write_text("providers: {m: {type: mock}}\nmodels: [{name: '*', deployments: [{provider: m, model: '*'}]}]\n" + yaml_text)
            env = {**env, "GATEWAY_CONFIG": str(path)}
        settings = load_settings(env)
        return per_worker_limits_refusal(settings, load_config(settings, env), 2)

    assert refusal({}) is not None
    assert refusal({"REDIS_URL": "redis://127.0.0.1:6379/0"}) is None
    assert refusal({"REDIS_URL": "redis://r/0"}, "rate_limits: {storage: 'memory://'}\n") is not None
    assert refusal({}, "rate_limits: {storage: postgres}\n") is None
    settings = load_settings({})
    assert per_worker_limits_refusal(settings, load_config(settings, {}), 1) is None
