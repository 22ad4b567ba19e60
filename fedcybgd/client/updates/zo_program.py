"""``lezo`` and ``mezo`` through the block's forward ExecuTorch program (node config
``trainer = "executorch"``).

The same steps as :mod:`fedcybgd.client.updates.lezo`: the same units chosen, the same z, the
same perturbation, exact restore and update arithmetic, the same seed log; only each loss is
computed by ExecuTorch's runtime, from the block's *forward* program
(:class:`~fedcybgd.model.block_programs.WithBlockInputs`: the model's loss with the block's
tensors as inputs, every other weight in the round's ``.ptd``). The rule perturbs the block in
the node's model in place and hands those tensors to the program, so nothing is copied a step.
The program runs the whole model each time, where the eager rule runs the layers below the
lowest perturbed one once a step and reuses them for both forwards.

The node exports a block's forward program the first time it trains the block with one of
these rules, into the same folder as its ``fo`` programs (``<block>.forward.pte``), and checks
it against its checksum every round, as :class:`~fedcybgd.client.updates.fo_program.
ProgramFirstOrder` does. The server replays the step log the node uploads, whatever computed
its losses: the replay applies the same updates to the same start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from fedcybgd.client.updates.fo_program import MB, NodePrograms, program_inputs
from fedcybgd.client.updates.lezo import ZerothOrder
from fedcybgd.data.prompts import Batch
from fedcybgd.model.block_programs import BlockProgram, ProgramLoss, logits_mb, named_tensors
from fedcybgd.protocol import zeroth_order
from fedcybgd.rules import TrainOutcome, TrainTask
from fedcybgd.rules.builtin import LezoOptions, MezoOptions

__all__ = ["ProgramLeZO", "ProgramMeZO", "ProgramZerothOrder"]


class ProgramZerothOrder(NodePrograms, ZerothOrder):
    """A zeroth-order rule whose losses come from the block's forward program; see the module
    docstring and :class:`~fedcybgd.client.updates.fo_program.NodePrograms` for the
    parameters."""

    kind = "forward"

    def __init__(self, folder: Any, model_name: str, base_hash: str, rows: int,
                 seq: int) -> None:
        NodePrograms.__init__(self, folder, model_name, base_hash, rows, seq)
        ZerothOrder.__init__(self)
        self._loss: ProgramLoss | None = None
        self._block: dict[str, torch.Tensor] = {}

    @staticmethod
    def peak_mb(entry: BlockProgram, held_mb: float, runtime_mb: float,
                step_cache_mb: float) -> float:
        """Estimated peak resident memory (MiB) of a round through ``entry``'s forward program:
        besides the runtime and the node's model (``held_mb``), the round's weights file as the
        runtime reads it (every weight but the block's), the memory the program plans for a
        forward, the loss's scratch beside the plan (:func:`~fedcybgd.model.block_programs.
        logits_mb`), the step cache (``zo-step-cache-mb``, at most the block's z and start) and
        the rule's chunk workspace (five buffers of a z chunk)."""
        weights = sum(math.prod(shape) for shape in entry.constants.values()) * 4 / MB
        block = sum(math.prod(shape) for shape in entry.trainable.values()) * 4 / MB
        largest = max(math.prod(shape) for shape in entry.trainable.values())
        workspace = 5 * min(zeroth_order.Z_CHUNK, largest) * 4 / MB
        return (runtime_mb + held_mb + weights + entry.planned_bytes / MB + logits_mb(entry)
                + min(step_cache_mb, 2 * block) + workspace)

    def need_mb(self, entry: BlockProgram, held_mb: float, runtime_mb: float,
                options: dict[str, Any]) -> float:
        read = MezoOptions if self.fixed_density is not None else LezoOptions
        cache = read.from_options(options).step_cache_mb
        return self.peak_mb(entry, held_mb, runtime_mb, cache)

    def train(self, task: TrainTask) -> TrainOutcome:
        """The zeroth-order steps of :class:`~fedcybgd.client.updates.lezo.ZerothOrder`, each
        loss from the block's forward program."""
        entry = self.program(task.model, task.blocks, task.block)
        tensors = named_tensors(task.model)
        self._loss = ProgramLoss(self.programs(), entry, tensors)
        # the model's own block tensors: the rule perturbs them in place between the calls
        self._block = {name: tensors[name].detach() for name in entry.trainable}
        try:
            return ZerothOrder.train(self, task)
        finally:
            self._loss.close()
            self._loss, self._block = None, {}

    def _scorer(self, task: TrainTask, parts: list[Batch], start: int | None,
                times: dict[str, float]) -> Callable[[], list[float]]:
        loss = self._loss
        assert loss is not None
        inputs = [program_inputs(part, self.rows, self.seq) for part in parts]

        def measure() -> list[float]:
            clock = time.perf_counter()
            out = [loss(ids, mask, targets, self._block) for ids, mask, targets in inputs]
            times["zo_forward_s"] += time.perf_counter() - clock
            return out

        return measure


class ProgramLeZO(ProgramZerothOrder):
    """``lezo`` through the block's forward program."""

    name = "lezo"


class ProgramMeZO(ProgramZerothOrder):
    """``mezo`` through the block's forward program."""

    name = "mezo"
    fixed_density = 1.0
