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
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from fedcybgd.client.paths import block_name
from fedcybgd.client.updates.calibration import CalibrationReport, calibrated_translators
from fedcybgd.client.updates.local_heads import LocalHead, Translator
from fedcybgd.core.atomic import save_tensors
from fedcybgd.data.prompts import Batch
from fedcybgd.model.blocks import EMBED, HEAD
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.rules import TrainOutcome, TrainTask
from fedcybgd.rules.builtin_options import ZeroLockOptions  # the options' one parser (server too)
from fedcybgd.tasks.shares import BatchIterator

log = logging.getLogger(__name__)

_STATE = "zerolock"
_CHECKPOINT = "checkpoint.safetensors"


# ------------------------------------------------------------------------------ prefix cache


class PrefixCache:
    """Outputs of the frozen layers ``0..end-1`` per example, for one round.

    A row is keyed by its real tokens; only right-padded rows are cached (their states at real
    positions do not depend on the batch's width or other rows). A batch is served from the
    cache only when every row is there; otherwise the prefix runs on the whole batch and its
    rows are stored while the bound allows.
    """

    def __init__(self, stack: LayerStack, end: int, max_bytes: int) -> None:
        self.stack = stack
        self.end = end
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Hidden:
        """The hidden states entering layer ``end`` for ``batch`` (no grad)."""
        hidden = self.stack.embed(batch.input_ids, batch.attention_mask)
        if self.end == 0:
            return hidden
        keys = self._keys(batch) if self.max_bytes > 0 else None
        if keys is not None and all(k in self._rows for k in keys):
            states = hidden.states.clone()
            for row, key in enumerate(keys):
                cached = self._rows[key]
                states[row, : cached.shape[0]] = cached
            self.hits += 1
            return hidden.with_states(states)
        self.misses += 1
        out = self.stack.run(hidden, 0, self.end)
        if keys is not None:
            for row, key in enumerate(keys):
                if key in self._rows:
                    continue
                length = int(batch.attention_mask[row].sum())
                size = length * out.states.shape[-1] * out.states.element_size()
                if self.bytes + size > self.max_bytes:
                    break
                self._rows[key] = out.states[row, :length].clone()
                self.bytes += size
        return out

    @staticmethod
    def _keys(batch: Batch) -> list[bytes] | None:
        mask = batch.attention_mask
        lengths = mask.sum(dim=1)
        positions = torch.arange(mask.shape[1], device=mask.device)
        if not torch.equal(mask.bool(), positions[None, :] < lengths[:, None]):
            return None  # not right-padded: states at real positions may depend on padding
        return [
            batch.input_ids[row, : int(lengths[row])].cpu().numpy().tobytes()
            for row in range(mask.shape[0])
        ]


# ------------------------------------------------------------------------------------ chunks


@dataclass
class _Chunk:
    """A trainable piece of the block with its own local head, optimizer(s) and loss record.

    ``fused``: each parameter gets its own AdamW, stepped by a post-accumulate-grad hook as soon
    as its gradient is complete during the backward pass, and its gradient is then dropped; the
    block's gradients are never all alive at once (one parameter's worth at most), which lowers
    the peak when the activations are smaller than the gradients (module docstring). AdamW is
    elementwise, so this is the same update as one AdamW over all parameters. Used where the
    block's parameters receive their gradient in one backward call (layer and embed blocks);
    the ``head`` block, whose gradient arrives slice by slice, steps after the backward.
    """

    index: int
    kind: str  # "embed" | "layers" | "top"
    layers: tuple[int, int]  # decoder layers [a, b) run with grad (empty for embed/top)
    key: str  # where the head reads: names the translator in the heads file
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    shared: bool  # masters are the params themselves (fp32 weights)
    head: LocalHead
    optimizers: list[torch.optim.Optimizer]  # one per parameter when fused, else one for all
    head_optimizer: torch.optim.Optimizer | None
    fused: bool
    loss_sum: float = 0.0
    loss_count: int = 0
    _hooks: list[Any] = field(default_factory=list)

    def named_optimizers(self) -> list[tuple[str, torch.optim.Optimizer]]:
        """Every optimizer of the chunk, under a stable name (for checkpoints)."""
        named = [(f"b{i}", opt) for i, opt in enumerate(self.optimizers)]
        if self.head_optimizer is not None:
            named.append(("h", self.head_optimizer))
        return named

    def attach(self) -> None:
        """Fused mode: install the per-parameter step hooks (params must require grad)."""
        if not self.fused:
            return
        for p, master, opt in zip(self.params, self.masters, self.optimizers, strict=True):
            self._hooks.append(
                p.register_post_accumulate_grad_hook(
                    lambda p, master=master, opt=opt: self._step_one(p, master, opt)
                )
            )

    def detach_hooks(self) -> None:
        """Remove the hooks :meth:`attach` installed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _step_one(self, p: torch.Tensor, master: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        if not self.shared:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not self.shared:
            with torch.no_grad():
                p.copy_(master)

    def forward(self, stack: LayerStack, source: Hidden, batch: Batch) -> Hidden:
        """The chunk's output (with grad) for its input ``source`` (detached)."""
        if self.kind == "embed":
            return stack.embed(batch.input_ids, batch.attention_mask)
        if self.kind == "top":
            return source
        return stack.run(source, *self.layers)

    def update(self, out: Hidden, batch: Batch) -> float | None:
        """Local loss, backward inside the chunk, AdamW step(s); ``None`` if skipped.

        A non-finite loss is never propagated into the block (see ``LocalHead.backward``), so
        a fused chunk takes no step either.
        """
        loss = self.head.backward(out, batch)
        if not math.isfinite(loss):
            for _, opt in self.named_optimizers():
                opt.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
            return None
        if not self.fused:
            opt = self.optimizers[0]
            if not self.shared:
                for master, p in zip(self.masters, self.params, strict=True):
                    master.grad = None if p.grad is None else p.grad.float()
                    p.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not self.shared:
                with torch.no_grad():
                    for master, p in zip(self.masters, self.params, strict=True):
                        p.copy_(master)
        if self.head_optimizer is not None:
            self.head_optimizer.step()
            self.head_optimizer.zero_grad(set_to_none=True)
        self.loss_sum += loss
        self.loss_count += 1
        return loss


