"""What the semantic cache compares, and the bounded in-process vector index.

Only the conversation's **final user message** is compared by meaning. Everything else
(the routed model group, the requested model, every generation parameter, the system
prompt and every earlier turn, the cache scope) is a hard partition: a hash that must be
equal before two prompts are compared at all. Within a partition a stored prompt
answers a new one when

* the cosine similarity of their embeddings reaches the group's threshold, and
* their :class:`Guard` signatures agree: the same numbers (digits and number words),
  the same proper names in the same order, and the same count of negations.

Why the guards: sentence embeddings are close to a bag of words. On the labelled set in
``tests/data/semantic_pairs.json`` "Convert 100 USD to EUR" and "Convert 100 EUR to USD"
score 0.978 and a Celsius/Fahrenheit swap 0.995, above any paraphrase threshold;
"three" vs "five benefits" scores 0.94. A guard refuses such a hit; a paraphrase keeps
its numbers, names and negations, so the guards cost few good hits.

:class:`SemanticIndex` holds the vectors, grouped by partition, bounded in total; it is
owned by the cache actor and published to handlers as immutable per-partition
snapshots, so a search costs no mailbox hop. numpy is used when installed (it comes with
the ``[semantic]`` extra); otherwise plain Python does the dot products.
"""

from __future__ import annotations

import array
import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "Guard",
    "Match",
    "SemanticIndex",
    "final_user_text",
    "guard_of",
    "partition_of",
    "unit_vector",
    "vector_from_bytes",
    "vector_to_bytes",
]

try:  # numpy is optional: the [semantic] extra brings it
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only where numpy is absent
    _np = None  # type: ignore[assignment]

#: Candidates above the threshold checked against the guards, best first.
TOP_CANDIDATES = 4

_APOSTROPHES = "'\u2019"
_WORD = re.compile(rf"[A-Za-z0-9][A-Za-z0-9{_APOSTROPHES}.\-]*")
_NUMBER_WORDS = frozenset([
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    "hundred", "thousand", "million", "billion", "trillion", "half", "quarter", "double", "triple",
    "dozen", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
    "tenth", "once", "twice",
])
_NEGATIONS = frozenset(["not", "no", "never", "none", "nothing", "nobody", "neither", "nor", "without", "cannot"])


@dataclass(frozen=True, slots=True)
class Guard:
    """The parts of a prompt a paraphrase keeps and a near-miss tends to change."""

    numbers: tuple[str, ...]  # sorted: "three" and "3" are different on purpose (cheap, strict)
    names: tuple[str, ...]  # capitalised words after the first, and acronyms, lower-cased, in order
    negations: int

    def agrees(self, other: Guard) -> bool:
        """True when a stored prompt with ``other`` may answer one with this guard."""
        if self.numbers != other.numbers or self.negations != other.negations:
            return False
        # Names both prompts mention must come in the same order ("USD to EUR" ≠ "EUR to USD");
        # a name only one of them capitalises ("eiffel tower") is left to the similarity.
        common = set(self.names) & set(other.names)
        return [n for n in self.names if n in common] == [n for n in other.names if n in common]

    def to_json(self) -> list[Any]:
        return [list(self.numbers), list(self.names), self.negations]

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> Guard:
        return cls(tuple(raw[0]), tuple(raw[1]), int(raw[2]))


def guard_of(text: str) -> Guard:
    """The guard signature of one prompt."""
    numbers: list[str] = []
    names: list[str] = []
    negations = 0
    for index, match in enumerate(_WORD.finditer(text)):
        word = match.group().strip(f".-{_APOSTROPHES}")
        if not word:
            continue
        lower = word.lower()
        if lower.replace("\u2019", "'").endswith("n't") or lower in _NEGATIONS:
            negations += 1
        if any(c.isdigit() for c in word) or lower in _NUMBER_WORDS:
            numbers.append(lower)
        elif (index > 0 and word[0].isupper() and word != "I") or (len(word) > 1 and word.isupper()):
            names.append(lower)
    return Guard(tuple(sorted(numbers)), tuple(names), negations)


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None  # an image or audio part: its meaning is not in the text
            parts.append(part["text"])
        return "\n".join(parts)
    return None


