"""Call ids (the ledger's idempotency key) are version-4 UUIDs, unique per call."""

from __future__ import annotations

import copy
import pickle
import random
import uuid

import orjson
import pytest

from gateway.core.usage import CallRecord, new_call_id


def test_call_ids_are_distinct_version_4_uuids() -> None:
    ids = {new_call_id() for _ in range(100_000)}
    assert len(ids) == 100_000
    sample = next(iter(ids))
    assert sample.version == 4 and sample.variant == uuid.RFC_4122
    records = [CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model="m") for _ in range(3)]
    assert len({r.call_id for r in records}) == 3


def test_a_call_id_is_the_uuid_that_uuid_UUID_makes_of_the_same_bits() -> None:
    state = random.getstate()
    try:
        for seed in range(2000):
            random.seed(seed)
            made = new_call_id()
            random.seed(seed)
            expected = uuid.UUID(int=random.getrandbits(128), version=4)
            assert type(made) is uuid.UUID
            assert (made, made.int, str(made), hash(made), made.is_safe) == (
                expected, expected.int, str(expected), hash(expected), expected.is_safe)
            assert made.version == 4 and made.variant == uuid.RFC_4122
        assert pickle.loads(pickle.dumps(made)) == made and copy.deepcopy(made) == made
        assert orjson.dumps(made) == f'"{made}"'.encode()
        with pytest.raises(TypeError):
            made.int = 0  # type: ignore[misc]  # immutable, as every UUID
    finally:
        random.setstate(state)
