"""Reading numbered migration files."""

from __future__ import annotations


def statements(sql: str) -> list[str]:
    """Split a migration file into statements; `--` comments end at the line's end."""
    lines = [line.split("--", 1)[0] for line in sql.splitlines()]
    return [part.strip() for part in "\n".join(lines).split(";") if part.strip()]
