"""The test harness's own promises: the ports it hands out, and a gateway process that
finds its port taken between the choice and the bind."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests import conftest


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [conftest.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


async def test_a_gateway_whose_port_was_taken_starts_again_on_others(
    process_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Something else takes the data port after free_port chose it (as an outgoing
    # connection's ephemeral port can): the gateway exits saying so, and the harness
    # starts it again on other ports rather than failing the test that asked for it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        real = conftest.free_port

        def ports() -> Iterator[int]:
            yield taken_port
            while True:
                yield real()

        chosen = ports()
        monkeypatch.setattr(conftest, "free_port", lambda: next(chosen))
        gateway = await process_factory()
        assert gateway.port != taken_port
        assert gateway.proc.poll() is None
