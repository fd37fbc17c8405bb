"""The HTTP layer: OpenAI-compatible routes, the rerank route, admin routes, error mapping."""
