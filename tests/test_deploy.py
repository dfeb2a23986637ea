"""Deployment files: the image, the compose stack and its configs stay valid."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.core.config import load_config, load_settings

REPO = Path(__file__).resolve().parent.parent


def _compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True, check=False
    ).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_passes_compose_config() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither 'docker compose' nor 'docker-compose' is installed")
    result = subprocess.run(
        [*command, "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
        capture_output=True, text=True, cwd=REPO, check=False,
    )
    assert result.returncode == 0, result.stderr


def test_compose_stack_shape() -> None:
    stack = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = stack["services"]
    for name in ("postgres", "redis", "migrate", "gateway-1", "gateway-2", "nginx", "prometheus", "grafana", "otel-collector", "seed"):
        assert name in services, name
    # Migrations run once, before the replicas, which skip them.
    assert services["migrate"]["command"] == ["migrate"]
    for replica in ("gateway-1", "gateway-2"):
        assert "--no-migrate" in services[replica]["command"]
        assert "ports" not in services[replica], "replicas are reachable only through the balancer"
    assert services["nginx"]["ports"] == ["8080:8080"]
    assert services["seed"]["profiles"] == ["seed"]


def test_compose_gateway_config_loads_with_and_without_a_venice_key(tmp_path: Path) -> None:
    for env in ({}, {"VENICE_API_KEY": "sk-test"}):
        environ = {"GATEWAY_CONFIG": str(REPO / "conf/compose/gateway.yaml"), **env}
        config = load_config(load_settings(environ), environ)
        assert {"venice", "local"} <= set(config.providers)


def test_dockerfile_is_multi_stage_non_root_with_a_healthcheck_and_no_secret() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert not re.search(r"(API_KEY|TOKEN|PASSWORD)\s*=\s*\S", text), "no secret baked into the image"


def test_image_builds_where_a_docker_engine_runs() -> None:
    if not shutil.which("docker") or subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no Docker engine on this machine")
    result = subprocess.run(["docker", "build", "-q", "-t", "llm-gateway:test", str(REPO)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_compose_keeps_the_management_plane_unpublished_and_the_scrape_behind_a_token() -> None:
    stack = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = stack["services"]
    published = [p for svc in services.values() for p in svc.get("ports", [])]
    assert not any(str(p).split(":")[-1].startswith("3001") for p in published), published
    prometheus_yaml = yaml.safe_load((REPO / "conf/compose/prometheus.yml").read_text())
    for replica in ("gateway-1", "gateway-2"):
        service = services[replica]
        assert service["environment"]["METRICS_TOKEN_FILE"] == "/run/secrets/metrics_token"
        assert "metrics_token" in service["secrets"]
    assert "metrics_token" in services["prometheus"]["secrets"]
    auth = prometheus_yaml["scrape_configs"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials_file": "/run/secrets/metrics_token"}


def test_compose_keeps_each_replicas_billing_journal_on_a_volume() -> None:
    stack = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    journals = set()
    for replica in ("gateway-1", "gateway-2"):
        mounts = stack["services"][replica]["volumes"]
        journal = [m for m in mounts if m.endswith(":/var/lib/llm-gateway/billing-journal")]
        assert len(journal) == 1, mounts
        volume = journal[0].split(":")[0]
        assert volume in stack["volumes"], volume  # a named volume: survives re-creation
        journals.add(volume)
        assert any(m.endswith("/etc/llm-gateway/gateway.yaml:ro") for m in mounts)
    assert len(journals) == 2, "each replica has its own journal"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "install -d -o gateway -g gateway /var/lib/llm-gateway/billing-journal" in dockerfile


def test_compose_trusts_nginx_for_the_client_address(tmp_path: Path) -> None:
    environ = {"GATEWAY_CONFIG": str(REPO / "conf/compose/gateway.yaml")}
    limits = load_config(load_settings(environ), environ).rate_limits
    assert limits.trusted_proxies, "the replicas sit behind nginx: its address must be trusted"
    nginx = (REPO / "conf/nginx/gateway.conf").read_text()
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx
