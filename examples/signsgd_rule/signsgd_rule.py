"""Sign-SGD on the assigned block: an update rule of one's own, in one file.

Selected by the run config (``pyproject.toml`` next to this file): ``plugin-modules =
"signsgd_rule"`` makes the server (at start, to validate the run) and every client (to train)
import this module, whose decorator registers the rule; ``update-rule = "signsgd"`` selects it.
Its option ``signsgd-momentum`` is a run-config key like any other (checked on the server at
start; listed in ``[tool.flwr.app.config]`` so ``flwr run --run-config`` can set it).

It imports only neutral modules of fedcybgd (no client code), so the server can import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedcybgd.core.fields import normalize, setting
from fedcybgd.rules import MemoryNeeds, RuleOptions, TrainOutcome, TrainTask, register_rule
from fedcybgd.tasks.objective import batch_loss, scored_logits


@dataclass(frozen=True)
class SignSGDOptions(RuleOptions):
    """The rule's run-config keys, defaults and ranges (checked on the server at start)."""

    momentum: float = setting(0.0, key="signsgd-momentum", ge=0, lt=1)  # 0: plain sign-SGD

    def __post_init__(self) -> None:
        normalize(self)


def signsgd_memory(needs: MemoryNeeds) -> float:
    """MiB on top of runtime + weights: the block's gradient and momentum buffer, backprop from
    the block up (nothing below it requires grad, so nothing there is kept), the logits."""
    return (2 * needs.block_mb + needs.layers_from_block * needs.layer_activations_mb
            + needs.logits_mb)


@register_rule("signsgd", options=SignSGDOptions, memory=signsgd_memory)
class SignSGD:
    """m = momentum * m + grad; theta -= lr * sign(m), on the assigned block only."""

    name = "signsgd"

    def train(self, task: TrainTask) -> TrainOutcome:
        """Train ``task.block`` in place for ``task.steps`` steps."""
        opts = SignSGDOptions.from_options(task.options)
        params = task.blocks.parameters(task.model, task.block)
        for p in task.model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        momenta = [torch.zeros_like(p) for p in params]
        losses: list[float] = []
        examples = 0
        try:
            for _ in range(task.steps):
                batch = next(task.batches)
                examples += len(batch)
                hidden = task.stack.embed(batch.input_ids, batch.attention_mask)
                hidden = task.stack.run(hidden, 0, task.stack.num_layers)
                # the task's loss at its scored positions: any task, not only classification
                loss = batch_loss(scored_logits(task.stack, hidden.states, batch), batch)
                if not math.isfinite(loss.item()):
                    continue  # counted as skipped below; the weights stay as they are
                loss.backward()
                with torch.no_grad():
                    for p, m in zip(params, momenta, strict=True):
                        assert p.grad is not None
                        m.mul_(opts.momentum).add_(p.grad)
                        p.mul_(1 - task.lr * task.weight_decay)
                        p.add_(m.sign(), alpha=-task.lr)
                        p.grad = None
                losses.append(loss.item())
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
        mean = sum(losses) / len(losses) if losses else math.nan
        return TrainOutcome(loss=mean, steps=len(losses), examples=examples,
                            skipped_steps=task.steps - len(losses))
