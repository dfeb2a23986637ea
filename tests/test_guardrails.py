"""Guardrails: the detectors on a labelled set, each policy type and mode, streams split at
every offset, and the webhook in both fail modes against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.core.errors import GuardrailBlocked
from gateway.guardrails.detectors import DETECTORS, find_matches, iban_valid, luhn_valid
from gateway.guardrails.engine import GuardrailEngine
from gateway.guardrails.external import HttpChecks, moderation_verdict
from gateway.guardrails.policies import Policy
from gateway.guardrails.streams import StreamScreen

LABELLED = json.loads((Path(__file__).parent / "data" / "guardrails_labelled.json").read_text())
CARD = "4111 1111 1111 1111"


def chat(*texts: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": t} for t in texts]}


def scores() -> dict[str, tuple[float, float, int]]:
    """Precision, recall and support per detector over the labelled set."""
    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    for record in LABELLED:
        got = {m.detector for m in find_matches(record["text"], DETECTORS.values())}
        want = set(record["labels"])
        for name in got & want:
            tp[name] += 1
        for name in got - want:
            fp[name] += 1
        for name in want - got:
            fn[name] += 1
    out = {}
    for name in DETECTORS:
        support = tp[name] + fn[name]
        precision = tp[name] / (tp[name] + fp[name]) if tp[name] + fp[name] else 1.0
        recall = tp[name] / support if support else 1.0
        out[name] = (precision, recall, support)
    return out


def test_every_detector_is_labelled_and_scores_well_on_the_labelled_set() -> None:
    table = scores()
    for name, (precision, recall, support) in table.items():
        assert support >= 1, f"{name} has no true example in the labelled set"
        assert recall == 1.0, (name, recall)
        # Shape-only detectors have false positives; the docs report them.
        assert precision >= 0.7, (name, precision)
    overall_fp = sum(1 for r in LABELLED if not r["labels"] and find_matches(r["text"], DETECTORS.values()))
    negatives = sum(1 for r in LABELLED if not r["labels"])
    assert overall_fp / negatives <= 0.15, (overall_fp, negatives)


def test_the_figures_in_the_docs_are_the_labelled_sets() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "guardrails.md").read_text()
    for name, (precision, recall, support) in scores().items():
        assert f"| `{name}` | {support} | {precision:.2f} | {recall:.2f} |" in docs, name


def test_checksums() -> None:
    assert luhn_valid("4111 1111 1111 1111") and luhn_valid("378282246310005")
    assert not luhn_valid("4111 1111 1111 1112") and not luhn_valid("0000 0000 0000 0000")
    assert iban_valid("DE89 3704 0044 0532 0130 00") and iban_valid("GB82WEST12345698765432")
    assert not iban_valid("DE89 3704 0044 0532 0130 01") and not iban_valid("DE89 3704")


async def test_block_names_the_policy_never_the_text() -> None:
    engine = GuardrailEngine([Policy("no-pii", "pii", mode="block")])
    with pytest.raises(GuardrailBlocked) as caught:
        await engine.screen_input(chat("hello", f"my card is {CARD}"))
    assert caught.value.policy == "no-pii" and "no-pii" in caught.value.message
    assert "4111" not in caught.value.message and caught.value.status == 400
    assert caught.value.error_code == "guardrail_blocked"


async def test_redact_replaces_the_matched_text_in_a_copy_and_records_the_kinds() -> None:
    engine = GuardrailEngine([Policy("pii", "pii", mode="redact")])
    body = {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "mail a.b@example.com"}, {"type": "image_url"}]},
    ]}
    screened, decisions = await engine.screen_input(body)
    assert screened["messages"][1]["content"][0]["text"] == "mail [REDACTED:email]"
    assert body["messages"][1]["content"][0]["text"] == "mail a.b@example.com"  # the original is untouched
    assert [d.label() for d in decisions] == ["pii:redacted"] and decisions[0].kinds == ("email",)


async def test_log_mode_counts_without_changing_anything_and_clean_text_passes() -> None:
    engine = GuardrailEngine([Policy("watch", "pii", mode="log", detectors=("ip_address",))])
    body = chat("server 203.0.113.5")
    screened, decisions = await engine.screen_input(body)
    assert screened is body and [d.label() for d in decisions] == ["watch:logged"]
    assert await engine.screen_input(chat("nothing here")) == (chat("nothing here"), [])


async def test_policies_run_in_order_and_a_redaction_feeds_the_next() -> None:
    engine = GuardrailEngine([
        Policy("pii", "pii", mode="redact", detectors=("email",)),
        Policy("terms", "terms", mode="block", terms=("example.com",)),
    ])
    screened, _ = await engine.screen_input(chat("write to x@example.com"))  # redacted first: no term left
    assert "example.com" not in screened["messages"][0]["content"]


async def test_terms_are_whole_words_case_insensitive_and_patterns_are_regexes() -> None:
    engine = GuardrailEngine([Policy("topics", "terms", mode="block", terms=("project falcon",), patterns=(r"\bcve-\d{4}-\d+",))])
    for text in ("Tell me about PROJECT FALCON", "exploit for CVE-2024-12345"):
        with pytest.raises(GuardrailBlocked):
            await engine.screen_input(chat(text))
    await engine.screen_input(chat("falconry and projects are fine"))
    with pytest.raises(ValueError, match="not a valid regular expression"):
        GuardrailEngine([Policy("bad", "terms", patterns=("(",))])
    with pytest.raises(ValueError, match="unknown detector 'dna'"):
        GuardrailEngine([Policy("bad", "pii", detectors=("dna",))])


async def test_max_input_by_characters_and_tokens() -> None:
    by_chars = GuardrailEngine([Policy("size", "max_input", max_chars=10)])
    await by_chars.screen_input(chat("short"))
    with pytest.raises(GuardrailBlocked):
        await by_chars.screen_input(chat("this is well over ten"))
    by_tokens = GuardrailEngine([Policy("size", "max_input", max_tokens=8)])
    await by_tokens.screen_input(chat("one two three"))  # 3 words + 3 per message
    with pytest.raises(GuardrailBlocked):
        await by_tokens.screen_input(chat("one two three four five six"))


async def test_output_policies_screen_whole_answers() -> None:
    engine = GuardrailEngine([Policy("pii", "pii", mode="redact", direction="output")])
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"card {CARD}"}}]}
    screened, decisions = await engine.screen_answer(answer)
    assert screened["choices"][0]["message"]["content"] == "card [REDACTED:card_number]"
    assert [d.direction for d in decisions] == ["output"]
    # An input-only policy leaves answers alone, and an output-only one prompts.
    assert (await GuardrailEngine([Policy("pii", "pii", mode="block")]).screen_answer(answer))[0] is answer
    assert (await engine.screen_input(chat(CARD)))[1] == []


@pytest.mark.parametrize("mode", ["redact", "block"])
def test_a_card_number_split_at_any_offset_never_reaches_the_client(mode: str) -> None:
    text = f"Sure. Your card is {CARD}, keep it safe. " + "More words follow here. " * 12
    engine = GuardrailEngine([Policy("pii", "pii", mode=mode, direction="output")])  # type: ignore[arg-type]
    for cut in range(1, len(text)):
        for step in (1, 7, cut):
            screen = StreamScreen(engine.stream_rules)
            pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            sent = []
            try:
                for piece in pieces:
                    sent.append(screen.feed(0, piece))
                sent.append(screen.finish(0))
            except GuardrailBlocked:
                assert mode == "block"
            out = "".join(sent)
            digits = out.replace(" ", "")
            assert "4111111111111111" not in digits, (cut, step)
            if mode == "redact":
                assert "[REDACTED:card_number]" in out and out.endswith("follow here. ")
                assert [d.label() for d in screen.decisions()] == ["pii:redacted"]
        if cut > 40:
            break


def test_a_stream_is_held_back_only_by_the_window() -> None:
    screen = StreamScreen(GuardrailEngine([Policy("pii", "pii", mode="redact", direction="output")]).stream_rules)
    long_text = "word " * 100
    released = screen.feed(0, long_text)
    assert len(released) >= len(long_text) - 160 and long_text.startswith(released)
    assert released + screen.finish(0) == long_text
    # A private key is held from its BEGIN line until its END line, then redacted whole.
    key = "-----BEGIN PRIVATE KEY-----\n" + "A" * 400 + "\n-----END PRIVATE KEY-----"
    screen = StreamScreen(GuardrailEngine([Policy("pii", "pii", mode="redact", direction="output")]).stream_rules)
    out = [screen.feed(0, "here: " + key[:100])]
    out += [screen.feed(0, key[i:i + 50]) for i in range(100, len(key), 50)]
    out.append(screen.feed(0, " done" + " pad" * 60))
    out.append(screen.finish(0))
    assert "AAAA" not in "".join(out) and "[REDACTED:private_key]" in "".join(out)


async def test_hooks_sync_and_async() -> None:
    engine = GuardrailEngine([
        Policy("pizza", "hook", hook="tests.guardrail_hooks:refuse_pineapple"),
        Policy("loud", "hook", mode="redact", hook="tests.guardrail_hooks:shout"),
    ])
    with pytest.raises(GuardrailBlocked):
        await engine.screen_input(chat("pineapple on pizza?"))
    screened, decisions = await engine.screen_input(chat("hello"))
    assert screened["messages"][0]["content"] == "HELLO" and [d.label() for d in decisions] == ["loud:redacted"]
    with pytest.raises(ValueError, match="cannot import"):
        GuardrailEngine([Policy("x", "hook", hook="no_such_module:f")])


class _Webhook:
    """A real HTTP webhook on loopback whose behaviour a test sets."""

    def __init__(self) -> None:
        self.answer: Any = {"action": "allow"}
        self.delay = 0.0
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        await asyncio.sleep(self.delay)
        return web.json_response(self.answer)


async def test_webhook_allows_blocks_rewrites_and_fails_as_configured(aiohttp_server: Any) -> None:
    hook = _Webhook()
    app = web.Application()
    app.router.add_post("/check", hook.handle)
    server = await aiohttp_server(app)
    url = str(server.make_url("/check"))
    async with aiohttp.ClientSession() as session:
        checks = HttpChecks(session)
        closed = GuardrailEngine([Policy("hook", "webhook", mode="redact", url=url, timeout_seconds=0.3)], checks)
        opened = GuardrailEngine([Policy("hook", "webhook", url=url, timeout_seconds=0.3, fail_open=True)], checks)

        body = chat("first", "second")
        assert await closed.screen_input(body) == (body, [])
        assert hook.seen[-1] == {"policy": "hook", "direction": "input", "texts": ["first", "second"]}

        hook.answer = {"action": "rewrite", "texts": ["1st", "2nd"], "reasons": ["shorter"]}
        screened, decisions = await closed.screen_input(body)
        assert [m["content"] for m in screened["messages"]] == ["1st", "2nd"]
        assert decisions[0].label() == "hook:redacted"

        hook.answer = {"action": "block", "reasons": ["off-topic"]}
        with pytest.raises(GuardrailBlocked):
            await opened.screen_input(body)

        hook.answer, hook.delay = {"action": "allow"}, 1.0  # slow: past the timeout
        with pytest.raises(GuardrailBlocked):
            await closed.screen_input(body)
        screened, decisions = await opened.screen_input(body)
        assert screened is body and [d.label() for d in decisions] == ["hook:failed_open"]

        hook.delay, hook.answer = 0.0, {"nonsense": True}  # off-protocol counts as unavailable
        with pytest.raises(GuardrailBlocked):
            await closed.screen_input(body)
    await server.close()  # down: connection refused
    async with aiohttp.ClientSession() as session:
        checks = HttpChecks(session)
        with pytest.raises(GuardrailBlocked):
            await GuardrailEngine([Policy("hook", "webhook", url=url)], checks).screen_input(chat("x"))
        _, decisions = await GuardrailEngine([Policy("hook", "webhook", url=url, fail_open=True)], checks).screen_input(chat("x"))
        assert [d.label() for d in decisions] == ["hook:failed_open"]


async def test_moderation_blocks_flagged_text_and_records_the_categories() -> None:
    assert moderation_verdict({"results": [{"flagged": False, "categories": {"hate": False}}]}).action == "allow"  # type: ignore[union-attr]
    verdict = moderation_verdict({"results": [{"flagged": True, "categories": {"hate": True, "violence": False}}]})
    assert verdict is not None and verdict.action == "block" and verdict.kinds == ("hate",)
    assert moderation_verdict({"oops": 1}) is None

    async def moderation(policy: Policy, body: Any) -> Any:
        flagged = any("hate" in t for t in body["input"])
        return {"results": [{"flagged": flagged, "categories": {"hate": flagged}}]}

    async with aiohttp.ClientSession() as session:
        engine = GuardrailEngine([Policy("mod", "moderation", model="omni-moderation")], HttpChecks(session, moderation))
        await engine.screen_input(chat("a kind word"))
        with pytest.raises(GuardrailBlocked):
            await engine.screen_input(chat("words of hate"))


def _load(tmp_path: Path, text: str) -> Any:
    from gateway.core.config import load_config, load_settings

    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(load_settings({"GATEWAY_CONFIG": str(path)}), {})


GROUP = "providers: {l: {type: mock}}\nmodels: [{name: m, deployments: [{provider: l, model: m}], guardrails: [g]}]\n"


def test_the_config_file_declares_policies_and_attaches_them(tmp_path: Path) -> None:
    config = _load(tmp_path, GROUP + "guardrails: {policies: {g: {type: pii, mode: redact, direction: both}}, keys: {llmg_ab12cd34: [g]}}\n")
    policy = config.guardrails.policies["g"]
    assert (policy.name, policy.type, policy.mode, policy.applies_to_output()) == ("g", "pii", "redact", True)
    assert config.models[0].guardrails == ("g",) and config.guardrails.keys == {"llmg_ab12cd34": ("g",)}


@pytest.mark.parametrize(("extra", "message"), [
    ("", "models[0].guardrails[0]: unknown guardrail policy 'g'"),
    ("guardrails: {policies: {g: {type: webhook}}}\n", "guardrails.policies.g.url: a webhook policy needs 'url'"),
    ("guardrails: {policies: {g: {type: pii, mod: redact}}}\n", "guardrails.policies.g.mod: unknown key"),
    ("guardrails: {policies: {g: {type: pii, mode: shout}}}\n", "guardrails.policies.g.mode: expected one of block, redact, log"),
    ("guardrails: {policies: {g: {type: max_input}}}\n", "guardrails.policies.g: a max_input policy needs max_chars or max_tokens"),
    ("guardrails: {policies: {g: {type: pii}}, keys: {llmg_x: [h]}}\n", "guardrails.keys.llmg_x: unknown guardrail policy 'h'"),
])
def test_a_bad_guardrails_section_is_refused_naming_the_entry(tmp_path: Path, extra: str, message: str) -> None:
    from gateway.core.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, GROUP + extra)
    assert str(caught.value).startswith(message), str(caught.value)