def split_layers(start: int, end: int, chunks: int) -> list[tuple[int, int]]:
    """Split layers ``start..end`` (inclusive) into ``chunks`` contiguous ``[a, b)`` ranges.

    As LoPT's ``build_block_ranges``: equal sizes, the remainder going to the earliest chunks;
    never more chunks than layers.
    """
    count = end - start + 1
    chunks = max(1, min(chunks, count))
    base, extra = divmod(count, chunks)
    ranges = []
    at = start
    for i in range(chunks):
        size = base + (1 if i < extra else 0)
        ranges.append((at, at + size))
        at += size
    return ranges


def live_hidden_size(stack: LayerStack) -> int:
    """Width of the hidden states entering the final norm (read from the norm's weight)."""
    weight = getattr(stack.norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError("cannot tell the hidden size: config.hidden_size and norm.weight absent")
    return int(weight.shape[0])


def _layer_index(name: str, layers_name: str) -> int:
    return int(name[len(layers_name) + 1 :].split(".", 1)[0])


# ------------------------------------------------------------------------------- persistence


def _atomic_save(tensors: Mapping[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """Write a safetensors file atomically (see :mod:`fedcybgd.core.atomic`)."""
    save_tensors(path, tensors, meta)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Tensors and metadata of a safetensors file, ``None`` if absent or unreadable."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        return load_file(str(path)), meta
    except (OSError, ValueError, SafetensorError) as err:  # corrupt: start afresh
        log.warning("ignoring unreadable %s (%s)", path, err)
        return None


def heads_path(state_dir: Path, block: str) -> Path:
    """Where the tuned maps of ``block`` are kept between rounds."""
    return state_dir / _STATE / "heads" / f"{block_name(block)}.safetensors"


def checkpoint_path(state_dir: Path) -> Path:
    """Where a round's in-progress checkpoint is kept."""
    return state_dir / _STATE / _CHECKPOINT


@dataclass
class _Progress:
    """Round progress besides the tensors: what a resumed round continues from."""

    step: int = 0  # batches consumed (applied + skipped steps)
    losses: list[float] = field(default_factory=list)  # final chunk's loss per applied step
    examples: int = 0
    skipped: int = 0
    chunk_sums: list[float] = field(default_factory=list)
    chunk_counts: list[int] = field(default_factory=list)


def _save_checkpoint(
    path: Path, identity: dict[str, Any], progress: _Progress, chunks: list[_Chunk]
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        c = f"c{chunk.index}"
        for j, master in enumerate(chunk.masters):
            tensors[f"{c}.w.{j}"] = master
        for name, p in _translator_params(chunk):
            tensors[f"{c}.map.{name}"] = p
        for oname, opt in chunk.named_optimizers():
            for idx, state in opt.state_dict()["state"].items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{c}.{oname}.{idx}.{key}"] = value
    progress.chunk_sums = [c.loss_sum for c in chunks]
    progress.chunk_counts = [c.loss_count for c in chunks]
    meta = {
        "identity": json.dumps(identity, sort_keys=True),
        "progress": json.dumps(asdict(progress)),
    }
    _atomic_save(tensors, path, meta)


def _fits(tensors: dict[str, torch.Tensor], meta: dict[str, str], chunks: list[_Chunk]) -> bool:
    """Does a checkpoint hold every tensor these chunks need, with the right shapes?"""
    try:
        progress = _Progress(**json.loads(meta["progress"]))
    except (KeyError, TypeError, ValueError):
        return False
    if len(progress.chunk_sums) != len(chunks) or len(progress.chunk_counts) != len(chunks):
        return False
    for chunk in chunks:
        c = f"c{chunk.index}"
        wanted = {f"{c}.w.{j}": m.shape for j, m in enumerate(chunk.masters)}
        wanted.update({f"{c}.map.{n}": p.shape for n, p in _translator_params(chunk)})
        for key, shape in wanted.items():
            if key not in tensors or tensors[key].shape != shape:
                return False
    return True


def _restore_checkpoint(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], chunks: list[_Chunk]
) -> _Progress:
    progress = _Progress(**json.loads(meta["progress"]))
    with torch.no_grad():
        for chunk in chunks:
            c = f"c{chunk.index}"
            for j, (master, p) in enumerate(zip(chunk.masters, chunk.params, strict=True)):
                master.copy_(tensors[f"{c}.w.{j}"])
                if not chunk.shared:
                    p.copy_(master)
            for name, param in _translator_params(chunk):
                param.copy_(tensors[f"{c}.map.{name}"])
            for oname, opt in chunk.named_optimizers():
                state_dict = opt.state_dict()
                state: dict[int, dict[str, torch.Tensor]] = {}
                prefix = f"{c}.{oname}."
                for key, value in tensors.items():
                    if key.startswith(prefix):
                        idx, name = key[len(prefix) :].split(".", 1)
                        state.setdefault(int(idx), {})[name] = value
                state_dict["state"] = state
                opt.load_state_dict(state_dict)
            chunk.loss_sum = progress.chunk_sums[chunk.index]
            chunk.loss_count = progress.chunk_counts[chunk.index]
    return progress


def _translator_params(chunk: _Chunk) -> list[tuple[str, nn.Parameter]]:
    translator = chunk.head.translator
    return [] if translator is None else list(translator.named_parameters())


def _skip(batches: Iterator[Batch], count: int) -> None:
    """Consume ``count`` batches (a BatchIterator skips without tokenizing)."""
    if isinstance(batches, BatchIterator):
        batches.step += count
        return
    for _ in range(count):
        next(batches)


# -------------------------------------------------------------------------------------- rule


class ZeroLock:
    """Block training on a local objective; see the module docstring."""

    name = "zerolock"

    def train(self, task: TrainTask) -> TrainOutcome:
        """Run ``task.steps`` local steps on ``task.block``."""
        opts = ZeroLockOptions.from_options(task.options)
        model, stack, blocks = task.model, task.stack, task.blocks
        info = blocks.info(task.block)
        for p in model.parameters():
            p.requires_grad_(False)
        params = blocks.parameters(model, task.block)

        if task.block == HEAD:
            kind, prefix_end = "top", stack.num_layers
            ranges = [(stack.num_layers, stack.num_layers)]
        elif task.block == EMBED:
            kind, prefix_end = "embed", 0
            ranges = [(0, 0)]
        else:
            assert info.layers is not None
            kind, prefix_end = "layers", info.layers[0]
            ranges = split_layers(info.layers[0], info.layers[1], opts.chunks)

        # Tied embeddings: see the module docstring. Only a block that owns the head's tensor
        # and is not the top needs a frozen copy of it.
        head_weight: torch.Tensor | None = None
        live_head = getattr(stack.head, "weight", None)
        if kind != "top" and live_head is not None and any(p is live_head for p in params):
            head_weight = live_head.detach().clone()

        # Where each chunk's head reads: its own output, or (the block's last chunk, with
        # zerolock-aux-layers) the output of that many frozen layers above the block.
        aux = (min(opts.aux_layers, stack.num_layers - ranges[-1][1]) if kind == "layers"
               else 0)
        embed_layers = min(opts.embed_layers, stack.num_layers)
        reads = [
            (b - 1 + (aux if i == len(ranges) - 1 else 0)) if kind == "layers"
            else embed_layers - 1  # the embed block's head reads its aux layers' output
            for i, (_, b) in enumerate(ranges)
        ]
        batches: Iterator[Batch] = task.batches
        calibration: dict[int, Translator | None] = {}
        calib_report: CalibrationReport | None = None
        if opts.head == "calibrated" and kind != "top":
            peeked: list[Batch] = []

            def take() -> list[Batch]:
                # the round's own first batches, put back: training still sees all of them
                if isinstance(task.batches, BatchIterator):
                    at = task.batches.step
                    got = [next(task.batches) for _ in range(opts.calib_batches)]
                    task.batches.step = at
                    return got
                # a finite iterator may hold fewer: fit on what there is
                peeked.extend(itertools.islice(task.batches, opts.calib_batches))
                return list(peeked)

            calibration, calib_report = calibrated_translators(
                stack, reads, take, task.state_dir, opts.calib_ridge, opts.calib_refit,
                opts.calib_batches)
            if peeked:
                batches = itertools.chain(peeked, task.batches)

        saved_maps = self._load_maps(task, opts) if kind != "top" else {}
        by_name = dict(model.named_parameters())
        hidden_size = int(getattr(model.config, "hidden_size", 0) or live_hidden_size(stack))
        chunks = []
        for index, (a, b) in enumerate(ranges):
            if kind == "layers":
                names = [
                    n for n in info.param_names if a <= _layer_index(n, blocks.layers_name) < b
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
                translator = calibration[reads[index]]  # frozen; None on the last layer
            if kind == "embed":
                aux_start, aux_count = 0, embed_layers
            elif kind == "layers":
                aux_start, aux_count = b, reads[index] - (b - 1)
            else:
                aux_start, aux_count = 0, 0
            head = LocalHead(
                stack,
                translator=translator,
                head_weight=head_weight,
                aux_layers=aux_count,
                objective=opts.objective,
                slice_rows=opts.slice,
                aux_start=aux_start,
            )
            chunks.append(self._make_chunk(index, kind, (a, b), key, chunk_params, head, task,
                                           opts))

        identity = {
            "seed": task.seed,
            "block": task.block,
            "head": opts.head,
            "head_rank": opts.head_rank,
            "objective": opts.objective,
            "chunks": len(chunks),
            "fused": [c.fused for c in chunks],
            "embed_layers": opts.embed_layers if kind == "embed" else 0,
            "aux_layers": aux,
        }
        ckpt = checkpoint_path(task.state_dir) if task.state_dir is not None else None
        progress = _Progress()
        resumed_from = 0
        if ckpt is not None:
            found = _read(ckpt)
            if found is not None:
                tensors, meta = found
                same = meta.get("identity") == json.dumps(identity, sort_keys=True)
                if same and _fits(tensors, meta, chunks):
                    progress = _restore_checkpoint(tensors, meta, chunks)
                    resumed_from = progress.step
                    _skip(batches, progress.step)
                    log.info("zerolock: resuming %s at step %d", task.block, progress.step)
                else:
                    ckpt.unlink(missing_ok=True)  # a previous round's leftover (or unusable)

        cache = PrefixCache(stack, prefix_end, int(opts.cache_mb * 2**20))
        for chunk in chunks:
            for p in chunk.params:
                p.requires_grad_(True)
            chunk.attach()
        last_save = time.monotonic()
        try:
            while progress.step < task.steps:
                batch = next(batches)
                final = self._train_step(stack, cache, chunks, batch)
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
                        _save_checkpoint(ckpt, identity, progress, chunks)
                        last_save = time.monotonic()
        finally:
            for chunk in chunks:
                chunk.detach_hooks()
            for p in params:
                p.requires_grad_(False)
                p.grad = None

        if task.state_dir is not None and opts.head == "tuned" and kind != "top":
            maps = {
                f"{chunk.key}.{name}": p
                for chunk in chunks
                for name, p in _translator_params(chunk)
            }
            _atomic_save(maps, heads_path(task.state_dir, task.block),
                         {"rank": str(opts.head_rank)})
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
    def _train_step(
        stack: LayerStack, cache: PrefixCache, chunks: list[_Chunk], batch: Batch
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
    ) -> _Chunk:
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
        return _Chunk(index, kind, layers, key, list(params), masters, shared, head, optimizers,
                      head_optimizer, fused)

    @staticmethod
    def _load_maps(task: TrainTask, opts: ZeroLockOptions) -> dict[str, torch.Tensor]:
        if opts.head != "tuned" or task.state_dir is None:
            return {}
        found = _read(heads_path(task.state_dir, task.block))
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
