"""deploy/kubernetes: the kustomize overlays render, and the objects a rollout needs are
there with the fields that make it drop no stream and lose no usage."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.core.config import load_config, load_settings

REPO = Path(__file__).resolve().parent.parent
KUSTOMIZE_ROOT = REPO / "deploy" / "kubernetes"
OVERLAYS = ("production", "dev")

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed (.ci/run installs it where it can)"
)


def render(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str, name_prefix: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"{kind} {name_prefix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_every_object_a_rollout_needs(overlay: str) -> None:
    objects = render(KUSTOMIZE_ROOT / "overlays" / overlay)
    kinds = {o["kind"] for o in objects}
    assert {
        "Deployment", "Job", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
        "ConfigMap", "Secret", "ServiceMonitor",
    } <= kinds
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces


def test_the_deployment_drains_before_it_is_killed_and_probes_the_right_routes() -> None:
    objects = render(KUSTOMIZE_ROOT / "overlays" / "production")
    deployment = one(objects, "Deployment", "llm-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    env = env_of(gateway)
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"data": 3000, "management": 3001}
    assert env["BIND_ADDR"].endswith(":3000") and env["MANAGEMENT_BIND_ADDR"].endswith(":3001")
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "data"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "data"}
    # SIGKILL comes only after the preStop pause and the whole shutdown grace.
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = int(env["SHUTDOWN_GRACE_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + grace + 5
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # The pods serve without migrating; the Job migrates once per release.
    assert gateway["args"] == ["serve", "--no-migrate"]
    job = one(objects, "Job", "llm-gateway-migrate")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"]


def test_config_is_a_hashed_configmap_and_secrets_are_file_mounts() -> None:
    objects = render(KUSTOMIZE_ROOT / "overlays" / "production")
    pod = one(objects, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    env = env_of(gateway)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}

    config_map = one(objects, "ConfigMap", "llm-gateway-config-")  # the hash suffix
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert env["GATEWAY_CONFIG"] == f"{mounts['config']}/gateway.yaml"
    assert "gateway.yaml" in config_map["data"]

    secret = one(objects, "Secret", "llm-gateway-secrets-")
    assert volumes["secrets"]["secret"]["secretName"] == secret["metadata"]["name"]
    file_vars = {name: path for name, path in env.items() if name.endswith("_FILE")}
    assert {"DATABASE_URL_FILE", "REDIS_URL_FILE", "ADMIN_TOKEN_FILE"} <= set(file_vars)
    for name, path in file_vars.items():
        directory, _, key = path.rpartition("/")
        assert directory == mounts["secrets"], name
        assert key in secret["data"], f"{name} names {key}, which the Secret does not hold"
    # No secret value is spelled out in the pod's environment.
    assert not any(n in env for n in ("DATABASE_URL", "REDIS_URL", "ADMIN_TOKEN"))


def test_a_config_change_renames_the_configmap_so_the_pods_roll(tmp_path: Path) -> None:
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUSTOMIZE_ROOT, copy)
    before = one(render(copy / "overlays" / "production"), "ConfigMap", "llm-gateway-config-")
    with (copy / "base" / "gateway.yaml").open("a") as f:
        f.write("circuit_breaker: {fail_max: 5}\n")
    after = one(render(copy / "overlays" / "production"), "ConfigMap", "llm-gateway-config-")
    assert before["metadata"]["name"] != after["metadata"]["name"]


def test_the_journal_lives_on_a_volume_and_the_management_plane_stays_inside() -> None:
    objects = render(KUSTOMIZE_ROOT / "overlays" / "production")
    pod = one(objects, "Deployment", "llm-gateway")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert env_of(gateway)["BILLING_JOURNAL_DIR"] == mounts["journal"]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["journal"]  # survives a container restart

    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert services["llm-gateway"]["spec"]["type"] == "LoadBalancer"
    management = services["llm-gateway-management"]
    assert management["spec"]["type"] == "ClusterIP"
    assert [p["targetPort"] for p in management["spec"]["ports"]] == ["management"]
    monitor = one(objects, "ServiceMonitor", "llm-gateway")
    labels = management["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["spec"]["endpoints"][0] == {"port": "management", "path": "/metrics", "interval": "15s"}

    hpa = one(objects, "HorizontalPodAutoscaler", "llm-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llm-gateway" and hpa["spec"]["minReplicas"] >= 2
    pdb = one(objects, "PodDisruptionBudget", "llm-gateway")
    selector = pdb["spec"]["selector"]["matchLabels"]
    template_labels = one(objects, "Deployment", "llm-gateway")["spec"]["template"]["metadata"]["labels"]
    assert all(template_labels.get(k) == v for k, v in selector.items())


def test_the_shipped_config_and_secret_files_load(tmp_path: Path) -> None:
    objects = render(KUSTOMIZE_ROOT / "overlays" / "production")
    config_map = one(objects, "ConfigMap", "llm-gateway-config-")
    path = tmp_path / "gateway.yaml"
    path.write_text(config_map["data"]["gateway.yaml"])
    key_file = tmp_path / "openai_api_key"
    key_file.write_text("sk-test\n")
    redis_file = tmp_path / "redis_url"
    redis_file.write_text("redis://127.0.0.1:6379/0\n")
    environ = {"GATEWAY_CONFIG": str(path), "OPENAI_API_KEY_FILE": str(key_file), "REDIS_URL_FILE": str(redis_file)}
    settings = load_settings(environ)
    assert settings.redis_url == "redis://127.0.0.1:6379/0"  # read from the file, newline stripped
    config = load_config(settings, environ)
    assert config.providers["openai"].api_key == "sk-test"
