"""The ``fo`` rule through the block's ExecuTorch program (node config ``trainer = "executorch"``).

The same AdamW steps as :class:`fedcybgd.client.updates.fo.FirstOrder`, on the same batches,
computed by ExecuTorch's runtime instead of eager PyTorch (:mod:`fedcybgd.model.block_programs`).
The node exports each block's program the first time it is assigned that block, into its
rule-state folder (``executorch/<base hash>-<batch>x<window>-<torch>-<executorch>/``; minutes for
SmolLM2, once; a program whose file no longer matches its checksum is exported again), then
every round writes the round's weights (the model as the node holds it: its cached blocks and
the block's start) beside it and trains. The protocol does not change: the trained block goes
back into the model and is uploaded as the eager node's would be.

What the programs do not cover is refused before the round trains, by name
(:func:`fedcybgd.client.updates.programs.unsupported`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from fedcybgd.data.prompts import Batch
from fedcybgd.model.block_programs import (
    IGNORE,
    BlockProgram,
    ProgramTrainer,
    export_block,
    logits_mb,
    named_tensors,
    program_intact,
    read_manifest,
    runtime_key,
)
from fedcybgd.model.blocks import BlockMap
from fedcybgd.rules import TrainOutcome, TrainTask
from fedcybgd.rules.builtin import FoOptions

MB = 2**20

__all__ = ["NodePrograms", "ProgramFirstOrder", "program_inputs"]


def program_inputs(batch: Batch, rows: int, seq: int) -> tuple[torch.Tensor, ...]:
    """``(ids, mask, targets)`` of ``batch`` at the program's fixed ``rows`` x ``seq``: the
    windows right-padded (a masked position's token changes nothing); a row the batch lacks
    attends to one token and scores nothing."""
    have, width = batch.input_ids.shape
    if have > rows or width > seq:
        raise ValueError(f"a batch of {have} x {width} tokens does not fit the program's "
                         f"{rows} x {seq}")
    ids = torch.zeros((rows, seq), dtype=torch.long)
    mask = torch.zeros((rows, seq), dtype=torch.long)
    ids[:have, :width] = batch.input_ids.cpu()
    mask[:have, :width] = batch.attention_mask.cpu()
    mask[have:, 0] = 1
    targets = torch.full((rows, seq - 1), IGNORE, dtype=torch.long)
    if batch.score_rows is None or batch.score_positions is None:
        raise ValueError("the batch has no scored positions (not an `lm` batch)")
    targets[batch.score_rows.cpu(), batch.score_positions.cpu()] = batch.target_ids.cpu()
    return ids, mask, targets


class NodePrograms(ABC):
    """A node's block programs of one kind (:data:`~fedcybgd.model.block_programs.KINDS`),
    exported the first time a block needs one.

    Parameters
    ----------
    folder
        The node's program folder (one sub-folder per weights, shapes and runtime versions).
    model_name, base_hash
        The model the programs are exported from and its weights' checksum (the manifest's).
    rows, seq
        The run's ``batch-size`` and ``max-seq-len``.
    """

    kind = "fo"

    def __init__(self, folder: Path, model_name: str, base_hash: str, rows: int,
                 seq: int) -> None:
        self.folder, self.model_name, self.base_hash = folder, model_name, base_hash
        self.rows, self.seq = rows, seq

    def programs(self) -> Path:
        """The folder of the programs for these weights, shapes and runtime versions."""
        return self.folder / runtime_key(self.base_hash, self.rows, self.seq)

    def program(self, model: torch.nn.Module, blocks: BlockMap, block: str) -> BlockProgram:
        """``block``'s program, exported now from ``model`` unless the folder holds one for this
        block, these weights and shapes, and these runtime versions, whose file matches its
        checksum (a manifest of another release of this module, or torn, exports again)."""
        folder = self.programs()
        try:
            entry = read_manifest(folder, self.kind).get(block)
        except (OSError, ValueError, TypeError, KeyError):  # none yet, or a torn one
            entry = None
        if entry is not None and program_intact(folder, entry):
            return entry
        return export_block(model, blocks, block, folder,  # type: ignore[arg-type]
                            name=self.model_name, base_hash=self.base_hash, batch=self.rows,
                            seq=self.seq, with_weights=False, kind=self.kind)

    @abstractmethod
    def train(self, task: TrainTask) -> TrainOutcome:
        """Train ``task.block`` through its program; the trained block is written back into
        ``task.model``."""

    @abstractmethod
    def need_mb(self, entry: BlockProgram, held_mb: float, runtime_mb: float,
                options: dict[str, Any]) -> float:
        """Estimated peak resident memory (MiB) of a round through ``entry`` by a process
        whose runtime holds ``runtime_mb`` besides the node's model (``held_mb``); ``options``:
        the rule's, as the round runs them."""


class ProgramFirstOrder(NodePrograms):
    """``fo`` through the block's ExecuTorch program; see the module docstring and
    :class:`NodePrograms` for the parameters."""

    name = "fo"
    kind = "fo"

    @staticmethod
    def peak_mb(entry: BlockProgram, held_mb: float, runtime_mb: float) -> float:
        """Estimated peak resident memory (MiB) of a round trained through ``entry``'s program,
        by a process whose runtime holds ``runtime_mb`` besides the node's model (``held_mb``).

        On top of the node's own model the runtime holds the round's weights file
        (:func:`~fedcybgd.model.block_programs.write_weights` streams it from the model's
        tensors; the runtime reads it whole, the block's weights copied into its plan), the
        memory the program plans for a step (activations, gradients: fixed at export, the
        manifest's ``planned_bytes``), the loss's scratch beside the plan (:func:`~fedcybgd.
        model.block_programs.logits_mb`), AdamW's two moments of the block and the trained
        block's copy handed back."""
        weights = sum(math.prod(shape) for shape in entry.constants.values()) * 4 / MB
        block = sum(math.prod(shape) for shape in entry.trainable.values()) * 4 / MB
        return (runtime_mb + held_mb + weights + entry.planned_bytes / MB + logits_mb(entry)
                + 3 * block)

    def need_mb(self, entry: BlockProgram, held_mb: float, runtime_mb: float,
                options: dict[str, Any]) -> float:
        return self.peak_mb(entry, held_mb, runtime_mb)

    def train(self, task: TrainTask) -> TrainOutcome:
        """Run ``task.steps`` AdamW steps on ``task.block`` through its program; the trained
        block is written back into ``task.model``."""
        if FoOptions.from_options(task.options).recompute:
            raise ValueError("fo-recompute (the program keeps its own activations)")
        entry = self.program(task.model, task.blocks, task.block)
        trainer = ProgramTrainer(self.programs(), entry, named_tensors(task.model), task.lr,
                                 task.weight_decay)
        losses: list[float] = []
        examples = skipped = 0
        try:
            for _ in range(task.steps):
                batch = next(task.batches)
                loss = trainer.step(*program_inputs(batch, self.rows, self.seq))
                examples += len(batch)
                if not math.isfinite(loss):
                    skipped += 1
                    continue
                losses.append(loss)
            trained = trainer.block()
        finally:
            trainer.close()
        with torch.no_grad():
            own = dict(task.model.named_parameters())
            for name, tensor in trained.items():
                own[name].copy_(tensor)
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainOutcome(mean, len(losses), examples, skipped)
