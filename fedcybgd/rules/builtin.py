"""The built-in update rules, each declared for both sides beside its options and its memory
estimate: ``fo``, ``zerolock``, ``lezo``, ``mezo``.

A rule's options are a frozen dataclass of run-config keys (:func:`fedcybgd.core.fields.setting`:
key, default, range, meaning), parsed by the one parser of every rule's options
(:mod:`fedcybgd.rules.options`), which the server runs for every registered rule at start and each
rule runs again on the options it receives. A key shared by two rules (``zo-eps``) has one
default and one range. The implementations live in the client package
(:mod:`fedcybgd.client.updates`), which binds them to these names, so the server knows every
built-in rule without importing client code. Importing :mod:`fedcybgd.rules` declares them.

Memory, on top of runtime + weights (see :mod:`fedcybgd.memory.estimate` for the shared part and
its calibration):

* ``fo``: the block's gradients and AdamW moments (+ an fp32 master copy of low-precision
  weights) and the activations autograd keeps for every layer from the block up, and the logits;
* ``zerolock``: the same optimizer state, the activations of the block's own layers only and the
  local head's logits at the label positions;
* ``lezo`` / ``mezo``: a small fixed workspace, the step cache (z and the perturbed units'
  starting values, when within ``zo-step-cache-mb``, 64 MB by default) or else the few
  elements whose exact restore must be saved, and one layer's transient activations (forward
  passes only).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedcybgd.choices import ZEROLOCK_HEADS, ZEROLOCK_OBJECTIVES
from fedcybgd.core.fields import normalize, setting
from fedcybgd.rules.contract import MemoryNeeds
from fedcybgd.rules.options import RuleOptions
from fedcybgd.rules.registry import declare_rule

# Fitted on bench_updates.py (SmolLM2-135M fp32, batch 16 x 32 tokens, 1 thread, 2026-11-30).
ZO_WORKSPACE_MB = 20.0  # LeZO's fixed perturbation workspace
# Copies of the scored positions' [N, V] logits alive at the loss's peak. Backward: the logits,
# the log-softmax cross-entropy keeps, and the gradients of both; a no-grad forward (LeZO):
# the logits and the log-softmax. Fitted on bench_updates_tasks.json (SmolLM2, sft vs
# classification, fo and lezo-0.25 on layer.29, batch 8 x 128): see that file's rows.
BACKWARD_LOGIT_COPIES = 4.0
FORWARD_LOGIT_COPIES = 2.0
ZO_PATCH_FRACTION = 0.05  # share of a unit's elements saved for an exact restore
# Rule options that trade speed for memory, set this way when a node's budget needs it (the
# memory module tries a rule at these before falling back to a smaller rule).
LEAN_OPTIONS: dict[str, float] = {"zo-step-cache-mb": 0.0}
ZO_STEP_CACHE_DOC = (
    "`lezo`, `mezo`: memory a step may keep its z and the perturbed units' starting values in "
    "(8 bytes a perturbed element; 4 for fp16/bf16 weights), so z is drawn once a step and the "
    "restore is a copy; a step that needs more draws z three times and saves only the elements "
    "an exact restore needs (the same weights either way; the cache saves a tenth of a step or "
    "more on SmolLM2, see Results); 0 = never")


@dataclass(frozen=True)
class FoOptions(RuleOptions):
    """``fo`` (first-order AdamW on the block)."""

    recompute: bool = setting(False, key="fo-recompute", doc=(
        "`fo`: activation checkpointing of the layers above the block (their activations are "
        "recomputed in backward), so training a low block costs about what the top block does"))

    def __post_init__(self) -> None:
        normalize(self)


def first_order_memory(needs: MemoryNeeds) -> float:
    """``fo``: optimizer state, activations from the block up, logits. With ``fo-recompute``
    the layers above the block keep only their inputs, and one of them is recomputed at a time
    in backward."""
    if FoOptions.from_options(needs.options).recompute:
        above = needs.layers_from_block - needs.own_layers
        kept = (needs.own_layers * needs.layer_activations_mb + above * needs.layer_input_mb
                # the layer being recomputed, and its backward's own temporaries: fitted on
                # fo/recompute(/bf16) on layer.0 (bench_updates_precision.json): -9.5% / -2%
                # with one layer, -8% / 0% with two
                + (2 * needs.layer_activations_mb if above > 0 else 0.0))
    else:
        kept = needs.layers_from_block * needs.layer_activations_mb
    return (_with_gradients(needs, kept) + BACKWARD_LOGIT_COPIES * needs.logits_mb
            + needs.frozen_transient_mb)


def _with_gradients(needs: MemoryNeeds, kept_mb: float) -> float:
    """Optimizer state and kept activations at the peak: backward frees a layer's activations
    as it writes that layer's gradients, so the two are counted as the larger, not the sum
    (the sum over-estimated SmolLM2's 30-layer block by 19% for ``fo``, 24% for ``zerolock``;
    for one layer the gradients are small and either way gives the same)."""
    return needs.optimizer_mb - needs.block_mb + max(needs.block_mb, kept_mb)


declare_rule("fo", options=FoOptions, memory=first_order_memory, example_dp=True,
             implementation=None)


@dataclass(frozen=True)
class ZeroLockOptions(RuleOptions):
    """``zerolock``: a local objective at the block's output (see the rule's module)."""

    head: str = setting("frozen-lm", key="zerolock-head", choices=ZEROLOCK_HEADS, doc=(
        "`zerolock`'s local head: `frozen-lm` (the model's frozen norm + LM head), `tuned` (plus "
        "a learned residual map, kept by the node) or `calibrated` (plus a frozen affine map "
        "fitted by the node, forward-only on its own batches, so the head's prediction matches "
        "the model's final layer; see below)"))
    head_rank: int = setting(0, key="zerolock-head-rank", ge=0, doc=(
        "rank of the `tuned` map; 0 = a full d x d map"))
    head_lr: float = setting(0.0, key="zerolock-head-lr", ge=0, doc=(
        "learning rate of the `tuned` map; 0 = `lr`"))
    objective: str = setting("label", key="zerolock-objective", choices=ZEROLOCK_OBJECTIVES, doc=(
        "`label` (the label token) or `next-token` (language-model loss of prompt + label)"))
    slice: int = setting(256, key="zerolock-slice", ge=1, doc=(
        "rows per local-head slice (bounds the logits alive at once)"))
    chunks: int = setting(1, key="zerolock-chunks", ge=1, doc=(
        "chunks per layer block, each with its own loss and optimizer"))
    embed_layers: int = setting(1, key="zerolock-embed-layers", ge=0, doc=(
        "frozen decoder layers in the `embed` block's local head"))
    checkpoint_every: int = setting(0, key="zerolock-checkpoint-every", doc=(
        "in-round checkpoint every N steps; 0 = by time (next key); < 0 = off"))
    checkpoint_seconds: float = setting(60.0, key="zerolock-checkpoint-seconds", ge=0, doc=(
        "seconds between in-round checkpoints when `zerolock-checkpoint-every = 0`; 0 = off"))
    cache_mb: float = setting(256.0, key="zerolock-cache-mb", ge=0, doc=(
        "bound of the per-round cache of prefix outputs; 0 = no cache"))
    fused_step: bool = setting(True, key="zerolock-fused-step", doc=(
        "step each parameter inside the backward pass"))
    aux_layers: int = setting(0, key="zerolock-aux-layers", ge=0, doc=(
        "frozen layers above a layer block run inside its local head (gradient through their "
        "activations; AugLocal-style): costs their activations, buys gradient alignment (see "
        "Results)"))
    calib_batches: int = setting(4, key="zerolock-calib-batches", ge=1, doc=(
        "`calibrated`: the node's own batches the translator is fitted on (one forward pass each)"))
    calib_ridge: float = setting(1e-2, key="zerolock-calib-ridge", gt=0, doc=(
        "`calibrated`: pull of the least-squares fit towards the identity, relative to the "
        "data's mean eigenvalue"))
    calib_refit: float = setting(0.02, key="zerolock-calib-refit", ge=0, doc=(
        "`calibrated`: a cached translator is refitted once the layers above it moved by more "
        "than this relative norm since its fit; 0 = every round"))

    def __post_init__(self) -> None:
        normalize(self)


def zerolock_memory(needs: MemoryNeeds) -> float:
    """``zerolock``: optimizer state, the block's own activations (at least one layer's, for
    the embeddings and the head) and those of its head's ``zerolock-aux-layers`` (a layer
    block's), the local head's logits."""
    options = ZeroLockOptions.from_options(needs.options)
    aux = 0
    if needs.own_layers > 0:
        aux = min(options.aux_layers, needs.layers_from_block - needs.own_layers)
    kept = (max(needs.own_layers, 1) + aux) * needs.layer_activations_mb
    rows = needs.scored_rows
    # the local head scores at most zerolock-slice rows at a time
    sliced = min(1.0, options.slice / rows) if rows else 1.0
    return (_with_gradients(needs, kept)
            + BACKWARD_LOGIT_COPIES * sliced * needs.logits_mb + needs.frozen_transient_mb)


declare_rule("zerolock", options=ZeroLockOptions, memory=zerolock_memory,
             implementation=None)


@dataclass(frozen=True)
class LezoOptions(RuleOptions):
    """``lezo``: sparse zeroth-order steps (weight decay is the run's ``weight-decay``)."""

    eps: float = setting(1e-3, key="zo-eps", gt=0, doc=(
        "`lezo`, `mezo`: perturbation scale"))
    density: float = setting(0.25, key="lezo-density", gt=0, le=1, doc=(
        "`lezo`: share of the block's units perturbed per step"))
    step_cache_mb: float = setting(64.0, key="zo-step-cache-mb", ge=0, doc=ZO_STEP_CACHE_DOC)

    def __post_init__(self) -> None:
        normalize(self)



@dataclass(frozen=True)
class MezoOptions(RuleOptions):
    """``mezo``: LeZO with every unit perturbed (``lezo-density`` does not apply)."""

    eps: float = setting(1e-3, key="zo-eps", gt=0, doc=(
        "`lezo`, `mezo`: perturbation scale"))
    step_cache_mb: float = setting(64.0, key="zo-step-cache-mb", ge=0, doc=ZO_STEP_CACHE_DOC)

    def __post_init__(self) -> None:
        normalize(self)


def step_cache_mb(block_mb: float, density: float, cache_mb: float) -> float:
    """What a zeroth-order step keeps to draw z once: z and the starting values of the
    perturbed share of the block (two fp32 copies of it), or nothing above ``cache_mb``."""
    need = 2.0 * density * block_mb
    return need if need <= cache_mb else 0.0


def _zeroth_order_memory(needs: MemoryNeeds, density: float, cache_mb: float) -> float:
    cache = step_cache_mb(needs.block_mb, density, cache_mb)
    return (ZO_WORKSPACE_MB + (cache if cache else ZO_PATCH_FRACTION * needs.block_mb)
            + needs.layer_activations_mb + FORWARD_LOGIT_COPIES * needs.logits_mb
            + needs.frozen_transient_mb)


def lezo_memory(needs: MemoryNeeds) -> float:
    """``lezo``: workspace, the step cache (or the saved restore elements), one layer's
    activations, the scored positions' logits of a forward."""
    options = LezoOptions.from_options(needs.options)
    return _zeroth_order_memory(needs, options.density, options.step_cache_mb)


def mezo_memory(needs: MemoryNeeds) -> float:
    """``mezo``: as ``lezo`` with every unit perturbed."""
    return _zeroth_order_memory(needs, 1.0, MezoOptions.from_options(needs.options)
                                .step_cache_mb)


declare_rule("lezo", options=LezoOptions, memory=lezo_memory, step_log=True,
             example_dp=True, implementation=None)
declare_rule("mezo", options=MezoOptions, memory=mezo_memory, step_log=True,
             example_dp=True, implementation=None)
