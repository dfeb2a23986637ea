"""What the built-in PII and secret detectors find in a text, and how a match is checked.

Each detector is a regular expression for the shape plus, where the shape alone is
ambiguous, a validator on the matched text: a card number must pass the Luhn check, an
IBAN its ISO 13616 mod-97 check, an IP address must parse. The validators are what keep
order numbers, timestamps and version strings from being taken for PII. A regex cannot
know meaning: a 16-digit number that happens to pass Luhn is a "card"; a phone number
written in words is not found. ``docs/guardrails.md`` lists each detector's limits and
its measured precision and recall on the labelled set in ``tests/data``.

Matches never overlap: where two detectors match the same text, the earlier and then
longer match wins, so a card number is not also reported as a phone number.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DETECTORS",
    "MAX_MATCH_CHARS",
    "NATIONAL_ID_DETECTORS",
    "Detector",
    "Match",
    "find_matches",
    "iban_valid",
    "luhn_valid",
    "redact",
]


@dataclass(frozen=True, slots=True)
class Detector:
    """One kind of sensitive text: its name (in metrics and the ledger), shape and check."""

    name: str
    pattern: re.Pattern[str]
    #: Called on the matched text; False drops the match (e.g. a failed Luhn check).
    valid: Callable[[str], bool] | None = None


@dataclass(frozen=True, slots=True)
class Match:
    """Where one detector matched: ``text[start:end]``."""

    detector: str
    start: int
    end: int


def luhn_valid(candidate: str) -> bool:
    """The Luhn checksum of the digits of ``candidate`` (card numbers), 13 to 19 digits."""
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19 or len(set(digits)) == 1:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


#: ISO 13616 IBAN lengths by country (the common ones; others are checked by mod-97 alone).
_IBAN_LENGTHS = {
    "AD": 24, "AT": 20, "BE": 16, "BG": 22, "CH": 21, "CY": 28, "CZ": 24, "DE": 22, "DK": 18,
    "EE": 20, "ES": 24, "FI": 18, "FR": 27, "GB": 22, "GR": 27, "HR": 21, "HU": 28, "IE": 22,
    "IS": 26, "IT": 27, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MT": 31, "NL": 18,
    "NO": 15, "PL": 28, "PT": 25, "RO": 24, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "TR": 26,
}


def iban_valid(candidate: str) -> bool:
    """The IBAN's length for its country and its mod-97 check digits."""
    iban = re.sub(r"[\s-]", "", candidate).upper()
    expected = _IBAN_LENGTHS.get(iban[:2])
    if expected is not None and len(iban) != expected:
        return False
    if not 15 <= len(iban) <= 34:
        return False
    rearranged = iban[4:] + iban[:4]
    number = "".join(str(int(c, 36)) for c in rearranged)
    return int(number) % 97 == 1


def _ip_valid(candidate: str) -> bool:
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    # Unspecified and loopback addresses identify nobody; version strings like 1.2.3.4
    # are still reported, which is the documented price of a shape-only detector.
    return not (address.is_unspecified or address.is_loopback)


_DATE_LIKE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{2,4}")
#: The US SSN's shape is left to the ``us_ssn`` detector.
_SSN_LIKE = re.compile(r"\d{3}-\d{2}-\d{4}")


def _phone_valid(candidate: str) -> bool:
    digits = sum(c.isdigit() for c in candidate)
    # Dates (2024-05-01, 01.05.2024) have a phone number's shape and digit count.
    shape = candidate.strip()
    # A national number (no +country prefix) has at most 11 digits; longer groups of digits
    # are account, ticket or part numbers far more often than phones.
    if not shape.startswith("+") and digits > 11:
        return False
    return 8 <= digits <= 15 and _DATE_LIKE.fullmatch(shape) is None and _SSN_LIKE.fullmatch(shape) is None


#: File extensions that look like top-level domains after an ``@`` (``icon@2x.png``).
_FILE_SUFFIXES = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "pdf", "txt", "json", "yaml", "yml", "md"})


def _email_valid(candidate: str) -> bool:
    return candidate.rsplit(".", 1)[-1].lower() not in _FILE_SUFFIXES


_VERHOEFF_D = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 6, 7, 8, 9, 5], [2, 3, 4, 0, 1, 7, 8, 9, 5, 6],
    [3, 4, 0, 1, 2, 8, 9, 5, 6, 7], [4, 0, 1, 2, 3, 9, 5, 6, 7, 8], [5, 9, 8, 7, 6, 0, 4, 3, 2, 1],
    [6, 5, 9, 8, 7, 1, 0, 4, 3, 2], [7, 6, 5, 9, 8, 2, 1, 0, 4, 3], [8, 7, 6, 5, 9, 3, 2, 1, 0, 4],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
]
_VERHOEFF_P = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 5, 7, 6, 2, 8, 3, 0, 9, 4], [5, 8, 0, 3, 7, 9, 6, 1, 4, 2],
    [8, 9, 1, 6, 0, 4, 3, 5, 2, 7], [9, 4, 5, 3, 1, 2, 6, 8, 7, 0], [4, 2, 8, 6, 5, 7, 3, 9, 0, 1],
    [2, 7, 9, 3, 8, 0, 6, 4, 1, 5], [7, 0, 4, 6, 9, 1, 3, 2, 5, 8],
]


