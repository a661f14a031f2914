"""The gateway role: the cluster behind an OpenAI-compatible HTTP API (see docs/api.md)."""
