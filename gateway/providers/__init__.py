"""Providers: one module per upstream wire, built from the config by :func:`build_provider`."""

from __future__ import annotations

import aiohttp

from gateway.core.config import ProviderConfig
from gateway.providers.base import (
    Provider,
    ProviderError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamReply,
    UpstreamTimeoutError,
)

__all__ = [
    "Provider",
    "ProviderError",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamReply",
    "UpstreamTimeoutError",
    "build_provider",
]


def build_provider(
    config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
) -> Provider:
    """The provider for ``config.type`` (openai | anthropic | azure | gemini | bedrock | vertex | mock)."""
    if config.type == "mock":
        from gateway.providers.mock import MockProvider

        return MockProvider(config, request_timeout=request_timeout)
    if config.type == "openai":
        from gateway.providers.openai import OpenAIProvider

        return OpenAIProvider(config, session, request_timeout=request_timeout)
    if config.type == "anthropic":
        from gateway.providers.anthropic import AnthropicProvider

        return AnthropicProvider(config, session, request_timeout=request_timeout)
    if config.type == "azure":
        from gateway.providers.azure import AzureProvider

        return AzureProvider(config, session, request_timeout=request_timeout)
    if config.type == "gemini":
        from gateway.providers.gemini import GeminiProvider

        return GeminiProvider(config, session, request_timeout=request_timeout)
    if config.type == "bedrock":
        from gateway.providers.bedrock import BedrockProvider

        return BedrockProvider(config, session, request_timeout=request_timeout)
    if config.type == "vertex":
        from gateway.providers.vertex import VertexProvider

        return VertexProvider(config, session, request_timeout=request_timeout)
    raise ValueError(f"provider type {config.type!r} is not available yet")
