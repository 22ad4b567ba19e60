"""The commands behind a results file, for its report's header.

A profile's or sweep's ``results.json`` is filled by several invocations (``--resume`` keeps the
runs of earlier ones, ``--only`` picks methods), so its report names every command that
contributed, in the order first run, not only the last one.
"""

from __future__ import annotations

from typing import Any


def recorded(meta: dict[str, Any]) -> list[str]:
    """The commands a results file's ``meta`` names (``commands``, or an older ``command``)."""
    return list(meta.get("commands") or ([meta["command"]] if "command" in meta else []))


def with_command(meta: dict[str, Any], command: str) -> list[str]:
    """The commands of an earlier ``meta`` with ``command`` added, once."""
    earlier = recorded(meta)
    return earlier if command in earlier else [*earlier, command]


def commands_line(meta: dict[str, Any]) -> str:
    """A report's header line: ``Command: `...``` or ``Commands: `...`, then `...```."""
    commands = recorded(meta) or ["?"]
    label = "Command" if len(commands) == 1 else "Commands"
    return f"{label}: " + ", then ".join(f"`{c}`" for c in commands)
