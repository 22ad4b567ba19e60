"""Calibrated local heads for ZeroLock: translators fitted to the model's own final layer.

The frozen LM head reads the last layer's hidden states; on a lower layer ``k`` it predicts
badly (the logit lens: on SmolLM2's lower layers the label loss is 14-25), so the gradient of
a local loss there points elsewhere than the true one. A **calibrated** head puts an affine map
``h -> h @ A + b`` before the frozen final norm and LM head, fitted so that the head's
prediction from layer ``k`` matches what the model itself predicts from its last layer (the
tuned-lens idea, here with a closed-form start):

1. **Least squares** (always): ``A, b`` minimise
   ``sum_i ||(h_k,i @ A + b - h_L,i) / rms(h_L,i)||^2`` over every real position ``i`` but
   the first of each row (a sink position with outsized states), plus a ridge
   ``ridge * tr(X^T X) / d * ||A - I||^2`` that pulls towards the identity (the logit lens)
   where the data say little. Rows are weighted by ``1 / rms(h_L)`` because the final norm
   is scale-invariant: what matters is the direction of the final state. One ``d x d`` solve
   in float64 on the CPU: milliseconds.
2. **KL refinement** (:func:`refine_kl`, measured by ``experiments/grad_alignment.py`` only):
   AdamW steps on ``KL(final || lens)`` at the rows the task scores (the label positions), the
   tuned lens's own objective, from the least-squares map. It did not improve the alignment
   over least squares (see docs/results.md), so the rule fits least squares only.

The map is the :class:`~fedcybgd.client.updates.local_heads.Translator` of the ``tuned`` head
(``x + x @ delta + bias``, with ``delta = A - I``), so it slots into :class:`LocalHead`
unchanged; it is kept frozen while the block trains (it is a property of the layers above,
which the round does not change).

Where it is fitted: on the node, forward-only, on the node's own training batches (see
``zerolock.py``), so nothing crosses the wire and no held-out data shapes training.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from fedcybgd.client.updates.local_heads import Translator
from fedcybgd.core.atomic import save_tensors
from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.tasks.objective import scored_states

log = logging.getLogger(__name__)

EMBEDDINGS = -1  # "output of layer -1": the embeddings (the embed block's head with no layers)


@dataclass
class LayerRows:
    """Hidden rows of a few layers and of the last layer at the same positions (no grad).

    ``sources[k]``: ``[N, H]`` outputs of layer ``k`` (``EMBEDDINGS``: the embeddings) at every
    real position but each row's first; ``target``: the last layer's outputs there;
    ``scored_sources[k]`` / ``scored_target``: the same at the positions the task scores.
    """

    sources: dict[int, torch.Tensor]
    target: torch.Tensor
    scored_sources: dict[int, torch.Tensor]
    scored_target: torch.Tensor


@torch.no_grad()
def collect_rows(stack: LayerStack, batches: Iterable[Batch], layers: Sequence[int]) -> LayerRows:
    """Run the whole model forward (no grad) on ``batches``; keep the rows of ``layers``.

    Memory: one batch's activations at a time, plus ``N x H`` floats per layer kept.
    """
    wanted = sorted(set(layers))
    if any(k < EMBEDDINGS or k >= stack.num_layers for k in wanted):
        raise ValueError(f"layers must be in [-1, {stack.num_layers}), got {wanted}")
    sources: dict[int, list[torch.Tensor]] = {k: [] for k in wanted}
    scored: dict[int, list[torch.Tensor]] = {k: [] for k in wanted}
    target: list[torch.Tensor] = []
    scored_target: list[torch.Tensor] = []
    for batch in batches:
        mask = batch.attention_mask.bool().clone()
        first = mask.float().argmax(dim=1)  # first real position of each row
        mask[torch.arange(mask.shape[0]), first] = False
        hidden = stack.embed(batch.input_ids, batch.attention_mask)
        if EMBEDDINGS in sources:
            sources[EMBEDDINGS].append(hidden.states[mask].float())
            scored[EMBEDDINGS].append(scored_states(hidden.states, batch).float())
        at = 0
        for k in range(stack.num_layers):
            hidden = stack.run(hidden, at, k + 1)
            at = k + 1
            if k in sources:
                sources[k].append(hidden.states[mask].float())
                scored[k].append(scored_states(hidden.states, batch).float())
        target.append(hidden.states[mask].float())
        scored_target.append(scored_states(hidden.states, batch).float())
    if not target:
        raise ValueError("collect_rows() got no batches")
    return LayerRows(
        {k: torch.cat(v) for k, v in sources.items()}, torch.cat(target),
        {k: torch.cat(v) for k, v in scored.items()}, torch.cat(scored_target),
    )


def fit_least_squares(source: torch.Tensor, target: torch.Tensor, ridge: float = 1e-2,
                      seed: int = 0) -> Translator:
    """The affine map from ``source`` rows to ``target`` rows (module docstring, step 1).

    Parameters
    ----------
    source, target : torch.Tensor
        ``[N, H]`` rows at the same positions.
    ridge : float
        Strength of the pull towards the identity, relative to the mean eigenvalue of the
        rows' (weighted, centred) second moment; > 0 keeps the solve well posed with few rows.
    """
    if source.shape != target.shape or source.dim() != 2:
        raise ValueError(f"source and target must be [N, H] alike, got {tuple(source.shape)} "
                         f"and {tuple(target.shape)}")
    if ridge <= 0:
        raise ValueError(f"ridge must be > 0, got {ridge}")
    x = source.detach().double().cpu()
    y = target.detach().double().cpu()
    # each row's residual is measured in units of its target's rms (the norm is scale-free)
    weight = 1.0 / y.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-6)
    w2 = weight.pow(2)
    x_mean = (w2 * x).sum(0) / w2.sum()
    y_mean = (w2 * y).sum(0) / w2.sum()
    xc = (x - x_mean) * weight
    yc = (y - y_mean) * weight
    gram = xc.T @ xc
    hidden = gram.shape[0]
    lam = ridge * float(torch.diagonal(gram).mean())
    eye = torch.eye(hidden, dtype=gram.dtype)
    # min ||xc A - yc||^2 + lam ||A - I||^2  ->  (G + lam I) A = xc^T yc + lam I
    a = torch.linalg.solve(gram + lam * eye, xc.T @ yc + lam * eye)
    b = y_mean - x_mean @ a
    translator = Translator(hidden, rank=0, seed=seed)
    with torch.no_grad():
        translator.delta.copy_((a - eye).float())
        translator.bias.copy_(b.float())
    return translator


def _lens_logits(stack: LayerStack, translator: Translator | None, rows: torch.Tensor,
                 head_weight: torch.Tensor | None = None) -> torch.Tensor:
    if translator is not None:
        rows = translator(rows)
    return stack.head_logits(stack.final_hidden(rows), head_weight).float()


def lens_kl(stack: LayerStack, translator: Translator | None, source: torch.Tensor,
            target: torch.Tensor, slice_rows: int = 256,
            head_weight: torch.Tensor | None = None) -> float:
    """Mean ``KL(final || lens)`` per row: how far the head on ``source`` (through
    ``translator``) is from the model's own prediction from ``target`` (no grad)."""
    if source.shape[0] == 0:
        raise ValueError("lens_kl() got no rows")
    total = 0.0
    dtype = next(stack.model.parameters()).dtype
    with torch.no_grad():
        for begin in range(0, source.shape[0], slice_rows):
            part = slice(begin, begin + slice_rows)
            teacher = F.log_softmax(_lens_logits(stack, None, target[part].to(dtype),
                                                 head_weight), dim=-1)
            student = F.log_softmax(_lens_logits(stack, translator, source[part].to(dtype),
                                                 head_weight), dim=-1)
            total += float(F.kl_div(student, teacher, log_target=True, reduction="sum"))
    return total / source.shape[0]


