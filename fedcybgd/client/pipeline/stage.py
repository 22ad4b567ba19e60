"""A pipeline stage: one device's contiguous chunk of decoder layers, trained with the others.

The model's decoder layers ``0..L-1`` are cut into K chunks
(:func:`fedcybgd.protocol.pipeline.stage_layers`: equal sizes, the remainder to the lowest).
Stage k trains its chunk's layers; embeddings, final norm and LM head stay frozen on every
schedule, so the schedules train the same parameters. The operations
(``fedcybgd.server.pipeline.schedules``):

* :meth:`Stage.forward` (``F``): the chunk on one micro-batch. Stage 0 starts from the
  embeddings; stage k > 0 from the states stage k-1 sent. Every stage rebuilds the layers'
  masks and rotary tables from the micro-batch's token ids (``LayerStack.embed``: the
  embeddings and tables, no layer), so only ``[B, T, H]`` states travel. Returns the detached
  output to send up.
* :meth:`Stage.backward` (``B``, backprop schedules): the last stage backpropagates its loss
  (the model's true loss: frozen final norm + LM head on its output); the others the gradient
  stage k+1 sent for the states they sent it. Returns the gradient for stage k-1. The graph of
  a micro-batch stays alive from its ``F`` to its ``B``: this is what a backprop pipeline keeps.
* :meth:`Stage.local_update` (``L``, ZeroLock): the chunk's local objective on its own output
  (``LocalHead``: the frozen final norm + LM head, after ``aux_layers`` frozen layers above the
  chunk), backprop inside the chunk only. On the last stage this is the true loss.
* :meth:`Stage.step` (``S``): AdamW on the chunk, with the gradients summed over the
  mini-batch's micro-batches and divided by their number (the mean loss's gradient, as GPipe).

Every schedule takes the same optimizer steps on the same micro-batches; what differs is which
loss each chunk follows and what it must wait for and keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fedcybgd.choices import PIPELINE_SCHEDULES
from fedcybgd.client.updates.local_heads import LocalHead
from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.protocol.pipeline import stage_layers
from fedcybgd.tasks.objective import batch_loss, scored_logits

BACKPROP = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StageConfig:
    """How a stage trains: its place, the schedule (``fedcybgd.server.pipeline.schedules``), AdamW's
    settings, and ZeroLock's local head (``aux_layers`` frozen layers above the chunk)."""

    stage: int
    stages: int
    schedule: str
    lr: float
    weight_decay: float = 0.0
    aux_layers: int = 0


