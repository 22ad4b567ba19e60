"""The configuration reference (``docs/configuration.md``), generated from the typed fields.

Every key's default, range and meaning is declared once, on its field
(:func:`fedcybgd.core.fields.setting`): :class:`~fedcybgd.config.RunConfig`, the built-in update
rules' options (:mod:`fedcybgd.rules.builtin`) and :class:`~fedcybgd.config.NodeConfig`. The
reference is prose written by hand around tables made from those fields; each table sits
between two markers naming what it shows::

    <!-- generated: run-config "Communication" -->
    ...
    <!-- end generated -->

``run-config "SECTION"`` is the run config's section of that title (the fields from the one
declared with ``section="SECTION"`` up to the next section), ``rule-options`` the built-in rules'
options, ``node-config`` the node config. ``fedcybgd config-docs`` rewrites the tables in place;
``--check`` exits 1 when the file is not what the fields say (a test runs it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.core.fields import Setting, settings
from fedcybgd.rules import builtin, registry

DEFAULT_PATH = Path("docs") / "configuration.md"
_BLOCK = re.compile(
    r"(<!-- generated: (?P<what>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.DOTALL)


class ReferenceError(ValueError):
    """A marker names no table, or a table has no marker."""


def run_sections() -> dict[str, list[Setting]]:
    """The run config's keys by section, in declaration order."""
    out: dict[str, list[Setting]] = {}
    current: list[Setting] | None = None
    for s in settings(RunConfig).values():
        if s.section is not None:
            current = out.setdefault(s.section, [])
        if current is None:
            raise ReferenceError(f"run-config key {s.key!r} comes before the first section")
        current.append(s)
    return out


def builtin_options() -> list[tuple[Setting, list[str]]]:
    """The built-in rules' option keys, each once, with the rules that read it."""
    keys: dict[str, tuple[Setting, list[str]]] = {}
    for spec in registry.rule_specs():
        if spec.options is None or spec.options.__module__ != builtin.__name__:
            continue
        for key, s in settings(spec.options).items():
            keys.setdefault(key, (s, []))[1].append(spec.name)
    return list(keys.values())


def tables() -> dict[str, str]:
    """Every table the reference holds, by its marker's text."""
    out = {f'run-config "{title}"': _table(rows) for title, rows in run_sections().items()}
    options = builtin_options()
    out["rule-options"] = _table([s for s, _ in options],
                                 rules={s.key: names for s, names in options})
    out["node-config"] = _table(settings(NodeConfig).values())
    return out


def render(text: str) -> str:
    """``text`` with every generated table replaced by what the fields say now.

    Raises
    ------
    ReferenceError
        A marker names no known table, names one twice, or a table has no marker.
    """
    made = tables()
    seen: list[str] = []

    def fill(match: re.Match[str]) -> str:
        what = match.group("what")
        if what not in made:
            raise ReferenceError(f"marker {what!r} names no table; known: {sorted(made)}")
        if what in seen:
            raise ReferenceError(f"marker {what!r} appears twice")
        seen.append(what)
        return f"{match.group(1)}{made[what]}{match.group(4)}"

    out = _BLOCK.sub(fill, text)
    missing = sorted(set(made) - set(seen))
    if missing:
        raise ReferenceError(f"no marker for the table(s) {missing}")
    return out


def write(path: Path = DEFAULT_PATH, *, check: bool = False) -> bool:
    """Regenerate the tables of ``path``; returns whether it was current. With ``check``
    nothing is written."""
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if new != text and not check:
        path.write_text(new, encoding="utf-8")
    return new == text


def _table(rows: Iterable[Setting], rules: dict[str, list[str]] | None = None) -> str:
    head = ["key", "default", "allowed", "meaning"]
    if rules is not None:
        head.insert(1, "rules")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        if not s.doc:
            raise ReferenceError(f"key {s.key!r} has no doc (setting(..., doc=...))")
        cells = [f"`{s.key}`", _value(s.default), _allowed(s), s.doc]
        if rules is not None:
            cells.insert(1, ", ".join(f"`{r}`" for r in rules[s.key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    """A default as the TOML of ``[tool.flwr.app.config]`` would spell it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`".replace("\n", "\\n") if value else '`""`'
    return repr(value)


def _allowed(s: Setting) -> str:
    if s.bounds.choices is not None:
        return ", ".join(f"`{c}`" for c in s.bounds.choices)
    if s.kind is bool:
        return "true, false"
    words = s.bounds.describe()
    kind = {int: "integer", float: "number", str: "text"}[s.kind]
    return f"{kind} {words}" if words else kind
