"""Settings from the environment (contract §3) and the YAML config file (contract §4).

Parsing is tested directly on ``load_settings``/``load_config``; the two no-config
defaults (Venice passthrough with a key, the offline mock without) run through a real
in-process gateway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.core.config import ConfigError, GatewayConfig, Settings, load_config, load_settings
from tests.conftest import FakeUpstream, auth, chat_body, sse_payloads


def config_from(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> GatewayConfig:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    environ = {"GATEWAY_CONFIG": str(path), **(env or {})}
    return load_config(load_settings(environ), environ)


def config_error(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        config_from(tmp_path, text, env)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- environment
def test_defaults_follow_the_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no conf/gateway.yaml here
    s = load_settings({})
    # No DATABASE_URL is development (embedded database, public dev key): loopback only.
    assert (s.bind_host, s.bind_port) == ("127.0.0.1", 3000)
    assert (load_settings({"DATABASE_URL": "postgresql://db/gw"}).bind_host) == "0.0.0.0"
    assert (s.management_host, s.management_port) == ("127.0.0.1", 3001)
    assert s.database_url is None and s.redis_url is None and s.config_path is None
    assert s.venice_api_key is None and s.venice_base_url == "https://api.venice.ai/api/v1"
    assert s.admin_token is None
    assert s.request_timeout == 120 and s.body_limit == 1_048_576 and s.upstream_max_retries == 2
    assert s.capture_genai_content is False
    assert s.otel_service_name == "llm-gateway" and s.otel_endpoint is None
    assert s.shutdown_grace == 30
    assert s.cors_origins == ("*",) and s.management_cors_origins == ()
    assert s.home == Path("~/.local/share/llm-gateway").expanduser()


def test_conf_gateway_yaml_is_the_default_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gateway.yaml").write_text("providers: {local: {type: mock}}\nmodels: [{name: m, deployments: [{provider: local, model: m}]}]\n")
    assert load_settings({}).config_path == Path("conf/gateway.yaml")


def test_every_variable_is_read(tmp_path: Path) -> None:
    config = tmp_path / "g.yaml"
    config.write_text("")
    s = load_settings({
        "BIND_ADDR": "[::1]:8080", "MANAGEMENT_BIND_ADDR": "10.0.0.1:9090",
        "DATABASE_URL": "postgresql://u@db/g", "REDIS_URL": "redis://r:6379/1",
        "GATEWAY_CONFIG": str(config), "VENICE_API_KEY": "sk-v", "VENICE_BASE_URL": "http://v.local/api/v1",
        "ADMIN_TOKEN": "admin", "REQUEST_TIMEOUT_SECONDS": "2.5", "REQUEST_BODY_LIMIT_BYTES": "100",
        "VENICE_MAX_RETRIES": "4", "CAPTURE_GENAI_CONTENT": "TRUE", "OTEL_SERVICE_NAME": "gw",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318", "SHUTDOWN_GRACE_SECONDS": "0",
        "CORS_ALLOWED_ORIGINS": "https://a.example, https://b.example",
        "MANAGEMENT_CORS_ORIGINS": "https://ops.example", "LLM_GATEWAY_HOME": str(tmp_path / "h"),
        "BILLING_FSYNC_INTERVAL_SECONDS": "0.05",
    })
    assert (s.bind_host, s.bind_port) == ("::1", 8080)
    assert (s.management_host, s.management_port) == ("10.0.0.1", 9090)
    assert s.database_url == "postgresql://u@db/g" and s.redis_url == "redis://r:6379/1"
    assert s.config_path == config and s.venice_api_key == "sk-v" and s.venice_base_url == "http://v.local/api/v1"
    assert s.admin_token == "admin" and s.request_timeout == 2.5 and s.body_limit == 100
    assert s.upstream_max_retries == 4 and s.capture_genai_content is True
    assert s.otel_service_name == "gw" and s.otel_endpoint == "http://otel:4318/v1/traces" and s.shutdown_grace == 0
    assert s.cors_origins == ("https://a.example", "https://b.example")
    assert s.management_cors_origins == ("https://ops.example",) and s.home == tmp_path / "h"
    assert s.billing_fsync_interval == 0.05 and load_settings({}).billing_fsync_interval == 0.02


def test_upstream_max_retries_wins_over_venice_max_retries() -> None:
    assert load_settings({"VENICE_MAX_RETRIES": "5", "UPSTREAM_MAX_RETRIES": "1"}).upstream_max_retries == 1
    assert load_settings({"VENICE_MAX_RETRIES": "0"}).upstream_max_retries == 0


def test_file_variables_hold_secrets(tmp_path: Path) -> None:
    for name, value in (("db", "postgresql://u@db/g"), ("venice", "sk-from-file"), ("admin", "admin-from-file")):
        (tmp_path / name).write_text(value + "\n")  # secret files usually end in a newline
    s = load_settings({
        "DATABASE_URL_FILE": str(tmp_path / "db"), "VENICE_API_KEY_FILE": str(tmp_path / "venice"),
        "ADMIN_TOKEN_FILE": str(tmp_path / "admin"),
    })
    assert (s.database_url, s.venice_api_key, s.admin_token) == ("postgresql://u@db/g", "sk-from-file", "admin-from-file")
    # The variable itself wins over its file.
    assert load_settings({"ADMIN_TOKEN": "direct", "ADMIN_TOKEN_FILE": str(tmp_path / "admin")}).admin_token == "direct"
    with pytest.raises(ConfigError, match=r"^VENICE_API_KEY_FILE: cannot read .*missing"):
        load_settings({"VENICE_API_KEY_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BIND_ADDR", "nope"), ("BIND_ADDR", ":3000"), ("BIND_ADDR", "host:port"),
        ("MANAGEMENT_BIND_ADDR", "127.0.0.1:70000"),
        ("REQUEST_TIMEOUT_SECONDS", "abc"), ("REQUEST_TIMEOUT_SECONDS", "0"), ("REQUEST_TIMEOUT_SECONDS", "nan"),
        ("REQUEST_TIMEOUT_SECONDS", "inf"), ("REQUEST_BODY_LIMIT_BYTES", "1.5"), ("REQUEST_BODY_LIMIT_BYTES", "0"),
        ("VENICE_MAX_RETRIES", "-1"), ("UPSTREAM_MAX_RETRIES", "two"), ("SHUTDOWN_GRACE_SECONDS", "-1"),
        ("CAPTURE_GENAI_CONTENT", "maybe"), ("MANAGEMENT_CORS_ORIGINS", "*"),
        ("MANAGEMENT_CORS_ORIGINS", "https://ok.example, *"), ("DATABASE_URL", "mysql://db/x"),
        ("REDIS_URL", "http://redis"), ("GATEWAY_CONFIG", "/nonexistent.yaml"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({name: value})
    message = str(info.value)
    assert message.startswith(f"{name}: ") and "\n" not in message


# ----------------------------------------------------------------------------- config file
CONTRACT_EXAMPLE = """
providers:
  venice:    {type: openai, base_url: "https://api.venice.ai/api/v1", api_key: "${VENICE_API_KEY}"}
  anthropic: {type: anthropic, base_url: "https://api.anthropic.com", api_key: "${ANTHROPIC_API_KEY}"}
  local:     {type: mock}
