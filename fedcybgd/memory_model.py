"""Estimate a client's peak memory for an update rule on a block, to fit nodes' budgets.

peak = runtime + weights + what the rule adds on top of holding the model:

* ``fo``: the block's gradients and AdamW moments (3 x its bytes; +1 for an fp32 master copy of
  low-precision weights) and the activations autograd keeps for every layer from the block up;
* ``zerolock``: the same optimizer state, the activations of the block's own layers only and the
  local head's logits at the label positions;
* ``lezo`` / ``mezo``: a small fixed workspace and the few elements whose exact restore must be
  saved (no activations are kept: forward passes only);
* ``inference``: one layer's transient activations.

The per-token activation cost of a layer and the runtime's own footprint are calibrated on the
measured figures of ``experiments/bench_updates.py`` (SmolLM2-135M, fp32, on CPU); the
calibration constants below say what they were fitted on. A test checks the estimate against a
fresh measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedcybgd.blocks import EMBED, HEAD, BlockMap

MB = 2**20
# Fitted on bench_updates.py (SmolLM2-135M fp32, batch 16 x 32 tokens, 1 thread, 2026-11-30):
# resident after load 1108 MB = runtime + 513 MB of weights; fo on layer.0 / .15 / .29 peaked
# 652 / 353 / 72 MB above that = 40 MB of AdamW state + 30 / 15 / 1 layers of activations.
RUNTIME_MB = 595.0  # python + torch + transformers + tokenizer + data, before weights
ACT_FLOATS_PER_TOKEN_PER_LAYER = 18.0  # x hidden_size: activations autograd keeps per layer
ZO_WORKSPACE_MB = 20.0  # LeZO's fixed perturbation workspace
ZO_PATCH_FRACTION = 0.05  # share of a unit's elements saved for an exact restore

RULE_ORDER = ("fo", "zerolock", "lezo")  # most to least memory; the fallback order


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    param_bytes: int  # all parameters, in their own dtype
    bytes_per_param: int  # 4 for fp32

    @classmethod
    def of(cls, model: object, blocks: BlockMap) -> ModelShape:
        """Read the shape of a loaded Hugging Face model."""
        config = model.config  # type: ignore[attr-defined]
        params = list(model.parameters())  # type: ignore[attr-defined]
        total = sum(b.numel for b in blocks.blocks.values())
        width = params[0].element_size() if params else 4
        return cls(
            num_layers=blocks.num_layers,
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            param_bytes=total * width,
            bytes_per_param=width,
        )


def estimate_peak_mb(
    shape: ModelShape,
    blocks: BlockMap,
    rule: str,
    block: str,
    batch_size: int,
    seq_len: int,
) -> float:
    """Estimated peak resident memory, in MiB, of one client-round (see the module docstring)."""
    weights = shape.param_bytes / MB
    info = blocks.info(block)
    block_bytes = info.numel * 4
    tokens = batch_size * seq_len
    layer_acts = tokens * shape.hidden_size * ACT_FLOATS_PER_TOKEN_PER_LAYER * 4 / MB
    logits = batch_size * shape.vocab_size * 4 / MB
    optimizer = 3 * block_bytes / MB + (block_bytes / MB if shape.bytes_per_param != 4 else 0)
    if info.name == EMBED:
        lowest, own_layers = 0, 0
    elif info.name == HEAD:
        lowest, own_layers = shape.num_layers, 0
    else:
        assert info.layers is not None
        lowest, own_layers = info.layers[0], info.layers[1] - info.layers[0] + 1
    if rule == "fo":
        extra = optimizer + (shape.num_layers - lowest) * layer_acts + logits
    elif rule == "zerolock":
        extra = optimizer + max(own_layers, 1) * layer_acts + logits
    elif rule in ("lezo", "mezo"):
        extra = ZO_WORKSPACE_MB + ZO_PATCH_FRACTION * block_bytes / MB + layer_acts
    elif rule == "inference":
        extra = layer_acts + logits
    else:
        raise ValueError(f"no memory estimate for update rule {rule!r}")
    return RUNTIME_MB + weights + extra


def fitting_rule(
    shape: ModelShape,
    blocks: BlockMap,
    block: str,
    budget_mb: float,
    batch_size: int,
    seq_len: int,
    preferred: str,
) -> str | None:
    """``preferred`` if it fits ``budget_mb``, else the first rule in :data:`RULE_ORDER` after it
    that fits; ``None`` when nothing fits. A budget of 0 means "no budget declared"."""
    if budget_mb <= 0:
        return preferred
    order = [preferred] + [r for r in RULE_ORDER if r != preferred]
    if preferred in RULE_ORDER:
        order = list(RULE_ORDER[RULE_ORDER.index(preferred):])
    for rule in order:
        if estimate_peak_mb(shape, blocks, rule, block, batch_size, seq_len) <= budget_mb:
            return rule
    return None
