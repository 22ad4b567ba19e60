"""The local update rule interface: how a client trains its assigned block."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from fedcybgd.blocks import BlockMap
from fedcybgd.data.prompts import Batch
from fedcybgd.layerwise import LayerStack


@dataclass
class TrainTask:
    """One client-round of training: the model, the block to train and the data.

    Parameters
    ----------
    model : nn.Module
        The client's model, holding the round's starting weights.
    stack : LayerStack
        Piecewise access to ``model``.
    blocks : BlockMap
        The block partition; ``block`` names one of its blocks.
    block : str
        The block to train. Nothing outside it may change.
    batches : Iterator[Batch]
        The client's training batches (endless); a rule takes ``steps`` of them.
    steps, lr, weight_decay, seed :
        Local steps, learning rate, weight decay and the seed of the round's randomness.
    options : dict
        The rules' run-config options (e.g. ``zo-eps``), keyed as in the run config; a rule
        reads its own with :mod:`fedcybgd.rule_options` (the parser the server checks them with).
    state_dir : Path
        A folder the rule may keep state in across rounds (e.g. a local head).
    """

    model: nn.Module
    stack: LayerStack
    blocks: BlockMap
    block: str
    batches: Iterator[Batch]
    steps: int
    lr: float
    weight_decay: float
    seed: int
    options: dict[str, Any] = field(default_factory=dict)
    state_dir: Path | None = None


@dataclass
class TrainOutcome:
    """What a rule reports after training (the new weights are in the model)."""

    loss: float  # mean training loss over applied steps
    steps: int  # steps applied
    examples: int  # examples seen
    skipped_steps: int = 0  # steps dropped for a non-finite loss
    metrics: dict[str, float] = field(default_factory=dict)


class UpdateRule(Protocol):
    """A local update rule. Implementations change only ``task.block``'s parameters."""

    name: str

    def train(self, task: TrainTask) -> TrainOutcome:
        """Train ``task.block`` in place and report."""
        ...


_RULES: dict[str, Callable[[], UpdateRule]] = {}


def register(name: str) -> Callable[[Callable[[], UpdateRule]], Callable[[], UpdateRule]]:
    """Class decorator adding an update rule to the registry under ``name``."""

    def add(factory: Callable[[], UpdateRule]) -> Callable[[], UpdateRule]:
        _RULES[name] = factory
        return factory

    return add


def get_rule(name: str) -> UpdateRule:
    """Instantiate the update rule ``name``."""
    if name not in _RULES:
        raise ValueError(f"update-rule {name!r} is not available; choose one of {sorted(_RULES)}")
    return _RULES[name]()


def available_rules() -> list[str]:
    """Names of the registered update rules."""
    return sorted(_RULES)