models:
  - name: smart
    strategy: priority
    deployments:
      - {provider: anthropic, model: claude-sonnet-4-5, priority: 0, price: {input_per_mtok: 3.0, output_per_mtok: 15.0}}
      - {provider: venice, model: llama-3.3-70b, priority: 1, weight: 1}
    fallbacks: [fast]
  - name: fast
    deployments: [{provider: local, model: tiny}]
  - name: "venice/*"
    deployments: [{provider: venice, model: "*"}]
circuit_breaker: {fail_max: 3, reset_timeout_seconds: 60}
rate_limits: {storage: "memory://", per_ip: "100/second"}
"""


def test_the_contract_example_parses(tmp_path: Path) -> None:
    config = config_from(tmp_path, CONTRACT_EXAMPLE, {"VENICE_API_KEY": "sk-v", "ANTHROPIC_API_KEY": "sk-a"})
    assert set(config.providers) == {"venice", "anthropic", "local"}
    assert config.providers["venice"].api_key == "sk-v" and config.providers["anthropic"].api_key == "sk-a"
    assert config.providers["local"].type == "mock"
    smart = config.models[0]
    assert smart.name == "smart" and smart.fallbacks == ("fast",)
    assert [d.id for d in smart.deployments] == ["anthropic/claude-sonnet-4-5", "venice/llama-3.3-70b"]
    price = smart.deployments[0].price
    assert price is not None and (price.input_per_mtok, price.output_per_mtok) == (3.0, 15.0)
    assert config.models[2].is_wildcard
    assert (config.circuit_breaker.fail_max, config.circuit_breaker.reset_timeout) == (3, 60.0)
    assert (config.rate_limits.storage, config.rate_limits.per_ip) == ("memory://", "100/second")


def test_variables_are_interpolated_anywhere_in_a_string(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sk-from-file\n")
    config = config_from(
        tmp_path,
        "providers: {up: {type: openai, base_url: 'http://${HOST}:${PORT}/v1', api_key: '${TOKEN}'}}\n"
        "models: [{name: m, deployments: [{provider: up, model: '${MODEL}'}]}]\n",
        {"HOST": "10.1.2.3", "PORT": "8000", "TOKEN_FILE": str(tmp_path / "token"), "MODEL": "llama"},
    )
    assert config.providers["up"].base_url == "http://10.1.2.3:8000/v1"
    assert config.providers["up"].api_key == "sk-from-file"  # ${NAME} also reads NAME_FILE
    assert config.models[0].deployments[0].model == "llama"


def test_a_missing_variable_names_the_entry_and_the_variable(tmp_path: Path) -> None:
    message = config_error(
        tmp_path,
        "providers: {up: {type: openai, base_url: 'http://x', api_key: '${NOT_SET_ANYWHERE}'}}\n"
        "models: [{name: m, deployments: [{provider: up, model: m}]}]\n",
    )
    assert "providers.up.api_key" in message and "NOT_SET_ANYWHERE is not set" in message


GOOD_PROVIDERS = "providers: {up: {type: openai, base_url: 'http://127.0.0.1:9'}, local: {type: mock}}\n"
GOOD_MODELS = "models: [{name: m, deployments: [{provider: up, model: a}]}]\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # unknown keys, at every level
        (GOOD_PROVIDERS + GOOD_MODELS + "bogus: 1\n", "bogus: unknown key"),
        ("providers: {up: {type: openai, base_url: 'http://x', secret: 1}}\n" + GOOD_MODELS, "providers.up.secret: unknown key"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a}], colour: red}]\n", "models[0].colour: unknown key"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a}, {provider: up, model: b, size: 1}]}]\n",
         "models[0].deployments[1].size: unknown key"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a, price: {per_call: 1}}]}]\n",
         "models[0].deployments[0].price.per_call: unknown key"),
        (GOOD_PROVIDERS + GOOD_MODELS + "circuit_breaker: {fail_min: 1}\n", "circuit_breaker.fail_min: unknown key"),
        (GOOD_PROVIDERS + GOOD_MODELS + "rate_limits: {per_key: '1/second'}\n", "rate_limits.per_key: unknown key"),
        # bad values
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a}, {provider: x, model: b}]}]\n",
         "models[0].deployments[1].provider: unknown provider 'x'"),
        ("providers: {up: {type: grpc, base_url: 'http://x'}}\n" + GOOD_MODELS, "providers.up.type: expected one of"),
        ("providers: {up: {type: openai}}\n" + GOOD_MODELS, "providers.up.base_url: required"),
        ("providers: {up: {type: openai, base_url: 'ftp://x'}}\n" + GOOD_MODELS, "providers.up.base_url: expected an http(s) URL"),
        ("providers: {up: {type: openai, base_url: 'http://x', timeout_seconds: .nan}}\n" + GOOD_MODELS,
         "providers.up.timeout_seconds"),
        ("providers: {up: {type: openai, base_url: 'http://x', retry_on_timeout: 'yes'}}\n" + GOOD_MODELS,
         "providers.up.retry_on_timeout: expected true or false"),
        ("providers: {up: {type: openai, base_url: 'http://x', headers: [a]}}\n" + GOOD_MODELS, "providers.up.headers"),
        (GOOD_PROVIDERS + "models: [{name: m, strategy: random, deployments: [{provider: up, model: a}]}]\n",
         "models[0].strategy: expected one of"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a, weight: heavy}]}]\n",
         "models[0].deployments[0].weight: expected a number"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a, priority: 1.5}]}]\n",
         "models[0].deployments[0].priority: expected a whole number"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a, price: {input_per_mtok: -1}}]}]\n",
         "models[0].deployments[0].price.input_per_mtok"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: []}]\n", "models[0].deployments: expected a non-empty list"),
        (GOOD_PROVIDERS + "models: [{deployments: [{provider: up, model: a}]}]\n", "models[0].name: required"),
        (GOOD_PROVIDERS + "models: [{name: 'a*b', deployments: [{provider: up, model: a}]}]\n", "models[0].name"),
        (GOOD_PROVIDERS + "models: [{name: m, deployments: [{provider: up, model: a}]}, {name: m, deployments: [{provider: up, model: b}]}]\n",
         "models[1].name: 'm' is defined twice"),
        (GOOD_PROVIDERS + "models: [{name: m, fallbacks: [nowhere], deployments: [{provider: up, model: a}]}]\n",
         "models[0].fallbacks: unknown model 'nowhere'"),
        (GOOD_PROVIDERS + GOOD_MODELS + "circuit_breaker: {fail_max: 0}\n", "circuit_breaker.fail_max"),
        (GOOD_PROVIDERS + GOOD_MODELS + "rate_limits: {strategy: leaky}\n", "rate_limits.strategy"),
        (GOOD_MODELS, "providers: expected a non-empty mapping"),
        (GOOD_PROVIDERS, "models: expected a non-empty list"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_unknown_keys_and_bad_values_are_refused_with_their_path(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in config_error(tmp_path, text)


def test_a_yaml_syntax_error_is_one_line_naming_the_file(tmp_path: Path) -> None:
    message = config_error(tmp_path, "providers: {up: [unclosed\n")
    assert str(tmp_path / "gateway.yaml") in message


# ----------------------------------------------------------------------------- no config file
async def test_no_config_and_a_venice_key_passes_every_model_through_to_venice(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no conf/gateway.yaml to pick up
    gw = await gateway_factory(env={"VENICE_API_KEY": "sk-venice-secret", "VENICE_BASE_URL": fake.url})
    assert set(gw.state.providers) == {"venice"}
    for model in ("llama-3.3-70b", "qwen/qwen3-235b:thinking"):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model=model), headers=auth(api_key))
        assert resp.status == 200
        assert (await resp.json())["model"] == model
        upstream = (await fake.stats())["last_request"]
        assert upstream["body"]["model"] == model  # passed through unchanged
        assert upstream["headers"]["authorization"] == "Bearer sk-venice-secret"


async def test_no_config_and_no_key_answers_offline_from_the_mock(
    gateway_factory: Any, api_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    gw = await gateway_factory(env={})
    assert set(gw.state.providers) == {"mock"}
    body = chat_body("tell me something", model="any-model-at-all")
    first = await gw.data.post("/v1/chat/completions", json=body, headers=auth(api_key))
    assert first.status == 200
    answer = await first.json()
    assert answer["object"] == "chat.completion" and answer["model"] == "any-model-at-all"
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = await (await gw.data.post("/v1/chat/completions", json=body, headers=auth(api_key))).json()
    assert again["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]  # deterministic

    stream_body = chat_body("tell me something", model="any-model-at-all", stream=True,
                            stream_options={"include_usage": True})
    resp = await gw.data.post("/v1/chat/completions", json=stream_body, headers=auth(api_key))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == answer["choices"][0]["message"]["content"]  # the same answer, streamed
    assert chunks[-1]["usage"]["completion_tokens"] == usage["completion_tokens"]


def test_settings_are_immutable() -> None:
    s = Settings()
    with pytest.raises(AttributeError):
        s.bind_port = 1  # type: ignore[misc]


def test_development_mode_binds_loopback_unless_bind_addr_is_given() -> None:
    dev = load_settings({})
    assert (dev.bind_host, dev.bind_port, dev.bind_addr_given) == ("127.0.0.1", 3000, False)
    production = load_settings({"DATABASE_URL": "postgresql://db/gw"})
    assert (production.bind_host, production.bind_port) == ("0.0.0.0", 3000)
    chosen = load_settings({"BIND_ADDR": "0.0.0.0:3100"})
    assert (chosen.bind_host, chosen.bind_port, chosen.bind_addr_given) == ("0.0.0.0", 3100, True)


def test_development_start_says_who_can_reach_the_dev_key() -> None:
    from gateway.edge.server import _dev_bind_notice

    offline = load_settings({})
    assert "127.0.0.1 only" in _dev_bind_notice(offline, load_config(offline, {}))
    env = {"BIND_ADDR": "0.0.0.0:3000", "VENICE_API_KEY": "sk-real"}
    exposed = load_settings(env)
    notice = _dev_bind_notice(exposed, load_config(exposed, env))
    assert notice.startswith("WARNING") and "venice" in notice


def test_metrics_token_is_read_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert load_settings({}).metrics_token is None
    assert load_settings({"METRICS_TOKEN": "t1"}).metrics_token == "t1"
    (tmp_path / "token").write_text("t2\n")
    assert load_settings({"METRICS_TOKEN_FILE": str(tmp_path / "token")}).metrics_token == "t2"
