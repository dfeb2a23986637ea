"""Provider keys from files: re-read on change (at most once a second), the config's
``api_key_file`` and ``${NAME}`` with ``NAME_FILE``, and the headers each wire sends."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import aiohttp
import pytest

from gateway.core.config import ConfigError, load_config, load_settings
from gateway.providers.anthropic import AnthropicProvider
from gateway.providers.credentials import Credential
from gateway.providers.openai import OpenAIProvider


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rewrite(path: Path, text: str) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)  # a new inode, as secret mounts and editors do


def test_an_inline_key_is_fixed() -> None:
    credential = Credential("sk-inline")
    assert credential.current() == "sk-inline" and not credential.rotatable


def test_a_key_file_is_re_read_when_it_changes_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("first\n")
    clock = Clock()
    credential = Credential("first", path, clock=clock)
    assert credential.rotatable
    _rewrite(path, "second\n")
    assert credential.current() == "first"  # not looked at again within the second
    clock.now += 1.0
    assert credential.current() == "second"
    clock.now += 0.5
    _rewrite(path, "third")
    assert credential.current() == "second"
    clock.now += 0.6
    assert credential.current() == "third"


def test_a_missing_or_empty_key_file_keeps_the_last_good_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "key"
    path.write_text("good-key-value")
    clock = Clock()
    credential = Credential("good-key-value", path, provider="p", clock=clock)
    _rewrite(path, "  \n")
    clock.now += 1
    with caplog.at_level(logging.WARNING, logger="gateway.providers"):
        assert credential.current() == "good-key-value"
        path.unlink()
        clock.now += 1
        assert credential.current() == "good-key-value"
    assert "empty" in caplog.text
    assert "good-key-value" not in caplog.text


def _yaml(tmp_path: Path, api_key_line: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "providers:\n  up:\n    type: openai\n    base_url: http://127.0.0.1:1/v1\n"
        f"    {api_key_line}\n"
        "models:\n  - name: '*'\n    deployments: [{provider: up, model: '*'}]\n"
    )
    return path


def test_config_records_the_file_behind_a_name_file_variable(tmp_path: Path) -> None:
    key_file = tmp_path / "up.key"
    key_file.write_text("from-the-file\n")
    env = {"GATEWAY_CONFIG": str(_yaml(tmp_path, 'api_key: "${UP_KEY}"')), "UP_KEY_FILE": str(key_file)}
    provider = load_config(load_settings(env), env).providers["up"]
    assert (provider.api_key, provider.api_key_file) == ("from-the-file", key_file)

    env = {"GATEWAY_CONFIG": env["GATEWAY_CONFIG"], "UP_KEY": "from-the-env", "UP_KEY_FILE": str(key_file)}
    provider = load_config(load_settings(env), env).providers["up"]
    assert (provider.api_key, provider.api_key_file) == ("from-the-env", None)  # the variable wins

    env = {"GATEWAY_CONFIG": str(_yaml(tmp_path, 'api_key: "Bearer ${UP_KEY}"')), "UP_KEY_FILE": str(key_file)}
    provider = load_config(load_settings(env), env).providers["up"]
    assert provider.api_key_file is None  # only a whole value can be re-read


def test_config_api_key_file_entry(tmp_path: Path) -> None:
    key_file = tmp_path / "up.key"
    key_file.write_text("k-from-file")
    env = {"GATEWAY_CONFIG": str(_yaml(tmp_path, f"api_key_file: {key_file}"))}
    provider = load_config(load_settings(env), env).providers["up"]
    assert (provider.api_key, provider.api_key_file) == ("k-from-file", key_file)

    env = {"GATEWAY_CONFIG": str(_yaml(tmp_path, f"api_key_file: {tmp_path / 'missing'}"))}
    with pytest.raises(ConfigError, match=r"providers\.up\.api_key_file: cannot read"):
        load_config(load_settings(env), env)
    (tmp_path / "gateway.yaml").write_text(
        (tmp_path / "gateway.yaml").read_text().replace("api_key_file:", "api_key: x\n    api_key_file:")
    )
    with pytest.raises(ConfigError, match="not both"):
        load_config(load_settings(env), env)


def test_venice_api_key_file_without_a_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no conf/gateway.yaml here
    key_file = tmp_path / "venice.key"
    key_file.write_text("venice-key\n")
    env = {"VENICE_API_KEY_FILE": str(key_file)}
    provider = load_config(load_settings(env), env).providers["venice"]
    assert (provider.api_key, provider.api_key_file) == ("venice-key", key_file)


async def test_each_wire_sends_the_rotated_key(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text("old-key")
    env = {"GATEWAY_CONFIG": str(_yaml(tmp_path, 'api_key: "${K}"')), "K_FILE": str(key_file)}
    config = load_config(load_settings(env), env).providers["up"]
    async with aiohttp.ClientSession() as session:
        for provider, header, form in (
            (OpenAIProvider(config, session, request_timeout=5), "Authorization", "Bearer {}"),
            (AnthropicProvider(config, session, request_timeout=5), "x-api-key", "{}"),
        ):
            clock = Clock()
            provider.credential = Credential("old-key", key_file, clock=clock)
            base = provider._headers
            assert provider.keyed_headers(base)[header] == form.format("old-key")
            _rewrite(key_file, "new-key")
            clock.now += 1
            assert provider.keyed_headers(base)[header] == form.format("new-key")
            assert header not in base  # the shared base never holds the key
            key_file.write_text("old-key")


async def test_a_credential_refreshed_in_a_thread_is_refreshed_once_for_concurrent_callers() -> None:
    import asyncio
    import threading

    from gateway.providers.credentials import RefreshedInThread

    refreshes: list[tuple[int | None, str]] = []
    due = {"now": False}
    fail = {"now": False}

    def refresh(previous: int | None) -> int:
        refreshes.append((previous, threading.current_thread().name))
        if fail["now"]:
            raise OSError("token endpoint down")
        return (previous or 0) + 1

    held: RefreshedInThread[int] = RefreshedInThread(refresh, lambda _value: due["now"])
    assert await asyncio.gather(*(held.current() for _ in range(5))) == [1] * 5
    assert len(refreshes) == 1 and refreshes[0][1] != threading.current_thread().name  # not on the loop
    assert await held.current() == 1 and len(refreshes) == 1  # not stale: no refresh
    due["now"] = True
    fail["now"] = True
    with pytest.raises(OSError):
        await held.current()
    fail["now"] = False
    assert await held.current() == 2  # the failed refresh kept the old value to refresh from
    assert [previous for previous, _ in refreshes] == [None, 1, 1]
