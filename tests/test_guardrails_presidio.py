"""The Presidio backend (the ``presidio`` extra): its pattern recognizers over spaCy's
blank pipeline behind the detector interface, in every mode, on a stream's window, and
through a running gateway. Skipped where the extra is not installed; the refusal of a
config that needs it is checked either way."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from gateway.core.config import ConfigError, load_config
from gateway.core.settings import load_settings
from tests.conftest import FakeUpstream, auth, chat_body, config_for

INSTALLED = importlib.util.find_spec("presidio_analyzer") is not None
needs_presidio = pytest.mark.skipif(not INSTALLED, reason="presidio-analyzer is not installed (pip install '.[presidio]')")
PHONE = "+1 212-555-0123"
CARD = "4111 1111 1111 1111"


def _load(tmp_path: Path, **extra: Any) -> Any:
    path = tmp_path / "c.yaml"
    path.write_text(config_for("http://127.0.0.1:1/v1", **extra))
    env = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x@127.0.0.1/x"}
    return load_config(load_settings(env), env)


@pytest.mark.skipif(INSTALLED, reason="checks the refusal where the extra is missing")
def test_a_presidio_policy_without_the_extra_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"guardrails.policies.people.type: presidio needs pip install"):
        _load(tmp_path, guardrails={"policies": {"people": {"type": "presidio"}}})


@needs_presidio
async def test_presidio_finds_entities_behind_the_detector_interface_in_every_mode() -> None:
    from gateway.core.errors import GuardrailBlocked
    from gateway.guardrails.engine import GuardrailEngine
    from gateway.guardrails.policies import Policy
    from gateway.guardrails.streams import StreamScreen

    def chat(text: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": text}]}

    # Presidio scores a phone number without a context word ("phone", "call") 0.4.
    redact = GuardrailEngine([Policy("p", "presidio", mode="redact", entities=("PHONE_NUMBER", "CREDIT_CARD"),
                                     score_threshold=0.3)])
    body, decisions = await redact.screen_input(chat(f"call {PHONE} or pay with {CARD}, John"))
    assert body["messages"][0]["content"] == "call [REDACTED:phone_number] or pay with [REDACTED:credit_card], John"
    assert [(d.label(), d.kinds) for d in decisions] == [("p:redacted", ("credit_card", "phone_number"))]
    clean = chat("nothing to see here, version 1.2.3")
    assert await redact.screen_input(clean) == (clean, [])
    with pytest.raises(GuardrailBlocked):
        await GuardrailEngine([Policy("p", "presidio", entities=("EMAIL_ADDRESS",))]).screen_input(chat("a@example.com"))
    _, decisions = await GuardrailEngine([Policy("p", "presidio", mode="log")]).screen_input(chat(f"card {CARD}"))
    assert decisions and decisions[0].label() == "p:logged" and "credit_card" in decisions[0].kinds

    # A stream: the card split over chunks is held whole by the window and redacted.
    output = GuardrailEngine([Policy("p", "presidio", mode="redact", direction="output", entities=("CREDIT_CARD",))])
    screen = StreamScreen(output.stream_rules)
    out = "".join(screen.feed(0, piece) for piece in ("pay ", CARD[:7], CARD[7:], " thanks")) + screen.finish(0)
    assert out == "pay [REDACTED:credit_card] thanks"


@needs_presidio
def test_unknown_entities_and_models_that_are_not_installed_stop_the_start() -> None:
    from gateway.guardrails.presidio import PresidioAnalyzer

    with pytest.raises(ValueError, match="unknown Presidio entity 'SHOE_SIZE'"):
        PresidioAnalyzer(["SHOE_SIZE"])
    with pytest.raises(ValueError, match="is not installed"):
        PresidioAnalyzer([], spacy_model="en_core_web_nonexistent")


@needs_presidio
async def test_a_presidio_policy_through_a_running_gateway(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    config = config_for(
        fake.url, guardrails={"policies": {"people": {"type": "presidio", "mode": "redact", "entities": ["PHONE_NUMBER"],
                                                        "score_threshold": 0.3}}},
        models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*"}], "guardrails": ["people"]}],
    )
    gateway = await gateway_factory(config_yaml=config)
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(f"ring {PHONE} today"), headers=auth(api_key))
    assert resp.status == 200
    assert (await fake.stats())["last_request"]["body"]["messages"][0]["content"] == "ring [REDACTED:phone_number] today"
