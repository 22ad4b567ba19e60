"""Experiment trackers: the run's per-round record sent where people watch runs.

Every row the run writes to ``metrics.jsonl`` goes to each tracker named in ``trackers``
(comma-separated; off by default) as scalars at step ``round``: the same numbers, the same
names (a row's nested fields, e.g. ``dropped``, are left to ``metrics.jsonl``). At the start a
tracker gets the run config; at the end the summary's scalars (as ``summary/<key>``) and the
run's files (``summary.json``, ``metrics.jsonl``, ``plots.png``).

* ``tensorboard``: event files in ``<output-dir>/tensorboard`` (``tensorboard --logdir`` there);
* ``mlflow``: one MLflow run in experiment ``fedcybgd``, at ``mlflow-tracking-uri`` (default: an
  SQLite store ``<output-dir>/mlflow.db`` with artifacts in ``<output-dir>/mlartifacts``;
  ``mlflow ui --backend-store-uri sqlite:///<output-dir>/mlflow.db``);
* ``wandb``: one Weights & Biases run in project ``wandb-project``; with ``wandb-mode =
  "offline"`` (the default) it is written to ``<output-dir>/wandb`` and nothing leaves the machine
  (``wandb sync <output-dir>/wandb/offline-run-*`` uploads it later); ``"online"`` sends it to the
  server that ``wandb login`` or ``WANDB_API_KEY`` names.

A tracker whose package is missing stops the run at start, naming the extra to install
(``pip install "fedcybgd[trackers]"``); a tracker that fails during the run is logged and
dropped, and the run goes on (``metrics.jsonl`` stays the record).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from fedcybgd.config import ConfigError, RunConfig

log = logging.getLogger(__name__)

EXTRA = 'pip install "fedcybgd[trackers]"'


class Tracker(Protocol):
    """One sink of a run's records."""

    def log_row(self, row: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` row."""

    def finish(self, summary: Mapping[str, Any], files: list[Path]) -> None:
        """The summary and the run's files; the tracker closes."""


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite numbers (booleans and nested fields left out)."""
    return {key: float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and key != "round"}


class TensorBoardTracker:
    """Event files under ``<output-dir>/tensorboard``."""

    def __init__(self, run: RunConfig, out: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(f"trackers = 'tensorboard' needs the tensorboard package "
                              f"({err}); {EXTRA}") from None
        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.writer.add_text("run_config", "```\n" + json.dumps(run.to_run_config(), indent=1)
                             + "\n```", 0)

    def log_row(self, row: Mapping[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, int(row["round"]))
        self.writer.flush()

    def finish(self, summary: Mapping[str, Any], files: list[Path]) -> None:
        for key, value in scalars(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, 0)
        self.writer.add_text("summary", "```\n" + json.dumps(dict(summary), indent=1,
                                                             default=str) + "\n```", 0)
        self.writer.close()


class MlflowTracker:
    """One MLflow run (experiment ``fedcybgd``)."""

    def __init__(self, run: RunConfig, out: Path) -> None:
        try:
            import mlflow
        except ImportError as err:
            raise ConfigError(f"trackers = 'mlflow' needs mlflow ({err}); {EXTRA}") from None
        uri = run.mlflow_tracking_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("fedcybgd")
        experiment_id = (experiment.experiment_id if experiment is not None else
                         self.client.create_experiment(
                             "fedcybgd", artifact_location=(out / "mlartifacts").resolve()
                             .as_uri()))
        name = f"{run.strategy}-{run.update_rule}-seed{run.seed}"
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        for key, value in run.to_run_config().items():
            self.client.log_param(self.run_id, key, str(value)[:6000])

    def log_row(self, row: Mapping[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.client.log_metric(self.run_id, key, value, step=int(row["round"]))

    def finish(self, summary: Mapping[str, Any], files: list[Path]) -> None:
        for key, value in scalars(summary).items():
            self.client.log_metric(self.run_id, f"summary/{key}", value)
        for path in files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        status = "FINISHED" if summary.get("status") == "completed" else "FAILED"
        self.client.set_terminated(self.run_id, status=status)


class WandbTracker:
    """One Weights & Biases run (project ``wandb-project``, offline by default)."""

    def __init__(self, run: RunConfig, out: Path) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError(f"trackers = 'wandb' needs wandb ({err}); {EXTRA}") from None
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=run.wandb_project, name=f"{run.strategy}-{run.update_rule}-seed{run.seed}",
            config=run.to_run_config(), dir=str(out),
            mode="online" if run.wandb_mode == "online" else "offline",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))

    def log_row(self, row: Mapping[str, Any]) -> None:
        self.run.log(scalars(row), step=int(row["round"]))

    def finish(self, summary: Mapping[str, Any], files: list[Path]) -> None:
        for key, value in scalars(summary).items():
            self.run.summary[f"summary/{key}"] = value
        for path in files:
            if path.is_file():
                self.run.save(str(path), base_path=str(path.parent), policy="now")
        self.run.finish(exit_code=0 if summary.get("status") == "completed" else 1)


# The registry: a tracker's name -> its class (made with the run config and output folder)
TRACKERS: dict[str, Callable[[RunConfig, Path], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}


def tracker_names(text: str) -> list[str]:
    """``trackers`` as a list, each a registered tracker.

    Raises
    ------
    ConfigError
        A name is not one of :data:`TRACKERS`.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"trackers: {unknown} not known; choose from {sorted(TRACKERS)}")
    return names


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B run file (``run-<id>.wandb``), as protobuf ``Record`` messages.

    W&B lays the file out as a 7-byte header (``:W&B``, a magic number, a version), then
    32 KiB blocks of chunks, each a 7-byte header (checksum, length, kind: 1 whole, 2 first,
    3 middle, 4 last) and a piece of one record. This reads what an offline run recorded
    without a W&B server (e.g. to check it against ``metrics.jsonl``).
    """
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    records, piece, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:
            break
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(piece))  # type: ignore[attr-defined]
            piece = b""
    return records


def item_key(item: Any) -> str:
    """A W&B record item's name (``key``, or the parts of ``nested_key``)."""
    return str(item.key or "/".join(item.nested_key))


def wandb_history(run_file: Path) -> dict[str, dict[int, float]]:
    """Every logged scalar of a W&B run file: name -> {step: value} (W&B's own ``_`` keys
    left out)."""
    history: dict[str, dict[int, float]] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                if not item_key(item).startswith("_"):
                    history.setdefault(item_key(item), {})[record.history.step.num] = \
                        json.loads(item.value_json)
    return history


class Trackers:
    """The run's trackers together; one that fails is logged and dropped."""

    def __init__(self, run: RunConfig, out: Path) -> None:
        self.sinks: dict[str, Tracker] = {
            name: TRACKERS[name](run, out) for name in tracker_names(run.trackers)}

    def log_row(self, row: Mapping[str, Any]) -> None:
        self._each(lambda sink: sink.log_row(row))

    def finish(self, summary: Mapping[str, Any], files: list[Path]) -> None:
        self._each(lambda sink: sink.finish(summary, files))

    def _each(self, action: Callable[[Tracker], None]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                action(sink)
            except Exception as err:  # a tracker is a convenience: the run goes on
                log.warning("tracker %s failed (%s: %s); it records nothing more, "
                            "metrics.jsonl stays complete", name, type(err).__name__, err)
                del self.sinks[name]