def _verhoeff_valid(candidate: str) -> bool:
    """The Verhoeff check digit (Aadhaar numbers)."""
    check = 0
    for i, c in enumerate(reversed([int(c) for c in candidate if c.isdigit()])):
        check = _VERHOEFF_D[check][_VERHOEFF_P[i % 8][c]]
    return check == 0


def _ssn_valid(candidate: str) -> bool:
    area, group, serial = candidate.split("-")
    return area not in ("000", "666") and not area.startswith("9") and group != "00" and serial != "0000"


_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]{1,64}@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}(?![\w-])")
# International (+CC ...) or a national number with separators: (555) 123-4567, 030 1234567.
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,4}(?:[\s.-]\d{2,8}){1,4}(?![\w-])"
    r"|(?<![\w+])\+\d{8,15}(?!\w)"
)
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
# Grouped by four as printed (the last group shorter), or run together; upper case.
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?(?![A-Za-z0-9])")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){2,7}[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{1,4})*(?![\w:])")
_API_KEY = re.compile(
    r"(?<![\w-])(?:"
    r"sk-(?:proj-|ant-(?:api\d{2}-)?)?[A-Za-z0-9_-]{20,}"  # OpenAI, Anthropic
    r"|AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}"  # AWS access key ids
    r"|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,}"  # GitHub
    r"|xox[baprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AIza[0-9A-Za-z_-]{35}"  # Google API keys
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab
    r"|llmg_[A-Za-z0-9_]{16,}"  # this gateway's own keys
    r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"  # JWTs
    r")(?![\w-])"
)
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z]+ )*PRIVATE KEY-----"
)

#: National id formats, by name; a policy picks the ones that apply to its users.
NATIONAL_ID_DETECTORS: dict[str, Detector] = {
    "us_ssn": Detector("us_ssn", re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"), _ssn_valid),
    "uk_nino": Detector(
        "uk_nino", re.compile(r"(?<![A-Za-z0-9])(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z]{2}\s?\d{2}\s?\d{2}\s?\d{2}\s?[A-D](?![A-Za-z0-9])")
    ),
    "in_aadhaar": Detector(
        "in_aadhaar", re.compile(r"(?<!\d)(?<!\d\s)[2-9]\d{3}\s?\d{4}\s?\d{4}(?!\s?\d)"), _verhoeff_valid
    ),
}

#: Every built-in detector by name (national ids included; ``pii`` policies list theirs).
DETECTORS: dict[str, Detector] = {
    "private_key": Detector("private_key", _PRIVATE_KEY),
    "api_key": Detector("api_key", _API_KEY),
    "email": Detector("email", _EMAIL, _email_valid),
    "iban": Detector("iban", _IBAN, iban_valid),
    "card_number": Detector("card_number", _CARD, luhn_valid),
    **NATIONAL_ID_DETECTORS,
    "ip_address": Detector("ip_address", _IPV4, _ip_valid),
    "ipv6_address": Detector("ipv6_address", _IPV6, _ip_valid),
    "phone_number": Detector("phone_number", _PHONE, _phone_valid),
}

#: The longest match a streamed answer must be able to see whole (bar private keys,
#: which are held from their BEGIN line: see :mod:`gateway.guardrails.streams`).
MAX_MATCH_CHARS = 160


def find_matches(text: str, detectors: Iterable[Detector]) -> list[Match]:
    """Every validated match in ``text``, non-overlapping, in order."""
    found: list[Match] = []
    for detector in detectors:
        for hit in detector.pattern.finditer(text):
            if detector.valid is None or detector.valid(hit.group()):
                found.append(Match(detector.name, hit.start(), hit.end()))
    found.sort(key=lambda match: (match.start, -(match.end - match.start)))
    kept: list[Match] = []
    for match in found:
        if kept and match.start < kept[-1].end:
            continue
        kept.append(match)
    return kept


def redact(text: str, matches: Sequence[Match]) -> str:
    """``text`` with each match replaced by ``[REDACTED:<detector>]``."""
    out: list[str] = []
    at = 0
    for m in matches:
        out.append(text[at:m.start])
        out.append(f"[REDACTED:{m.detector}]")
        at = m.end
    out.append(text[at:])
    return "".join(out)
