"""Why a run failed or was refused, in one line: read from Flower's own outputs.

* a run that failed: the run's ``status-details`` (``ServerApp failed with exception: ...``),
  else the last exception line of its streamed log;
* a run the SuperLink refused to start (``[code: 15] Invalid run configuration.``): the
  managed local SuperLink's log line that says why, and for a run-config key the app does not
  have, the closest key it has (``did you mean 'num-server-rounds'?``).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedcybgd.core.fields import unknown_key

LOCAL_ADDRESSES = (":local:", ":local-in-memory:")  # Flower's managed local SuperLink

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DETAILS_PREFIX = re.compile(r"^(?:ServerApp|Simulation) failed with exception:\s*")
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed|Failure))(?:\([\w.]*\))?: (.+)$")
_MISSING_KEY = re.compile(r"Key '([^']+)' is not present in the main dictionary")
_SUPERLINK_ERROR = re.compile(r"^ERROR\b")


def plain(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


def flower_home(env: Mapping[str, str] | None = None) -> Path:
    """Flower's home folder: ``$FLWR_HOME``, else ``~/.flwr`` (as the ``flwr`` CLI has it)."""
    env = os.environ if env is None else env
    return Path(env["FLWR_HOME"]) if env.get("FLWR_HOME") else Path.home() / ".flwr"


def superlink_address(home: Path, connection: str | None) -> str | None:
    """The address of SuperLink connection ``connection`` (``None``: the default one) in
    ``home/config.toml``, or ``None`` when the file or the connection is not there."""
    path = home / "config.toml"
    if not path.is_file():
        return None
    with path.open("rb") as f:
        superlink = tomllib.load(f).get("superlink", {})
    name = connection if connection is not None else superlink.get("default")
    entry = superlink.get(name) if isinstance(name, str) else None
    address = entry.get("address") if isinstance(entry, dict) else None
    return address if isinstance(address, str) else None


def local_superlink_log(home: Path, connection: str | None) -> Path | None:
    """The managed local SuperLink's log file, when ``connection`` is that SuperLink."""
    if superlink_address(home, connection) not in LOCAL_ADDRESSES:
        return None
    return home / "local-superlink" / "superlink.log"


def failure_line(status_details: str, log_lines: Iterable[str]) -> str | None:
    """The one line that says why a run failed: its status details, else the last exception
    line of its log, else ``None``."""
    details = _DETAILS_PREFIX.sub("", plain(status_details).strip())
    if details and details not in ("N/A", "Task failed with unknown error."):
        return details.splitlines()[0]
    last = None
    for line in log_lines:
        match = _EXCEPTION_LINE.match(plain(line).strip())
        if match:
            last = f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
    return last


def superlink_errors(log_text: str) -> list[str]:
    """The ERROR lines of a SuperLink log excerpt, without the logger's prefix."""
    errors = []
    for line in plain(log_text).splitlines():
        if _SUPERLINK_ERROR.match(line):
            errors.append(line.split(" | ", 2)[-1].strip())
    return errors


def app_config_keys(app: Path) -> set[str] | None:
    """The run-config keys of the Flower App in folder ``app`` (its
    ``[tool.flwr.app.config]``, nested tables as dotted keys), or ``None`` if it has none."""
    path = app / "pyproject.toml"
    if not path.is_file():
        return None
    with path.open("rb") as f:
        table = tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(table, dict):
        return None
    return set(_flatten(table))


def _flatten(table: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    for key, value in table.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def unknown_key_hints(refusal: Iterable[str], overrides: Iterable[str],
                      known: set[str] | None) -> list[str]:
    """A line per run-config key the app does not have, with the closest key it has.

    Parameters
    ----------
    refusal : Iterable[str]
        The SuperLink's error lines about the refused run (they name the key it refused).
    overrides : Iterable[str]
        The keys the run config overrides (those the app lacks are named too).
    known : set of str, optional
        The app's run-config keys; ``None``: unknown, no hints.
    """
    if known is None:
        return []
    named = [m.group(1) for line in refusal for m in _MISSING_KEY.finditer(line)]
    keys = dict.fromkeys([*named, *(k for k in overrides if k not in known)])
    return [f"run-config {unknown_key(key, known)}" for key in keys]
