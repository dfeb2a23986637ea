"""One declaration per shape: the config file, the admin API's input and the OpenAPI
documents come from the same typed models, and the hot path's chat check stays by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chat_body import measure
from gateway.admin.input import BODIES, QUERIES, parse_key_create
from gateway.auth.keys import MAX_NAME_LEN
from gateway.core.config import BreakerSettings, ConfigError, Deployment, Price, load_config, load_settings
from gateway.core.errors import InvalidRequest
from gateway.edge.openapi import management_document
from gateway.edge.openapi_shapes import model_schema

PROVIDERS = "providers: {up: {type: openai, base_url: 'http://127.0.0.1:9'}}\n"
MODELS = "models: [{name: m, deployments: [{provider: up, model: a}]}]\n"


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(load_settings({"GATEWAY_CONFIG": str(path)}), {})


def test_the_documented_bodies_are_the_validating_models() -> None:
    schemas = management_document()["components"]["schemas"]
    for name, model in BODIES.items():
        assert schemas[name] == model_schema(model)
        assert schemas[name]["additionalProperties"] is False  # unknown fields refused, and documented so
    # A bound changed on the model is a bound changed in the document: both read the field.
    name_schema = schemas["KeyCreate"]["properties"]["name"]
    assert name_schema["maxLength"] == MAX_NAME_LEN
    with pytest.raises(InvalidRequest, match="'name' must be"):
        parse_key_create({"name": "x" * (name_schema["maxLength"] + 1)})
    assert parse_key_create({"name": "x" * name_schema["maxLength"]}).name


def test_every_documented_query_parameter_is_a_field_of_its_model() -> None:
    paths = management_document()["paths"]
    for path, kind in (("/admin/keys", "keys"), ("/admin/budgets", "budgets"), ("/admin/audit", "audit"),
                       ("/admin/usage", "usage")):
        documented = [p["name"] for p in paths[path]["get"]["parameters"]]
        assert documented == list(QUERIES[kind].__pydantic_fields__), path
        assert all("null" not in str(p["schema"]) for p in paths[path]["get"]["parameters"])


def test_python_code_builds_config_sections_by_attribute_name_and_position() -> None:
    assert BreakerSettings(reset_timeout=0.2).reset_timeout == 0.2
    assert Deployment("a", "m", price=Price(3, 15)).price == Price(3.0, 15.0)
    with pytest.raises(ValueError):
        BreakerSettings(fail_max=0)  # the same bounds as the file's


def test_the_file_takes_only_its_own_key_names(tmp_path: Path) -> None:
    # reset_timeout is the attribute; the file says reset_timeout_seconds, and only that.
    with pytest.raises(ConfigError, match=r"^circuit_breaker\.reset_timeout: unknown key \(allowed: fail_max, reset_timeout_seconds"):
        load(tmp_path, PROVIDERS + MODELS + "circuit_breaker: {reset_timeout: 5}\n")
    with pytest.raises(ConfigError, match=r"^providers\.up\.name: unknown key"):
        load(tmp_path, "providers: {up: {type: mock, name: other}}\n" + MODELS)


def test_null_sections_mean_their_defaults(tmp_path: Path) -> None:
    config = load(tmp_path, PROVIDERS + MODELS + "circuit_breaker:\nrate_limits:\ncache:\n")
    assert config == load(tmp_path, PROVIDERS + MODELS)


def test_the_chat_body_bench_measures_both_checks() -> None:
    figures = measure(calls=50)
    assert len(figures) == 4 and all(us > 0 for us in figures.values())
