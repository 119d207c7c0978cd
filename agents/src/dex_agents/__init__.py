"""Durable agent sessions on dex_engine (the session Flow arrives with the dex_agents core issue)."""

__all__: list[str] = []
