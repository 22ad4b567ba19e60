"""What an update rule is given, what it returns, and what its memory estimate is told.

A rule trains one block of the client's model in place. The client builds a :class:`TrainTask`
(the model, the block, the data and the round's settings), calls the rule's ``train`` and reads
the :class:`TrainOutcome`. A rule also declares an estimate of the memory it needs on top of
holding the model, as a function of :class:`MemoryNeeds`; the server uses it to give each node
a rule that fits its ``memory-budget-mb``, the client to check an assignment before training.

No torch at import time (the types below are annotations only): the server and the config
import this module, and plug-in rule modules import it on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from fedcybgd.data.prompts import Batch
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.protocol.zeroth_order import SeedLog


@dataclass
class TrainTask:
    """One client-round of training: the model, the block to train and the data.

    Parameters
    ----------
    model : nn.Module
        The client's model, holding the round's starting weights.
    stack : LayerStack
        Piecewise access to ``model`` (embed, run layers, logits).
    blocks : BlockMap
        The block partition; ``block`` names one of its blocks.
    block : str
        The block to train. Nothing outside it may change.
    batches : Iterator[Batch]
        The client's training batches (endless); a rule takes ``steps`` of them.
    steps, lr, weight_decay, seed :
        Local steps, learning rate, weight decay and the seed of the round's randomness.
    options : dict
        Every registered rule's options, keyed as in the run config (e.g. ``zo-eps``); a rule
        reads its own with its options class's ``from_options`` (the parser the server
        checks them with at start, :mod:`fedcybgd.rules.options`).
    state_dir : Path
        A folder the rule may keep state in across rounds (e.g. a local head).
    privacy : ExampleDp or None
        Example-level differential privacy (``dp = "example"``): each step's batch is a
        Poisson sample of the node's examples, and the rule must bound every example's
        contribution to a step and add the noise (rules declared ``example_dp=True``).
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
    privacy: ExampleDp | None = None


@dataclass(frozen=True)
class ExampleDp:
    """DP-SGD's settings for one client-round (``dp = "example"``).

    Attributes
    ----------
    clip : float
        ``dp-clip-norm``: the bound of one example's contribution to a step (the L2 norm of
        its gradient for ``fo``; the size of its projected-gradient scalar for ``lezo`` /
        ``mezo``).
    noise_multiplier : float
        The noise's standard deviation over ``clip``, added once per step to the sum.
    expected_batch : float
        The sampled batch's expected size (``batch-size``): the sum is divided by it, not by
        the drawn size, which would itself depend on the data.
    seed : int
        Seeds the noise (the node's own randomness: see the client).
    """

    clip: float
    noise_multiplier: float
    expected_batch: float
    seed: int


@dataclass
class TrainOutcome:
    """What a rule reports after training (the new weights are in the model).

    ``step_log`` is set by a rule that declares ``step_log=True``: the
    :class:`~fedcybgd.protocol.zeroth_order.SeedLog` of the round, which the server replays to
    rebuild the block when the run uploads step logs (``upload-codec = "seedlog"``).
    """

    loss: float  # mean training loss over applied steps
    steps: int  # steps applied
    examples: int  # examples seen
    skipped_steps: int = 0  # steps dropped for a non-finite loss
    metrics: dict[str, float] = field(default_factory=dict)  # go into the reply's metrics
    step_log: SeedLog | None = None


class UpdateRule(Protocol):
    """A local update rule. Implementations change only ``task.block``'s parameters.

    The client makes a fresh instance for every round (the registered class or factory is
    called with no arguments), so state kept across rounds belongs in ``task.state_dir``.
    """

    name: str

    def train(self, task: TrainTask) -> TrainOutcome:
        """Train ``task.block`` in place and report."""
        ...


@dataclass(frozen=True)
class MemoryNeeds:
    """What one client-round on a block costs, for a rule's memory estimate.

    The estimate is the peak on top of the runtime and the model's weights (both counted by
    :func:`fedcybgd.memory.estimate.estimate_peak_mb`); all sizes in MiB.

    Attributes
    ----------
    weights_mb : float
        Every parameter of the model, in its own dtype (already counted; for a rule that
        would hold a second copy).
    block_mb : float
        The block's parameters as fp32 (a gradient or one optimizer moment of the block).
    optimizer_mb : float
        AdamW's state for the block: gradients and two moments, plus an fp32 master copy
        when the weights are not fp32.
    layer_activations_mb : float
        What autograd keeps of one decoder layer's activations at the run's batch size and
        sequence length (also the transient activations of an inference forward).
    logits_mb : float
        One copy of the LM head's fp32 logits at the scored positions (``scored_rows`` x
        vocabulary: one row per example for classification, every response token for sft).
    layers_from_block : int
        Decoder layers from the block's lowest layer to the top: how deep backprop from the
        task loss goes (0 for the head, every layer for the embeddings).
    own_layers : int
        Decoder layers inside the block (0 for the embeddings and the head).
    num_layers : int
        Decoder layers of the model.
    options : dict
        The run's rule options (every registered rule's keys), so an estimate can read its own
        (``fo-recompute``).
    layer_input_mb : float
        One layer's input hidden states (fp32): what a checkpointed layer keeps.
    frozen_transient_mb : float
        What a forward through a frozen block holds besides activations (an int8 layer's
        dequantized weight chunk); 0 when frozen blocks are fp32 or bf16.
    scored_rows : int
        The positions of a batch the LM head scores (``logits_mb``'s rows); 0: not given.
    """

    weights_mb: float
    block_mb: float
    optimizer_mb: float
    layer_activations_mb: float
    logits_mb: float
    layers_from_block: int
    own_layers: int
    num_layers: int
    options: dict[str, Any] = field(default_factory=dict)
    layer_input_mb: float = 0.0
    frozen_transient_mb: float = 0.0
    scored_rows: int = 0


# A rule's memory estimate: MiB it adds on top of runtime + weights for one client-round.
MemoryEstimate = Callable[[MemoryNeeds], float]
