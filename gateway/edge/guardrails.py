"""The guardrails' I/O at the edge: the webhook over the gateway's client session, and a
moderation policy's call to the deployment of its model group."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.core.config import GatewayConfig
from gateway.guardrails.external import HttpChecks
from gateway.guardrails.policies import Policy
from gateway.guardrails.registry import Guardrails
from gateway.providers import Provider
from gateway.relay.routing import Router

__all__ = ["build_guardrails"]


def build_guardrails(
    config: GatewayConfig, session: aiohttp.ClientSession, router: Router, providers: Mapping[str, Provider]
) -> Guardrails:
    """Every group's and key's policies, compiled, with their external checks wired."""

    async def moderate(policy: Policy, body: Mapping[str, Any]) -> Any:
        # The first deployment of the policy's model group serves OpenAI's /moderations.
        assert policy.model is not None
        target = router.resolve(policy.model).targets[0]
        provider = providers[target.provider]
        headers = {"Content-Type": "application/json", **await provider.credential_headers()}
        async with session.post(
            f"{provider.passthrough_base}/moderations",
            data=orjson.dumps({"model": target.upstream_model, **body}), headers=headers,
        ) as resp:
            if resp.status != 200:
                raise ValueError(f"moderation answered {resp.status}")
            return orjson.loads(await resp.read())

    return Guardrails(config.guardrails, config.models, HttpChecks(session, moderate))
