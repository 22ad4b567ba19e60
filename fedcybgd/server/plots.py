"""A run's plots, next to its ``metrics.jsonl``: a user looks rather than reads.

One PNG, ``plots.png``, drawn from the round records (the rows of ``metrics.jsonl``), the same
for FedCyBGD and the FedAvg baselines: eval accuracy and eval loss per round (round 0 is the
model before training), the clients' train loss, cumulative megabytes down and up, the
clients' peak memory and the uploads dropped per round. Drawn with matplotlib's Agg canvas
(no display, no global backend switch) and written atomically.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedcybgd.core.atomic import write_bytes

log = logging.getLogger(__name__)

PLOTS_FILE = "plots.png"
MB = 1e6


def _number(value: Any) -> float | None:
    """A finite number from a record field, else ``None`` (absent, null, NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of the records that have a finite ``key``."""
    points = [(int(r["round"]), _number(r.get(key))) for r in records]
    kept = [(x, y) for x, y in points if y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def _dropped(record: Mapping[str, Any]) -> int:
    drops = record.get("dropped")
    if isinstance(drops, Mapping):
        return int(sum(v for v in drops.values() if _number(v) is not None))
    return 0


def write_plots(out_dir: Path, records: Sequence[Mapping[str, Any]], title: str = "") -> Path:
    """Draw the run's records into ``out_dir / plots.png``; returns the path.

    Raises whatever matplotlib or the file system raises (see :func:`plot_run`).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted((r for r in records if _number(r.get("round")) is not None),
                  key=lambda r: int(r["round"]))
    if not rows:
        raise ValueError("no round records to plot")
    last = int(rows[-1]["round"])
    trained = [r for r in rows if int(r["round"]) > 0]

    fig = Figure(figsize=(14, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    fig.suptitle(title or "run", fontsize=13)

    ax = axes[0][0]
    _line(ax, rows, "eval_accuracy", "eval accuracy", baseline=True)
    ax.set_title("Eval accuracy")
    ax.set_ylabel("accuracy")

    ax = axes[0][1]
    _line(ax, rows, "eval_loss", "eval loss", baseline=True)
    ax.set_title("Eval loss")
    ax.set_ylabel("loss")

    ax = axes[0][2]
    _line(ax, rows, "train_loss", "train loss")
    ax.set_title("Train loss (clients, weighted by examples)")
    ax.set_ylabel("loss")

    _traffic(axes[1][0], trained)

    ax = axes[1][1]
    xs, ys = _series(trained, "client_peak_mem_mb")
    ax.bar(xs, ys, color="tab:purple")
    ax.set_title("Client peak memory (largest of the round)")
    ax.set_ylabel("MiB")

    _drops(axes[1][2], trained)

    for ax in (a for row in axes for a in row):
        ax.set_xlabel("round")
        ax.set_xlim(-0.5, last + 0.5)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path = out_dir / PLOTS_FILE
    write_bytes(path, buffer.getvalue())
    return path


def _line(ax: Any, rows: Sequence[Mapping[str, Any]], key: str, label: str,
          baseline: bool = False) -> None:
    """``key`` against the round (``baseline``: the value before training as a line)."""
    xs, ys = _series(rows, key)
    if xs:
        ax.plot(xs, ys, marker="o", label=label)
        if baseline and xs[0] == 0:
            ax.axhline(ys[0], color="grey", linestyle="--", linewidth=1,
                       label="before training")
            ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no {label}", ha="center", va="center",
                transform=ax.transAxes, color="grey")


def _traffic(ax: Any, trained: Sequence[Mapping[str, Any]]) -> None:
    """Cumulative payload bytes each way and in all, by round."""
    rounds = [0] + [int(r["round"]) for r in trained]
    down = [0.0]
    up = [0.0]
    for r in trained:
        down.append(down[-1] + (_number(r.get("bytes_down")) or 0.0) / MB)
        up.append(up[-1] + (_number(r.get("bytes_up")) or 0.0) / MB)
    ax.plot(rounds, down, marker="o", label="down (server to clients)")
    ax.plot(rounds, up, marker="s", linestyle="--", label="up (clients to server)")
    ax.plot(rounds, [d + u for d, u in zip(down, up, strict=True)], linestyle=":",
            color="black", label="total")
    ax.set_title("Cumulative traffic")
    ax.set_ylabel("MB")
    ax.legend(loc="upper left", fontsize=8)


def _drops(ax: Any, trained: Sequence[Mapping[str, Any]]) -> None:
    """The uploads each round dropped."""
    drops = [_dropped(r) for r in trained]
    ax.bar([int(r["round"]) for r in trained], drops, color="tab:red")
    ax.set_ylim(0, max([1, *drops]) * 1.15)
    ax.yaxis.get_major_locator().set_params(integer=True)
    if not any(drops):
        ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes,
                color="grey")
    ax.set_title("Uploads dropped (checks failed or lost)")
    ax.set_ylabel("uploads")


def plot_run(out_dir: Path, records: Sequence[Mapping[str, Any]], title: str = "") -> Path | None:
    """:func:`write_plots`, at the end of a run: a failure is logged as a warning naming the
    error and returns ``None``; it never fails the run, whose results are already written."""
    try:
        path = write_plots(out_dir, records, title)
    except Exception as err:  # plots are a view of results already on disk: never fatal
        log.warning("could not write the plots to %s (%s: %s); the run's results are "
                    "complete without them", out_dir / PLOTS_FILE, type(err).__name__, err,
                    exc_info=True)
        return None
    log.info("plots: %s", path)
    return path