def refine_kl(stack: LayerStack, translator: Translator, source: torch.Tensor,
              target: torch.Tensor, steps: int, lr: float = 1e-3, slice_rows: int = 256,
              head_weight: torch.Tensor | None = None, seed: int = 0) -> list[float]:
    """AdamW steps on ``KL(final || lens)`` over minibatches of ``slice_rows`` rows (module
    docstring, step 2); returns the loss per step. The model's weights get no gradient."""
    if steps <= 0:
        return []
    dtype = next(stack.model.parameters()).dtype
    opt = torch.optim.AdamW(translator.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        pick = torch.randperm(source.shape[0], generator=gen)[:slice_rows]
        with torch.no_grad():
            teacher = F.log_softmax(_lens_logits(stack, None, target[pick].to(dtype),
                                                 head_weight), dim=-1)
        with torch.enable_grad():
            student = F.log_softmax(_lens_logits(stack, translator, source[pick].to(dtype),
                                                 head_weight), dim=-1)
            loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


# --------------------------------------------------------------- on the node: fit, cache, refit


def weight_sketch(stack: LayerStack, first: int, samples: int = 1024) -> torch.Tensor:
    """Fixed, seeded sample of ``samples`` coordinates of every tensor of layers
    ``first..L-1`` (fp32, on the CPU): what a calibration of a layer below ``first`` depends
    on. Block updates are dense (AdamW moves every coordinate), so the sample's relative
    change estimates the layers' relative change in norm."""
    parts = []
    for i in range(max(first, 0), stack.num_layers):
        for n, (_, tensor) in enumerate(sorted(stack.layers[i].state_dict().items())):
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 0 or flat.dtype == torch.bool:
                continue
            gen = torch.Generator().manual_seed(100_003 * i + n)
            idx = torch.randint(flat.numel(), (min(samples, flat.numel()),), generator=gen)
            parts.append(flat[idx.to(flat.device)].float().cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


def moved(then: torch.Tensor, now: torch.Tensor) -> float:
    """Relative change ``||now - then|| / ||then||`` of two sketches (inf if incomparable)."""
    if then.shape != now.shape or then.numel() == 0:
        return math.inf
    base = float(then.norm())
    return float((now - then).norm()) / base if base > 0 else math.inf


def calibration_path(state_dir: Path, layer: int) -> Path:
    """Where the node keeps the calibrated translator reading layer ``layer``'s output."""
    name = "embeddings" if layer == EMBEDDINGS else f"layer.{layer}"
    return state_dir / "zerolock" / "calibration" / f"{name}.safetensors"


@dataclass
class CalibrationReport:
    """What calibrating cost and found in one round (the rule's metrics)."""

    fitted: int = 0  # translators fitted this round (the others came from the node's cache)
    fit_s: float = 0.0  # forward passes + solves
    moved: float = 0.0  # largest relative movement of the layers above a cached translator
    kl_lens: float = math.nan  # KL(final || logit lens) on the fit batches' scored rows
    kl_calibrated: float = math.nan  # the same through the fitted translator

    def metrics(self) -> dict[str, float]:
        """As ``zerolock_calib_*`` reply metrics. The KLs only when a translator was fitted
        this round: a NaN metric makes the server drop the upload, and a round whose heads
        all came from the cache (or read the last layer, the model's own head) has none."""
        out = {"zerolock_calib_fitted": float(self.fitted),
               "zerolock_calib_fit_s": self.fit_s,
               "zerolock_calib_moved": self.moved}
        if math.isfinite(self.kl_lens) and math.isfinite(self.kl_calibrated):
            out |= {"zerolock_calib_kl_lens": self.kl_lens,
                    "zerolock_calib_kl": self.kl_calibrated}
        return out


def calibrated_translators(
    stack: LayerStack,
    layers: Sequence[int],
    take_batches: Callable[[], list[Batch]],
    state_dir: Path | None,
    ridge: float,
    refit: float,
    fit_batches: int,
) -> tuple[dict[int, Translator | None], CalibrationReport]:
    """Frozen calibrated translators for heads reading ``layers`` (``None`` for the last
    layer: its head is the model's own).

    A translator cached in ``state_dir`` is reused while the layers above it moved by at most
    ``refit`` (relative norm, :func:`weight_sketch`) since it was fitted with the same
    ``ridge`` and ``fit_batches``; otherwise every stale one is fitted again from one forward
    pass over ``take_batches()`` (the node's own batches) and cached.
    """
    report = CalibrationReport()
    device = next(stack.model.parameters()).device
    out: dict[int, Translator | None] = {}
    stale: list[int] = []
    sketches: dict[int, torch.Tensor] = {}
    for j in sorted(set(layers)):
        if j >= stack.num_layers - 1:
            out[j] = None
            continue
        sketches[j] = weight_sketch(stack, j + 1)
        found = _read_calibration(calibration_path(state_dir, j)) if state_dir else None
        if found is not None:
            tensors, meta = found
            change = moved(tensors["sketch"], sketches[j])
            same = meta.get("ridge") == repr(ridge) and meta.get("batches") == str(fit_batches)
            if same and change <= refit and math.isfinite(change):
                report.moved = max(report.moved, change)
                cached = Translator(int(tensors["bias"].shape[0]))
                cached.delta.data.copy_(tensors["delta"])
                cached.bias.data.copy_(tensors["bias"])
                out[j] = cached
                continue
            if math.isfinite(change):
                report.moved = max(report.moved, change)
        stale.append(j)
    if stale:
        started = time.perf_counter()
        rows = collect_rows(stack, take_batches(), stale)
        for j in stale:
            fresh = fit_least_squares(rows.sources[j].cpu(), rows.target.cpu(), ridge)
            out[j] = fresh
            if state_dir is not None:
                save_tensors(calibration_path(state_dir, j),
                             {"delta": fresh.delta.detach(), "bias": fresh.bias.detach(),
                              "sketch": sketches[j]},
                             {"ridge": repr(ridge), "batches": str(fit_batches)})
        report.fit_s = time.perf_counter() - started
        report.fitted = len(stale)
        first = out[stale[0]]
        report.kl_lens = lens_kl(stack, None, rows.scored_sources[stale[0]], rows.scored_target)
        report.kl_calibrated = lens_kl(stack, first.to(device) if first else None,
                                       rows.scored_sources[stale[0]], rows.scored_target)
    for translator in out.values():
        if translator is not None:
            translator.to(device)
            translator.requires_grad_(False)
    return out, report


def _read_calibration(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A cached translator's tensors and metadata; ``None`` if absent or unusable (refit)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (OSError, ValueError, SafetensorError) as err:
        log.warning("zerolock: ignoring unreadable calibration %s (%s); refitting", path, err)
        return None
    needed = {"delta", "bias", "sketch"}
    if not needed <= set(tensors) or tensors["delta"].dim() != 2 or tensors["bias"].dim() != 1 \
            or tensors["delta"].shape != (tensors["bias"].shape[0],) * 2:
        log.warning("zerolock: calibration %s lacks or misshapes %s; refitting", path, needed)
        return None
    return tensors, meta
