"""ZeroLock rule: train a block on a local objective; the layers above it are never run.

For a layer block ``[s..e]`` each local step is:

1. **Prefix** (no grad): embeddings + layers ``0..s-1``. Their outputs are cached per example
   for the round (keyed by the example's tokens; right padding and causal attention make a
   row's states independent of its batch), so an example met again, in a repeated batch or a
   later local epoch, costs no prefix forward. ``zerolock-cache-mb`` bounds the cache.
2. **Block** (grad): the block's layers, split into ``zerolock-chunks`` chunks. Each chunk
   reads its input detached, runs forward, hands its detached output to the next chunk
   (**early forwarding**: before its own backward and step), computes its local loss through
   the local head, backpropagates inside itself (+ the head's trainable part) and steps its own
   AdamW. Chunks run one after another in one thread (see the note at ``_train_step``).
3. Layers ``e+1..`` are **never run** (but ``zerolock-aux-layers`` of them in the head, and
   the calibrated head's forward-only fit); no activation of them exists.

Each parameter is stepped inside the backward pass as soon as its gradient is complete
(``zerolock-fused-step``, default on), so the block's gradients are never all alive at once;
this lowers the peak when the batch's activations are smaller than the block's gradients (SmolLM2,
8-layer block, batch 4x32: 297 MB instead of 394 MB above the model).

Local heads (``local_heads.py``): ``zerolock-head = frozen-lm`` (default): the model's frozen
final norm + LM head on the chunk output; ``tuned``: a residual affine map (identity at start,
``zerolock-head-rank`` > 0 for low rank) before them, trained by the chunk's optimizer and kept
in ``task.state_dir`` between rounds (``zerolock/heads/<block>.safetensors``, one map per chunk
output layer), so it keeps learning from round to round. ``calibrated``: a FROZEN affine map
before them, fitted by the node (``calibration.py``) so that the head's prediction from the
layer it reads matches the model's own final layer: least squares from that layer's outputs to
the last layer's, over one no-grad forward pass of the whole model on the round's first
``zerolock-calib-batches`` batches (peeked and put back: training still takes them). Fitted on
the node, not on the server, because the node already holds every layer and its own data:
nothing new crosses the wire, nothing held out (the server's evaluation split) shapes
training, and each node's map fits its own data. Kept in ``task.state_dir``
(``zerolock/calibration/layer.<k>.safetensors``, ~1.3 MB per layer for SmolLM2) with a fixed
sample of the coordinates of the layers above; refitted when those moved by more than
``zerolock-calib-refit`` (relative norm) since the fit, or when the file is unreadable.

``zerolock-aux-layers = m`` (any head): the last chunk's head first runs the ``m`` layers above
the block (FROZEN: weights never change, the gradient flows through their activations), then
the head reads their output (AugLocal-style); the layers above those are never run. It costs
``m`` layers' activations and buys alignment with the true gradient (``experiments/
grad_alignment.py``); when the ``m`` layers reach the top, the local loss is the true loss.

Special blocks:

* ``head`` (final norm, + LM head when untied): it is the top, so its local loss is the true
  loss: prefix = all decoder layers (cached, no grad), then the trainable norm/head. No chunks,
  no translator.
* ``embed``: the embedding output, read at the label position, is the embedding of the prompt's
  last token, the same token (":") for every example; a loss there could only move that one
  row towards the label prior. So the embed block's local head reads the output of the first
  ``zerolock-embed-layers`` (default 1) decoder layers, FROZEN (weights never change; grad
  flows through their activations only), then the frozen norm + LM head: an AugLocal-style
  auxiliary head built from the next layer(s). Layers at and above ``zerolock-embed-layers``
  are never run. ``zerolock-embed-layers = 0`` puts the head on the raw embeddings.

Tied embeddings: the LM head's weight is then the embedding block's tensor. A client training
the ``embed`` block would change its own local objective's head at every step, so its local
head uses a frozen COPY of the head weight taken at round start (= the weights every client of
this round started from). Clients training any other block never change the head during their
round, so their live, frozen head is the round-start head without a copy (a copy of a 49k x 576
matrix would cost more memory than the activations saved). Across rounds every client uses the
current global head, as the true loss does; a tuned map learned against an older head keeps
training against the new one.

Failure recovery: after a step, the in-round progress (fp32 master weights of the block, each
chunk's AdamW state, translators, step counter, loss sums; round identity = ``task.seed`` +
block + objective-changing options) is written atomically to ``zerolock/checkpoint.safetensors``
when ``zerolock-checkpoint-every`` steps have passed (``> 0``) or, with the default ``0``, when
``zerolock-checkpoint-seconds`` (default 60) have passed since the round's start or the last
checkpoint: the work lost in a crash is bounded by time and the write cost stays a small
fraction of the round; a short round writes nothing. (SmolLM2, 8-layer block: ~340 MB, ~0.4 s
per write, about half a local step.) A client that starts a round with a
checkpoint of the same identity restores it, skips the batches already consumed and continues
from that step; the checkpoint is deleted when the round completes.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedcybgd.client.updates.calibration import CalibrationReport, calibrated_translators
from fedcybgd.client.updates.local_heads import LocalHead, Translator
from fedcybgd.client.updates.zerolock.checkpoints import (
    Progress,
    atomic_save,
    checkpoint_path,
    fits_chunks,
    heads_path,
    read_state,
    restore_checkpoint,
    save_checkpoint,
    skip_batches,
    translator_params,
)
from fedcybgd.client.updates.zerolock.chunks import (
    Chunk,
    layer_index,
    live_hidden_size,
    split_layers,
)
from fedcybgd.client.updates.zerolock.prefix import PrefixCache
from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import EMBED, HEAD
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.rules import TrainOutcome, TrainTask
from fedcybgd.rules.builtin import ZeroLockOptions  # the options' one parser (server too)
from fedcybgd.tasks.shares import BatchIterator

log = logging.getLogger(__name__)

__all__ = ["ZeroLock", "ZeroLockOptions", "checkpoint_path", "heads_path", "split_layers"]


@dataclass(frozen=True)
class Plan:
    """Where a block's chunks lie and what each chunk's local head reads.

    Attributes
    ----------
    kind : str
        ``layers`` (decoder layers), ``embed`` or ``top`` (the head block).
    prefix_end : int
        Layers below the block: its input is their (cached) output.
    ranges : list of (int, int)
        Each chunk's layers ``[a, b)``.
    aux : int
        Frozen layers above the block run inside the last chunk's head
        (``zerolock-aux-layers``, capped at the layers there are).
    embed_layers : int
        Frozen layers inside the ``embed`` block's head.
    reads : list of int
        The layer whose output each chunk's head reads.
    head_weight : torch.Tensor or None
        A frozen copy of a tied LM head the block trains (see the module docstring).
    """

    kind: str
    prefix_end: int
    ranges: list[tuple[int, int]]
    aux: int
    embed_layers: int
    reads: list[int]
    head_weight: torch.Tensor | None


def plan_chunks(task: TrainTask, opts: ZeroLockOptions, params: list[nn.Parameter]) -> Plan:
    """The chunks of ``task.block`` (``zerolock-chunks`` of a layer block; the embeddings and
    the head are one chunk each) and where each chunk's head reads."""
    stack = task.stack
    if task.block == HEAD:
        kind, prefix_end = "top", stack.num_layers
        ranges = [(stack.num_layers, stack.num_layers)]
    elif task.block == EMBED:
        kind, prefix_end = "embed", 0
        ranges = [(0, 0)]
    else:
        layers = task.blocks.info(task.block).layers
        assert layers is not None
        kind, prefix_end = "layers", layers[0]
        ranges = split_layers(layers[0], layers[1], opts.chunks)

    # Tied embeddings: see the module docstring. Only a block that owns the head's tensor and
    # is not the top needs a frozen copy of it.
    head_weight: torch.Tensor | None = None
    live_head = getattr(stack.head, "weight", None)
    if kind != "top" and live_head is not None and any(p is live_head for p in params):
        head_weight = live_head.detach().clone()

    # Where each chunk's head reads: its own output, or (the block's last chunk, with
    # zerolock-aux-layers) the output of that many frozen layers above the block.
    aux = min(opts.aux_layers, stack.num_layers - ranges[-1][1]) if kind == "layers" else 0
    embed_layers = min(opts.embed_layers, stack.num_layers)
    reads = [
        (b - 1 + (aux if i == len(ranges) - 1 else 0)) if kind == "layers"
        else embed_layers - 1  # the embed block's head reads its aux layers' output
        for i, (_, b) in enumerate(ranges)
    ]
    return Plan(kind, prefix_end, ranges, aux, embed_layers, reads, head_weight)


