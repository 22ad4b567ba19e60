"""What the pipeline runner keeps to rebuild a stage on a spare: per stage, the messages it was
sent since its last checkpoint, their inputs on disk.

A spare replays those messages (``fedcybgd.server.pipeline.runner``), so their inputs (the
activations or gradients the stage received) must outlive the messages. Kept in memory they
would grow with every step a run takes between checkpoints (every step, without
``pipeline-checkpoint-every``); here they are written under the run's output folder as the
bytes that were sent (already checked, read back as bytes, never unpickled) and the server's
memory holds only the operations. A checkpoint drops what it covers; :meth:`ReplayLog.close`
removes the folder at the run's end.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from fedcybgd.server.pipeline.schedules import Op


@dataclass(frozen=True)
class Entry:
    """A message sent to a stage: its operation and the names of its inputs (``None``: none)."""

    op: Op
    keys: tuple[str, ...] | None


class ReplayLog:
    """Per stage, the messages since its last checkpoint (module docstring)."""

    def __init__(self, folder: Path, stages: int) -> None:
        self.folder = folder
        self.entries: list[list[Entry]] = [[] for _ in range(stages)]

    def _path(self, k: int, op: Op, key: str) -> Path:
        return self.folder / f"stage-{k}" / f"{op.kind}-{op.mb}" / f"{key}.bin"

    def add(self, k: int, op: Op, inputs: dict[str, bytes] | None) -> None:
        """Keep the message ``op`` sent to stage ``k`` with ``inputs``."""
        if inputs is not None:
            for key, data in inputs.items():
                path = self._path(k, op, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        self.entries[k].append(Entry(op, None if inputs is None else tuple(inputs)))

    def ops(self, k: int) -> list[Op]:
        """The operations of stage ``k`` since its last checkpoint, in the order sent."""
        return [e.op for e in self.entries[k]]

    def inputs(self, k: int, op: Op) -> dict[str, bytes] | None:
        """The inputs ``op`` was sent with."""
        entry = next(e for e in self.entries[k] if e.op == op)
        if entry.keys is None:
            return None
        return {key: self._path(k, op, key).read_bytes() for key in entry.keys}

    def pop(self, k: int) -> tuple[Op, dict[str, bytes] | None]:
        """Forget stage ``k``'s latest message; its operation and inputs."""
        op = self.entries[k][-1].op
        inputs = self.inputs(k, op)
        self._remove(k, self.entries[k].pop())
        return op, inputs

    def checkpoint(self, k: int, step: int) -> None:
        """Forget stage ``k``'s messages of steps up to ``step`` (a checkpoint holds them)."""
        for entry in [e for e in self.entries[k] if e.op.mb <= step]:
            self._remove(k, entry)
        self.entries[k] = [e for e in self.entries[k] if e.op.mb > step]

    def _remove(self, k: int, entry: Entry) -> None:
        folder = self.folder / f"stage-{k}" / f"{entry.op.kind}-{entry.op.mb}"
        if folder.exists():
            shutil.rmtree(folder)

    def close(self) -> None:
        """Remove everything kept (the run is over)."""
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.entries = [[] for _ in self.entries]