def final_user_text(messages: Sequence[Any]) -> str | None:
    """The last message's text when it is a plain-text user message; else None (exact only)."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    text = _text_of(last.get("content"))
    return text if text and text.strip() else None


def partition_of(exact_key_material: Mapping[str, Any], embedder_name: str) -> str:
    """The hard partition: everything in the exact key except the final message's text.

    ``exact_key_material`` is the normalised request the exact key hashes; the final
    message is replaced by its role so only its text is left to the similarity.
    """
    material = dict(exact_key_material)
    body = dict(material["body"])
    messages = list(body["messages"])
    messages[-1] = {**messages[-1], "content": "<semantic>"}
    body["messages"] = messages
    material["body"] = body
    material["embedder"] = embedder_name
    return hashlib.blake2b(orjson.dumps(material, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()


# --------------------------------------------------------------------------- vectors
def unit_vector(values: Iterable[float]) -> Any:
    """``values`` as a float32 unit vector (numpy array, or ``array('f')`` without numpy)."""
    if _np is not None:
        vector = _np.asarray(list(values) if not hasattr(values, "__array__") else values, dtype=_np.float32)
        norm = float(_np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector
    floats = array.array("f", values)
    norm = math.sqrt(sum(v * v for v in floats)) or 1.0
    return array.array("f", (v / norm for v in floats))


def vector_to_bytes(vector: Any) -> bytes:
    """Little-endian float32 bytes (for Redis announcements)."""
    if _np is not None:
        return bytes(_np.asarray(vector, dtype="<f4").tobytes())
    return array.array("f", vector).tobytes()


def vector_from_bytes(raw: bytes) -> Any:
    if _np is not None:
        return _np.frombuffer(raw, dtype="<f4").copy()
    out = array.array("f")
    out.frombytes(raw)
    return out


@dataclass(frozen=True, slots=True)
class Match:
    """The stored prompt that answers a new one."""

    key: str
    similarity: float


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """One partition's vectors, immutable: handlers search it without asking the actor."""

    keys: tuple[str, ...]
    guards: tuple[Guard, ...]
    expires: tuple[float, ...]
    matrix: Any  # numpy (n, d) float32, or a tuple of array('f') rows

    def search(self, vector: Any, guard: Guard, threshold: float, now: float) -> tuple[Match | None, float]:
        """The best stored prompt passing threshold and guards, and the best score seen."""
        if not self.keys:
            return None, 0.0
        if _np is not None and isinstance(self.matrix, _np.ndarray):
            if self.matrix.shape[1] != len(vector):
                return None, 0.0
            scores = self.matrix @ vector
            order = _np.argsort(-scores)[:TOP_CANDIDATES]
            ranked = [(float(scores[i]), int(i)) for i in order]
        else:
            if len(self.matrix[0]) != len(vector):
                return None, 0.0
            ranked = sorted(
                ((sum(a * b for a, b in zip(row, vector, strict=True)), i) for i, row in enumerate(self.matrix)),
                reverse=True,
            )[:TOP_CANDIDATES]
        best_seen = ranked[0][0]
        for score, i in ranked:
            if score < threshold:
                break
            if self.expires[i] > now and guard.agrees(self.guards[i]):
                return Match(self.keys[i], min(score, 1.0)), best_seen
        return None, best_seen


_EMPTY = _Snapshot((), (), (), ())


class SemanticIndex:
    """Vectors by partition, at most ``max_vectors`` in all (oldest partition entry out first).

    Mutated only by its owner (the cache actor); :meth:`snapshot` hands out the current
    immutable view of one partition. A partition is rebuilt on every change, which is
    O(partition size): partitions are small (one conversation prefix, one parameter set).
    """

    def __init__(self, max_vectors: int) -> None:
        self._max = max_vectors
        #: key -> (partition, vector, guard, expires_at); insertion order = age.
        self._rows: OrderedDict[str, tuple[str, Any, Guard, float]] = OrderedDict()
        self._partitions: dict[str, dict[str, None]] = {}
        self._snapshots: dict[str, _Snapshot] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def snapshot(self, partition: str) -> _Snapshot:
        return self._snapshots.get(partition, _EMPTY)

    def add(self, key: str, partition: str, vector: Any, guard: Guard, expires_at: float) -> None:
        dirty = {partition}
        if key in self._rows:
            dirty.add(self._drop(key))
        self._rows[key] = (partition, vector, guard, expires_at)
        self._partitions.setdefault(partition, {})[key] = None
        while len(self._rows) > self._max:
            oldest = next(iter(self._rows))
            dirty.add(self._drop(oldest))
        for p in dirty:
            self._rebuild(p)

    def discard(self, keys: Iterable[str]) -> int:
        dirty: set[str] = set()
        for key in keys:
            if key in self._rows:
                dirty.add(self._drop(key))
        for p in dirty:
            self._rebuild(p)
        return len(dirty)

    def expire(self, now: float) -> int:
        gone = [k for k, row in self._rows.items() if row[3] <= now]
        self.discard(gone)
        return len(gone)

    def clear(self) -> None:
        self._rows.clear()
        self._partitions.clear()
        self._snapshots.clear()

    def _drop(self, key: str) -> str:
        partition = self._rows.pop(key)[0]
        members = self._partitions.get(partition)
        if members is not None:
            members.pop(key, None)
            if not members:
                del self._partitions[partition]
        return partition

    def _rebuild(self, partition: str) -> None:
        members = self._partitions.get(partition)
        if not members:
            self._snapshots.pop(partition, None)
            return
        keys = tuple(members)
        rows = [self._rows[k] for k in keys]
        # One partition holds one embedder's vectors (its name is part of the partition).
        vectors = [r[1] for r in rows]
        matrix = _np.vstack(vectors).astype(_np.float32) if _np is not None else tuple(vectors)
        self._snapshots[partition] = _Snapshot(
            keys=keys, guards=tuple(r[2] for r in rows), expires=tuple(r[3] for r in rows), matrix=matrix
        )