class ZeroLock:
    """Block training on a local objective; see the module docstring."""

    name = "zerolock"

    def train(self, task: TrainTask) -> TrainOutcome:
        """Run ``task.steps`` local steps on ``task.block``: plan the chunks, calibrate their
        heads, build them, resume an interrupted round, step, keep the tuned heads, report."""
        opts = ZeroLockOptions.from_options(task.options)
        for p in task.model.parameters():
            p.requires_grad_(False)
        params = task.blocks.parameters(task.model, task.block)
        plan = plan_chunks(task, opts, params)
        batches, calibration, calib_report = self._calibrate(task, opts, plan)
        chunks = self._build_chunks(task, opts, plan, params, calibration)
        identity = {
            "seed": task.seed,
            "block": task.block,
            "head": opts.head,
            "head_rank": opts.head_rank,
            "objective": opts.objective,
            "chunks": len(chunks),
            "fused": [c.fused for c in chunks],
            "embed_layers": opts.embed_layers if plan.kind == "embed" else 0,
            "aux_layers": plan.aux,
        }
        ckpt = checkpoint_path(task.state_dir) if task.state_dir is not None else None
        progress = self._resume(task, ckpt, identity, chunks, batches)
        resumed_from = progress.step
        cache = PrefixCache(task.stack, plan.prefix_end, int(opts.cache_mb * 2**20))
        self._steps(task, opts, chunks, params, cache, batches, progress, ckpt, identity)
        self._keep_tuned_heads(task, opts, plan, chunks)
        if ckpt is not None:
            ckpt.unlink(missing_ok=True)

        losses = progress.losses
        mean = sum(losses) / len(losses) if losses else float("nan")
        metrics = {
            f"zerolock_chunk{c.index}_loss": c.loss_sum / c.loss_count if c.loss_count else math.nan
            for c in chunks
        }
        metrics["zerolock_resumed_step"] = float(resumed_from)
        metrics["zerolock_cache_hits"] = float(cache.hits)
        if calib_report is not None:
            metrics.update(calib_report.metrics())
        return TrainOutcome(mean, len(losses), progress.examples, progress.skipped, metrics)

    @staticmethod
    def _calibrate(
        task: TrainTask, opts: ZeroLockOptions, plan: Plan
    ) -> tuple[Iterator[Batch], dict[int, Translator | None], CalibrationReport | None]:
        """With ``zerolock-head = calibrated``: fit each read layer's translator on the round's
        own first batches (put back, so training still sees every batch). Returns the batches
        to train on, the translators by read layer and the fit's report."""
        if opts.head != "calibrated" or plan.kind == "top":
            return task.batches, {}, None
        peeked: list[Batch] = []

        def take() -> list[Batch]:
            if isinstance(task.batches, BatchIterator):
                at = task.batches.step
                got = [next(task.batches) for _ in range(opts.calib_batches)]
                task.batches.step = at
                return got
            # a finite iterator may hold fewer: fit on what there is
            peeked.extend(itertools.islice(task.batches, opts.calib_batches))
            return list(peeked)

        calibration, report = calibrated_translators(
            task.stack, plan.reads, take, task.state_dir, opts.calib_ridge, opts.calib_refit,
            opts.calib_batches)
        batches = itertools.chain(peeked, task.batches) if peeked else task.batches
        return batches, calibration, report

    def _build_chunks(
        self,
        task: TrainTask,
        opts: ZeroLockOptions,
        plan: Plan,
        params: list[nn.Parameter],
        calibration: dict[int, Translator | None],
    ) -> list[Chunk]:
        """One chunk per range: its parameters, its local head (translator, aux layers) and
        its optimizers."""
        model, stack, blocks = task.model, task.stack, task.blocks
        info = blocks.info(task.block)
        kind = plan.kind
        saved_maps = self._load_maps(task, opts) if kind != "top" else {}
        by_name = dict(model.named_parameters())
        hidden_size = int(getattr(model.config, "hidden_size", 0) or live_hidden_size(stack))
        chunks = []
        for index, (a, b) in enumerate(plan.ranges):
            if kind == "layers":
                names = [
                    n for n in info.param_names if a <= layer_index(n, blocks.layers_name) < b
                ]
                chunk_params = [by_name[n] for n in names]
                key = f"layer.{b - 1}"
            else:
                chunk_params = list(params)
                key = kind
            translator = None
            if opts.head == "tuned" and kind != "top":
                translator = Translator(hidden_size, opts.head_rank, seed=task.seed + index)
                self._apply_map(translator, saved_maps, key)
            elif opts.head == "calibrated" and kind != "top":
                translator = calibration[plan.reads[index]]  # frozen; None on the last layer
            if kind == "embed":
                aux_start, aux_count = 0, plan.embed_layers
            elif kind == "layers":
                aux_start, aux_count = b, plan.reads[index] - (b - 1)
            else:
                aux_start, aux_count = 0, 0
            head = LocalHead(
                stack,
                translator=translator,
                head_weight=plan.head_weight,
                aux_layers=aux_count,
                objective=opts.objective,
                slice_rows=opts.slice,
                aux_start=aux_start,
            )
            chunks.append(self._make_chunk(index, kind, (a, b), key, chunk_params, head, task,
                                           opts))
        return chunks

    @staticmethod
    def _resume(
        task: TrainTask,
        ckpt: Path | None,
        identity: dict[str, Any],
        chunks: list[Chunk],
        batches: Iterator[Batch],
    ) -> Progress:
        """The progress of an interrupted round of the same identity (its batches skipped),
        else a fresh start (a leftover checkpoint of another round is deleted)."""
        if ckpt is None:
            return Progress()
        found = read_state(ckpt)
        if found is None:
            return Progress()
        tensors, meta = found
        same = meta.get("identity") == json.dumps(identity, sort_keys=True)
        if same and fits_chunks(tensors, meta, chunks):
            progress = restore_checkpoint(tensors, meta, chunks)
            skip_batches(batches, progress.step)
            log.info("zerolock: resuming %s at step %d", task.block, progress.step)
            return progress
        ckpt.unlink(missing_ok=True)  # a previous round's leftover (or unusable)
        return Progress()

    def _steps(
        self,
        task: TrainTask,
        opts: ZeroLockOptions,
        chunks: list[Chunk],
        params: list[nn.Parameter],
        cache: PrefixCache,
        batches: Iterator[Batch],
        progress: Progress,
        ckpt: Path | None,
        identity: dict[str, Any],
    ) -> None:
        """The local steps from ``progress.step`` to ``task.steps``, checkpointing when due;
        the block is frozen again afterwards whatever happens."""
        for chunk in chunks:
            for p in chunk.params:
                p.requires_grad_(True)
            chunk.attach()
        last_save = time.monotonic()
        try:
            while progress.step < task.steps:
                batch = next(batches)
                final = self._train_step(task.stack, cache, chunks, batch)
                progress.step += 1
                progress.examples += len(batch)
                if final is None:
                    progress.skipped += 1
                else:
                    progress.losses.append(final)
                if ckpt is not None and progress.step < task.steps:
                    due = (
                        progress.step % opts.checkpoint_every == 0
                        if opts.checkpoint_every > 0
                        else opts.checkpoint_every == 0
                        and opts.checkpoint_seconds > 0
                        and time.monotonic() - last_save >= opts.checkpoint_seconds
                    )
                    if due:
                        save_checkpoint(ckpt, identity, progress, chunks)
                        last_save = time.monotonic()
        finally:
            for chunk in chunks:
                chunk.detach_hooks()
            for p in params:
                p.requires_grad_(False)
                p.grad = None

    @staticmethod
    def _keep_tuned_heads(task: TrainTask, opts: ZeroLockOptions, plan: Plan,
                          chunks: list[Chunk]) -> None:
        """With ``zerolock-head = tuned``: the learned maps stay with the node for its next
        round on this block."""
        if task.state_dir is None or opts.head != "tuned" or plan.kind == "top":
            return
        maps = {
            f"{chunk.key}.{name}": p
            for chunk in chunks
            for name, p in translator_params(chunk)
        }
        atomic_save(maps, heads_path(task.state_dir, task.block), {"rank": str(opts.head_rank)})

    @staticmethod
    def _train_step(
        stack: LayerStack, cache: PrefixCache, chunks: list[Chunk], batch: Batch
    ) -> float | None:
        """One local step over all chunks; the final chunk's loss, ``None`` if any skipped.

        Early forwarding, sequentially: chunk ``i`` runs forward, hands its detached output on
        (``source``), and only then does its own backward and step; chunk ``i+1`` consumes an
        output made by chunk ``i``'s pre-step weights, exactly as if it had started while chunk
        ``i`` was still updating. One thread runs the chunks. A thread per chunk (a pipeline over
        the local steps; same weights bit for bit) was measured on a 2-core CPU with SmolLM2,
        2 chunks of 4 layers, batch 16x32: with torch's 2 intra-op threads each, no faster;
        with 1 each, 1-9% faster on the bottom block but 5-15% slower on a middle block
        (the prefix then runs on one core). Not worth a thread pool and its sync points.
        """
        # The embed chunk makes its own input; every other block starts from the prefix.
        source = Hidden(torch.empty(0), (), {}) if chunks[0].kind == "embed" else cache(batch)
        final: float | None = None
        skipped = False
        for chunk in chunks:
            with torch.enable_grad():
                out = chunk.forward(stack, source, batch)
            source = out.detach()  # early forwarding: the next chunk's input, detached
            with torch.enable_grad():
                loss = chunk.update(out, batch)
            del out
            skipped = skipped or loss is None
            final = loss
        return None if skipped else final

    @staticmethod
    def _make_chunk(
        index: int,
        kind: str,
        layers: tuple[int, int],
        key: str,
        params: list[nn.Parameter],
        head: LocalHead,
        task: TrainTask,
        opts: ZeroLockOptions,
    ) -> Chunk:
        shared = all(p.dtype == torch.float32 for p in params)
        masters: list[torch.Tensor] = (
            list(params)
            if shared
            else [p.detach().float().clone().requires_grad_(True) for p in params]
        )
        fused = opts.fused_step and kind != "top"
        lr, decay = task.lr, task.weight_decay
        optimizers: list[torch.optim.Optimizer] = (
            [torch.optim.AdamW([m], lr=lr, weight_decay=decay) for m in masters]
            if fused
            else [torch.optim.AdamW(masters, lr=lr, weight_decay=decay)]
        )
        head_params = list(head.parameters())
        head_optimizer = (
            torch.optim.AdamW(head_params, lr=opts.head_lr or task.lr, weight_decay=0.0)
            if head_params
            else None
        )
        return Chunk(index, kind, layers, key, list(params), masters, shared, head, optimizers,
                      head_optimizer, fused)

    @staticmethod
    def _load_maps(task: TrainTask, opts: ZeroLockOptions) -> dict[str, torch.Tensor]:
        if opts.head != "tuned" or task.state_dir is None:
            return {}
        found = read_state(heads_path(task.state_dir, task.block))
        return {} if found is None else found[0]

    @staticmethod
    def _apply_map(translator: Translator, saved: dict[str, torch.Tensor], key: str) -> None:
        """Load the saved map for ``key`` if it matches the translator's shapes."""
        own = dict(translator.named_parameters())
        found = {name: saved.get(f"{key}.{name}") for name in own}
        if any(v is None for v in found.values()):
            return
        if any(tuple(v.shape) != tuple(own[n].shape) for n, v in found.items() if v is not None):
            log.warning("zerolock: saved tuned head for %s has other shapes; starting afresh", key)
            return
        with torch.no_grad():
            for name, value in found.items():
                assert value is not None
                own[name].copy_(value)
