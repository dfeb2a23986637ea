"""The ops files in conf/: rules pass promtool, a real Prometheus scrapes /metrics, and
every metric the rules and the dashboard use is one the gateway exposes."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.observability.metrics import GatewayMetrics
from tests.conftest import REPO, Gateway, auth, chat_body, free_port

CONF = REPO / "conf"
RULES = CONF / "prometheus" / "rules.yml"
RULES_TEST = CONF / "prometheus" / "rules_test.yml"
DASHBOARD = CONF / "grafana" / "llm-gateway.json"
_METRIC = re.compile(r"\b(gateway_[a-z_]+)\b")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install prometheus)")
    return path


def _exposed_names() -> set[str]:
    """Every sample name the gateway can expose, from its own registry."""
    metrics = GatewayMetrics(process_metrics=False)
    metrics.watch_circuits(dict)
    metrics.watch_limiter(lambda: False)
    metrics.watch_key_invalidation(lambda: True)
    names: set[str] = set()
    for line in metrics.render_now().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update(name + s for s in ("_bucket", "_sum", "_count"))
            if kind == "counter":
                names.add(name + "_total")
    return names


def _used_names(text: str) -> set[str]:
    return set(_METRIC.findall(text))


def test_rules_pass_promtool_check_and_unit_tests() -> None:
    promtool = _tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    config = subprocess.run([promtool, "check", "config", str(CONF / "prometheus.yml")], capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stdout + config.stderr


def test_rules_alert_on_the_thresholds_asked_for() -> None:
    alerts = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert {"GatewayChatLatencyP99High", "GatewayErrorRateHigh", "GatewayProviderCircuitOpen",
            "GatewayDailyCostOverBudgetShare"} <= set(alerts)
    assert alerts["GatewayChatLatencyP99High"]["expr"].strip().endswith("> 10")
    assert alerts["GatewayErrorRateHigh"]["expr"].strip().endswith("> 0.05")
    assert alerts["GatewayProviderCircuitOpen"]["expr"].strip().endswith("== 2")


def test_rules_and_dashboard_use_only_exposed_metrics() -> None:
    exposed = _exposed_names()
    used_by_rules = _used_names(RULES.read_text())
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used_by_dashboard = _used_names("\n".join(exprs))
    assert used_by_rules and used_by_dashboard
    assert used_by_rules <= exposed, used_by_rules - exposed
    assert used_by_dashboard <= exposed, used_by_dashboard - exposed
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("requests", "latency", "first token", "tokens", "spend", "circuit", "rate-limited"):
        assert topic in titles, topic


async def test_a_real_prometheus_scrapes_metrics(gateway: Gateway, api_key: str, tmp_path: Path) -> None:
    binary = _tool("prometheus")
    assert (await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))).status == 200
    target = f"127.0.0.1:{gateway.management.server.port}"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "llm-gateway", "static_configs": [{"targets": [target]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", stdout=log, stderr=subprocess.STDOUT,
        )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        result = await _until_scraped(api, proc)
        assert result, (tmp_path / "prometheus.log").read_text()[-2000:]
        async with aiohttp.ClientSession() as session, session.get(f"{api}/rules") as r:
            groups = (await r.json())["data"]["groups"]
        assert {g["name"] for g in groups} >= {"llm-gateway-alerts", "llm-gateway-recording"}
        assert all(rule["health"] != "err" for g in groups for rule in g["rules"])
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _until_scraped(api: str, proc: asyncio.subprocess.Process) -> list[Any]:
    """Poll until Prometheus holds the gateway's chat request counter (bounded: 30 s)."""
    query = 'gateway_requests_total{route="/v1/chat/completions",status="200"}'
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline and proc.returncode is None:
            try:
                async with session.get(f"{api}/query", params={"query": query}) as r:
                    if r.status == 200:
                        result = (await r.json())["data"]["result"]
                        if result and float(result[0]["value"][1]) == 1.0:
                            return list(result)
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    return []