class Stage:
    """One stage of the pipeline over ``model`` (the stage trains it in place).

    Parameters
    ----------
    model : PreTrainedModel
        The causal LM; only the stage's layers get gradients.
    config : StageConfig
        Place, schedule and optimizer.
    task : Task or None
        Attached to the micro-batches this stage receives (the loss reads it).
    """

    def __init__(self, model: nn.Module, config: StageConfig, task: object = None) -> None:
        if config.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got "
                             f"{config.schedule!r}")
        self.config = config
        self.task = task
        self.stack = LayerStack(model)  # type: ignore[arg-type]
        self.layers = stage_layers(self.stack.num_layers, config.stages)[config.stage]
        for p in model.parameters():
            p.requires_grad_(False)
        a, b = self.layers
        self.params = [p for i in range(a, b) for p in self.stack.layers[i].parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr,
                                           weight_decay=config.weight_decay)
        aux = 0 if self.last else min(config.aux_layers, self.stack.num_layers - b)
        self.head = LocalHead(self.stack, aux_layers=aux, aux_start=b)
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = {}
        self._pending: dict[int, tuple[Hidden, Batch]] = {}
        self._accumulated = 0
        self.losses: list[tuple[int, float]] = []  # (micro-batch, loss) of this stage's loss

    @property
    def first(self) -> bool:
        return self.config.stage == 0

    @property
    def last(self) -> bool:
        return self.config.stage == self.config.stages - 1

    @property
    def kept(self) -> int:
        """Micro-batches whose activations this stage holds now."""
        return len(self._saved) + len(self._pending)

    def chunk_state(self) -> dict[str, torch.Tensor]:
        """The stage's trained tensors under the model's parameter names."""
        a, b = self.layers
        names = {id(p): n for n, p in self.stack.model.named_parameters()}
        return {names[id(p)]: p.detach().clone()
                for i in range(a, b) for p in self.stack.layers[i].parameters()}

    def state(self) -> dict[str, torch.Tensor]:
        """What the stage must keep between messages: its chunk and AdamW's state
        (``adam.<i>.<field>`` for parameter ``i`` of the chunk)."""
        out = self.chunk_state()
        for i, p in enumerate(self.params):
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"adam.{i}.{key}"] = torch.as_tensor(value).detach().clone()
        return out

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`state` returned; ``ValueError`` naming a tensor that does not
        fit this stage (another cut, another model)."""
        own = self.chunk_state()
        names = {id(p): n for n, p in self.stack.model.named_parameters()}
        for name, value in tensors.items():
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"stage state: {name!r} holds non-finite values")
            if name.startswith("adam."):
                parts = name.split(".")
                if (len(parts) != 3 or not parts[1].isdigit()
                        or int(parts[1]) >= len(self.params)
                        or parts[2] not in ("step", "exp_avg", "exp_avg_sq")):
                    raise ValueError(f"stage state: unknown optimizer tensor {name!r}")
                p = self.params[int(parts[1])]
                if parts[2] != "step" and value.shape != p.shape:
                    raise ValueError(f"stage state: {name!r} has shape {tuple(value.shape)}, "
                                     f"its parameter {tuple(p.shape)}")
                if parts[2] == "step" and (value.numel() != 1 or float(value) < 0):
                    raise ValueError(f"stage state: {name!r} is not a step count")
                if parts[2] == "exp_avg_sq" and bool((value < 0).any()):
                    raise ValueError(f"stage state: {name!r} holds negative second moments")
                self.optimizer.state[p][parts[2]] = value.clone()
            elif name not in own or own[name].shape != value.shape:
                raise ValueError(f"stage state: {name!r} is not a tensor of this stage's chunk "
                                 f"(layers {self.layers})")
        with torch.no_grad():
            for p in self.params:
                name = names[id(p)]
                if name in tensors:
                    p.copy_(tensors[name])

    def gradients(self) -> dict[str, torch.Tensor]:
        """The mean gradient :meth:`step` would apply now, under the parameters' names."""
        names = {id(p): n for n, p in self.stack.model.named_parameters()}
        count = max(self._accumulated, 1)
        return {names[id(p)]: (p.grad / count if p.grad is not None else torch.zeros_like(p))
                for p in self.params}

    def forward(self, mb: int, batch: Batch, states: torch.Tensor | None = None) -> torch.Tensor:
        """``F``: run the chunk on micro-batch ``mb``; the detached output to send up."""
        if self.first != (states is None):
            raise ValueError("stage 0 starts from the embeddings; every other stage from the "
                             "states of the stage below")
        if mb in self._saved or mb in self._pending:
            raise ValueError(f"micro-batch {mb} is already in flight on stage {self.config.stage}")
        with torch.no_grad():
            hidden = self.stack.embed(batch.input_ids, batch.attention_mask)
        leaf = None
        if states is not None:
            backprop = self.config.schedule in BACKPROP
            leaf = states.detach().requires_grad_(backprop)
            hidden = hidden.with_states(leaf)
        out = self.stack.run(hidden, *self.layers)
        if self.config.schedule in BACKPROP:
            loss = None
            if self.last:
                loss = batch_loss(scored_logits(self.stack, out.states, batch), batch)
            self._saved[mb] = (leaf, out.states, loss)
        else:
            self._pending[mb] = (out, batch)
        return out.states.detach()

    def drop(self, mb: int) -> None:
        """Forget micro-batch ``mb``'s forward (its graph is recomputed when needed)."""
        self._saved.pop(mb, None)
        self._pending.pop(mb, None)

    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """``B``: backpropagate micro-batch ``mb`` through the chunk; the gradient for the
        states the stage below sent (``None`` on stage 0)."""
        if mb not in self._saved:
            raise ValueError(f"micro-batch {mb} has no forward pending a backward on stage "
                             f"{self.config.stage}")
        if self.last != (grad is None):
            raise ValueError("the last stage starts from its loss; every other stage from the "
                             "gradient of the stage above")
        leaf, out, loss = self._saved.pop(mb)
        if loss is not None:
            value = float(loss.detach())
            self.losses.append((mb, value))
            if not math.isfinite(value):
                raise FloatingPointError(f"non-finite loss on micro-batch {mb}")
            loss.backward()
        else:
            if grad is None or grad.shape != out.shape:
                raise ValueError(f"gradient of shape {None if grad is None else tuple(grad.shape)}"
                                 f" for states {tuple(out.shape)}")
            out.backward(grad.to(out.dtype))
        self._accumulated += 1
        return None if leaf is None else leaf.grad

    def local_update(self, mb: int) -> float:
        """``L``: the chunk's local loss on micro-batch ``mb``, backprop inside the chunk."""
        if mb not in self._pending:
            raise ValueError(f"micro-batch {mb} has no forward pending an update on stage "
                             f"{self.config.stage}")
        out, batch = self._pending.pop(mb)
        value = self.head.backward(out, batch)
        self.losses.append((mb, value))
        if not math.isfinite(value):
            raise FloatingPointError(f"non-finite local loss on micro-batch {mb}")
        self._accumulated += 1
        return value

    def step(self) -> None:
        """``S``: AdamW on the mean gradient of the micro-batches since the last step."""
        if self.kept:
            raise ValueError(f"stage {self.config.stage} steps with {self.kept} micro-batches "
                             "still in flight")
        if self._accumulated == 0:
            return
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(self._accumulated)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulated = 0
