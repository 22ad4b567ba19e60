"""The results page's tables, rebuilt from the Markdown the experiment scripts write.

``docs/results.md`` is prose written by hand around tables copied, never by hand, from the
reports under ``experiments/results/``. Each copied part sits between two markers naming its
source::

    <!-- results: experiments/results/payoff/payoff.md section="rotten-tomatoes / iid" table=1 -->
    ...
    <!-- /results -->

The path is relative to the repository root. Without options the whole file is copied (less
a leading ``# title`` line); ``section="HEADING"`` keeps what lies under that heading (up to
the next heading of the same or a higher level; ``section="A > B"``: heading B inside section
A); ``table=N`` keeps the N-th Markdown table of what is left (1 = the first). A copied part
may not bring a heading into the page: name a section or a table instead.

    python experiments/results_page.py            # rewrite docs/results.md's copied parts
    python experiments/results_page.py --check    # exit 1, naming each stale part
    python experiments/results_page.py PAGE.md    # another page with the same markers

Exit status: 0 current (or rewritten), 1 stale (``--check``), 2 a marker that cannot be
resolved (unknown file, section or table; an unclosed marker).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PAGE = ROOT / "docs" / "results.md"
OPEN = re.compile(r"^<!-- results: (?P<spec>.+?) -->$")
CLOSE = "<!-- /results -->"
HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


class PageError(ValueError):
    """A marker names no file, section or table, or is not closed."""


@dataclass(frozen=True)
class Source:
    """What one marker copies: a file, optionally one section of it and one table."""

    path: str
    section: str | None = None
    table: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Source:
        words = shlex.split(spec)
        if not words:
            raise PageError("a results marker names no file")
        section: str | None = None
        table: int | None = None
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if key == "section" and sep:
                section = value
            elif key == "table" and sep and value.isdigit() and int(value) >= 1:
                table = int(value)
            else:
                raise PageError(f"{spec!r}: unknown option {word!r} (section=\"...\", table=N)")
        return cls(words[0], section, table)

    def render(self, root: Path = ROOT) -> str:
        """The copied text, without a trailing newline."""
        file = root / self.path
        if not file.is_file():
            raise PageError(f"{self.path}: no such results file")
        lines = file.read_text().splitlines()
        if self.section is None:
            if lines and lines[0].startswith("# "):
                lines = lines[1:]
        else:
            lines = _section(lines, self.section, self.path)
        if self.table is not None:
            tables = _tables(lines)
            if self.table > len(tables):
                raise PageError(f"{self.path}{self._where()}: table {self.table} asked for, "
                                f"{len(tables)} there")
            lines = tables[self.table - 1]
        lines = _trim(lines)
        for line in lines:
            if HEADING.match(line):
                raise PageError(f"{self.path}{self._where()} would bring the heading "
                                f"{line!r} into the page: name a section or a table")
        return "\n".join(lines)

    def _where(self) -> str:
        return f' section="{self.section}"' if self.section is not None else ""


def _section(lines: list[str], title: str, path: str) -> list[str]:
    """The lines under the heading ``title``; ``"A > B"`` is heading B inside section A."""
    for name in title.split(" > "):
        lines = _one_section(lines, name, path)
    return lines


def _one_section(lines: list[str], title: str, path: str) -> list[str]:
    for i, line in enumerate(lines):
        m = HEADING.match(line)
        if m and m.group(2) == title:
            level = len(m.group(1))
            out = []
            for rest in lines[i + 1:]:
                n = HEADING.match(rest)
                if n and len(n.group(1)) <= level:
                    break
                out.append(rest)
            return out
    raise PageError(f"{path}: no section {title!r}")


def _tables(lines: list[str]) -> list[list[str]]:
    tables: list[list[str]] = []
    current: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def _trim(lines: list[str]) -> list[str]:
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return [line.rstrip("\n") for line in lines[start:end]]


@dataclass(frozen=True)
class Part:
    """One marked part of the page: where it is, what it copies, what it holds now."""

    spec: str
    heading: str
    start: int  # index of the first line after the opening marker
    end: int  # index of the closing marker
    current: str


def parts(text: str) -> list[Part]:
    """The page's marked parts, in order."""
    lines = text.splitlines()
    out: list[Part] = []
    heading = "(top of the page)"
    i = 0
    while i < len(lines):
        line = lines[i]
        m = HEADING.match(line)
        if m:
            heading = m.group(2)
        opened = OPEN.match(line.strip())
        if opened:
            for j in range(i + 1, len(lines)):
                if lines[j].strip() == CLOSE:
                    break
                if OPEN.match(lines[j].strip()):
                    raise PageError(f"line {i + 1}: results marker not closed before line "
                                    f"{j + 1}")
            else:
                raise PageError(f"line {i + 1}: results marker not closed")
            out.append(Part(opened.group("spec"), heading, i + 1, j,
                            "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return out


def render(text: str, root: Path = ROOT) -> tuple[str, list[Part]]:
    """The page with every marked part rebuilt, and the parts that were stale."""
    lines = text.splitlines()
    stale: list[Part] = []
    for part in reversed(parts(text)):
        fresh = Source.parse(part.spec).render(root)
        if fresh != part.current:
            stale.append(part)
        lines[part.start:part.end] = fresh.splitlines()
    out = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    return out, list(reversed(stale))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", nargs="?", type=Path, default=DEFAULT_PAGE)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when a copied part is stale")
    args = parser.parse_args(argv)
    text = args.page.read_text()
    try:
        fresh, stale = render(text)
    except PageError as exc:
        print(f"{args.page}: {exc}", file=sys.stderr)
        return 2
    resolved = args.page.resolve()
    name = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else args.page
    if args.check:
        for part in stale:
            print(f"{name}: section {part.heading!r} is stale: {part.spec} "
                  f"(run `python experiments/results_page.py`)", file=sys.stderr)
        return 1 if stale else 0
    if fresh != text:
        args.page.write_text(fresh)
    done = len(parts(fresh))
    print(f"{name}: {done} copied parts, {len(stale)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
