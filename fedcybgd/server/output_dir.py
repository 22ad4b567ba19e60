"""Where a run's outputs go, and when a folder may take them: pure path rules, no heavy imports.

The ServerApp (:mod:`fedcybgd.server.outputs`) and the launchers (``fedcybgd run``,
``fedcybgd deploy-local``) share them, so a folder is judged the same way before a run is
submitted and when it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

OUTPUT_ROOT_ENV = "FEDCYBGD_OUTPUT_ROOT"
# Written in an output folder by the loopback launcher (fedcybgd.deploy.local) before the
# ServerApp starts; they do not make the folder another run's.
LAUNCHER_ENTRIES = ("logs",)


def resolve_output_dir(path: str | Path, env: Mapping[str, str] | None = None,
                       cwd: Path | None = None) -> Path:
    """``path`` as an absolute folder: a relative one is taken from ``$FEDCYBGD_OUTPUT_ROOT``
    (of ``env``, default this process's environment), else from ``cwd`` (default: the
    working folder)."""
    out = Path(path).expanduser()
    if out.is_absolute():
        return out
    env = os.environ if env is None else env
    root = env.get(OUTPUT_ROOT_ENV) or str(cwd if cwd is not None else Path.cwd())
    return Path(root).expanduser().absolute() / out


def earlier_outputs(out: Path) -> list[Path]:
    """The entries of ``out`` that make it another run's folder (all but the launcher's)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name not in LAUNCHER_ENTRIES)


def name_entries(entries: list[Path], most: int = 6) -> str:
    """``summary.json, final, ...``: the first ``most`` names."""
    return ", ".join(p.name for p in entries[:most]) + (", ..." if len(entries) > most else "")


def output_dir_refusal(out: Path, resume: bool, overwrite: bool) -> str | None:
    """Why ``out`` cannot take a run with these ``resume`` / ``overwrite`` keys, whatever the
    strategy; ``None`` when it can."""
    if resume and overwrite:
        return "resume = true and overwrite = true contradict each other: set one of them"
    if out.exists() and not out.is_dir():
        return f"output-dir {out} is a file, not a folder"
    entries = earlier_outputs(out)
    if entries and not resume and not overwrite:
        return (f"output-dir {out} is not empty ({name_entries(entries)}): set resume = true "
                "to continue the run there, overwrite = true to replace its outputs, or "
                "choose another output-dir")
    return None


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (``None``: it exists): what
    creating ``path`` would add."""
    missing = None
    probe = path
    while not probe.exists():
        missing = probe
        if probe.parent == probe:
            break
        probe = probe.parent
    return missing


def holds_files(path: Path) -> bool:
    """Whether ``path`` holds anything besides (empty) folders."""
    return any(not p.is_dir() or p.is_symlink() for p in path.rglob("*"))
