"""Call ids (the ledger's idempotency key) are version-4 UUIDs, unique per call."""

from __future__ import annotations

import uuid

from gateway.core.usage import CallRecord, new_call_id


def test_call_ids_are_distinct_version_4_uuids() -> None:
    ids = {new_call_id() for _ in range(100_000)}
    assert len(ids) == 100_000
    sample = next(iter(ids))
    assert sample.version == 4 and sample.variant == uuid.RFC_4122
    records = [CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model="m") for _ in range(3)]
    assert len({r.call_id for r in records}) == 3
