"""The built-in update rules, declared for both sides: options, memory estimate, step log.

The implementations live in the client package (:mod:`fedcybgd.client.updates`) and are named
here as text, so the server knows every built-in rule without importing client code. The
registry imports this module on its first lookup.

Memory, on top of runtime + weights (see :mod:`fedcybgd.memory.estimate` for the shared part and
its calibration):

* ``fo``: the block's gradients and AdamW moments (+ an fp32 master copy of low-precision
  weights) and the activations autograd keeps for every layer from the block up, and the logits;
* ``zerolock``: the same optimizer state, the activations of the block's own layers only and the
  local head's logits at the label positions;
* ``lezo`` / ``mezo``: a small fixed workspace, the few elements whose exact restore must be
  saved, and one layer's transient activations (forward passes only, nothing kept).
"""

from __future__ import annotations

from fedcybgd.rules.builtin_options import FoOptions, LezoOptions, MezoOptions, ZeroLockOptions
from fedcybgd.rules.contract import MemoryNeeds
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


def zeroth_order_memory(needs: MemoryNeeds) -> float:
    """``lezo`` / ``mezo``: workspace, saved restore elements, one layer's activations, the
    scored positions' logits of a forward."""
    return (ZO_WORKSPACE_MB + ZO_PATCH_FRACTION * needs.block_mb
            + needs.layer_activations_mb + FORWARD_LOGIT_COPIES * needs.logits_mb
            + needs.frozen_transient_mb)


UPDATES = "fedcybgd.client.updates"
declare_rule("fo", options=FoOptions, memory=first_order_memory,
             implementation=f"{UPDATES}.fo:FirstOrder")
declare_rule("zerolock", options=ZeroLockOptions, memory=zerolock_memory,
             implementation=f"{UPDATES}.zerolock:ZeroLock")
declare_rule("lezo", options=LezoOptions, memory=zeroth_order_memory, step_log=True,
             implementation=f"{UPDATES}.lezo:LeZO")
declare_rule("mezo", options=MezoOptions, memory=zeroth_order_memory, step_log=True,
             implementation=f"{UPDATES}.lezo:MeZO")
