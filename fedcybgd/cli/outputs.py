"""``fedcybgd report`` and ``fedcybgd plots``: read one or several run output folders.

``report`` prints the figures of each run's ``summary.json`` side by side (one column a run);
``plots`` draws a folder's ``plots.png`` again from its ``metrics.jsonl`` (after a run whose
plotting failed, or to refresh an interrupted run's picture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROWS: tuple[tuple[str, str, str], ...] = (  # (label, summary key, format)
    ("status", "status", "s"),
    ("strategy / rule", "update_rule", "s"),
    ("model", "model", "s"),
    ("rounds run", "rounds_run", "d"),
    ("eval metric before", "initial_eval_accuracy", ".3f"),
    ("eval metric after", "final_eval_accuracy", ".3f"),
    ("eval loss before", "initial_eval_loss", ".4f"),
    ("eval loss after", "final_eval_loss", ".4f"),
    ("MiB down", "bytes_down", "mib"),
    ("MiB up", "bytes_up", "mib"),
    ("client peak MiB", "client_peak_mem_mb", ".0f"),
    ("mean round s", "mean_round_s", ".1f"),
    ("dp epsilon", "dp_epsilon", ".3g"),
    ("early stop", "early_stop", "s"),
)


def read_summary(folder: Path) -> dict[str, Any]:
    """The ``summary.json`` of a run's output folder.

    Raises
    ------
    ValueError
        The folder holds no readable summary.
    """
    path = folder / "summary.json"
    try:
        summary: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder}: no readable summary.json ({err}); is it a run's "
                         "output-dir?") from None
    return summary


def report(folders: list[Path]) -> int:
    """Print the runs side by side; 2 when a folder is not a run's output."""
    from rich.console import Console
    from rich.table import Table

    try:
        summaries = [read_summary(f) for f in folders]
    except ValueError as err:
        print(f"fedcybgd report: {err}")
        return 2
    table = Table(title="runs")
    table.add_column("")
    for folder in folders:
        table.add_column(folder.name or str(folder), justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, *(_cell(s.get(key), fmt) for s in summaries))
    Console().print(table)
    return 0


def plots(folder: Path) -> int:
    """Draw ``folder/plots.png`` from ``folder/metrics.jsonl``; 2 when there is none."""
    from fedcybgd.server.plots import write_plots

    path = folder / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip()]
    except (OSError, ValueError) as err:
        print(f"fedcybgd plots: {folder}: no readable metrics.jsonl ({err})")
        return 2
    title = folder.name
    try:
        summary = read_summary(folder)
        title = f"{summary.get('update_rule')}, {summary.get('model')}"
    except ValueError:
        pass  # an interrupted run has rows but no summary yet
    print(write_plots(folder, rows, title))
    return 0


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "s":
        return str(value)
    if fmt == "mib":
        return f"{float(value) / 2**20:.1f}"
    if fmt == "d":
        return str(int(value))
    return format(float(value), fmt)
