"""Wire protocols: the SSE framing and the mappings between the internal message shape
(OpenAI chat completions) and each protocol the gateway speaks or calls."""
