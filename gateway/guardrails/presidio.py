"""Microsoft Presidio as a detector backend: the ``presidio`` policy type (an extra).

``pip install 'llm-gateway[presidio]'`` installs ``presidio-analyzer`` (and spaCy).
Presidio's analyzer runs recognizers over a spaCy pipeline:

* with no ``spacy_model`` the pipeline is spaCy's blank one for the ``language`` (a
  tokenizer, no model to load or download): Presidio's **pattern recognizers** only
  (e-mail, phone numbers through ``phonenumbers``, credit cards, IBAN, IP, URL, crypto
  wallets, dates, and country-specific ids such as US SSN, passport and driver's licence,
  UK NHS, ...), each with its own context words and checksums;
* with ``spacy_model`` (a spaCy model *installed as a package*, e.g. ``en_core_web_lg``),
  its named-entity recognition too: ``PERSON``, ``LOCATION``, ``NRP``. The gateway never
  downloads a model: one that is not installed stops the start with its path.

The adapter sits behind the same interface as the built-in detectors: a text in, a list
of non-overlapping :class:`~gateway.guardrails.detectors.Match` out, named by entity in
lower case (``[REDACTED:person]``), so ``block``, ``redact``, ``log`` and the stream
window work as for ``pii``. It runs in the caller's task, like the built-in detectors,
but costs about a millisecond per text with the blank pipeline (more with a model),
where the built-in detectors cost microseconds.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

from gateway.guardrails.detectors import Match

__all__ = ["PresidioAnalyzer", "presidio_installed"]

log = logging.getLogger("gateway.guardrails")

INSTALL_HINT = "the presidio policy type needs pip install 'llm-gateway[presidio]'"


def presidio_installed() -> bool:
    return importlib.util.find_spec("presidio_analyzer") is not None


@functools.lru_cache(maxsize=8)
def _analyzer(language: str, spacy_model: str | None) -> Any:
    """One analyzer per (language, model), built once: loading recognizers takes a while."""
    if not presidio_installed():
        raise ValueError(INSTALL_HINT)
    import spacy
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    if spacy_model is not None and not spacy.util.is_package(spacy_model):
        # Presidio would download it; this gateway never fetches a model at run time.
        raise ValueError(f"spaCy model {spacy_model!r} is not installed (pip install it; it is never downloaded)")

    class _BlankEngine(SpacyNlpEngine):  # type: ignore[misc]
        """spaCy's blank pipeline: tokens only, nothing to load."""

        def load(self) -> None:
            self.nlp = {language: spacy.blank(language)}  # type: ignore[assignment,unused-ignore]

    models = [{"lang_code": language, "model_name": spacy_model or f"blank:{language}"}]
    engine = SpacyNlpEngine(models=models) if spacy_model is not None else _BlankEngine(models=models)
    engine.load()
    registry = RecognizerRegistry(supported_languages=[language])
    # One warning per recognizer of every other language, at each start: not news.
    presidio_log = logging.getLogger("presidio-analyzer")
    level = presidio_log.level
    presidio_log.setLevel(logging.ERROR)
    try:
        registry.load_predefined_recognizers(languages=[language], nlp_engine=engine)
    finally:
        presidio_log.setLevel(level)
    analyzer = AnalyzerEngine(nlp_engine=engine, registry=registry, supported_languages=[language])
    # The e-mail recognizer's domain check reads the public-suffix list through tldextract,
    # whose default extractor fetches it from the internet on first use. The gateway never
    # reaches out at run time: the copy bundled with tldextract is used instead.
    import tldextract.tldextract

    tldextract.tldextract.TLD_EXTRACTOR = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)
    analyzer.analyze(text="warm-up mail a@example.com", language=language)  # at start, never on a call
    return analyzer


class PresidioAnalyzer:
    """Presidio's analyzer for one policy: which entities, in which language, how sure."""

    def __init__(
        self, entities: Sequence[str] = (), *, language: str = "en", score_threshold: float = 0.5,
        spacy_model: str | None = None,
    ) -> None:
        self._analyzer = _analyzer(language, spacy_model)
        self.language = language
        self.score_threshold = score_threshold
        supported = sorted(self._analyzer.get_supported_entities(language=language))
        unknown = [e for e in entities if e not in supported]
        if unknown:
            raise ValueError(f"unknown Presidio entity {unknown[0]!r} (supported here: {', '.join(supported)})")
        self.entities = list(entities) or None

    def matches(self, text: str) -> list[Match]:
        """The entities found in ``text``, non-overlapping (earlier, then longer, wins)."""
        if not text:
            return []
        results = self._analyzer.analyze(
            text=text, language=self.language, entities=self.entities, score_threshold=self.score_threshold,
        )
        found = sorted(
            (Match(r.entity_type.lower(), r.start, r.end) for r in results), key=lambda m: (m.start, m.start - m.end),
        )
        kept: list[Match] = []
        for m in found:
            if kept and m.start < kept[-1].end:
                continue
            kept.append(m)
        return kept
