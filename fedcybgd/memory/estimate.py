"""Estimate a client's peak memory for an update rule on a block, to fit nodes' budgets.

peak = runtime + weights + what the rule adds on top of holding the model. This module computes
the shared part and what a client-round on the block costs (:class:`MemoryNeeds`); each rule
declares its own addition as a function of it (:class:`fedcybgd.rules.RuleSpec` ``memory``; the
built-in rules' in :mod:`fedcybgd.rules.builtin`), so a plug-in rule takes part in budgets like
the built-in ones. ``inference`` (one layer's transient activations and the logits) is the
forward-only floor the benchmarks compare against.

The per-token activation cost of a layer and the runtime's own footprint are calibrated on the
measured figures of ``experiments/bench_updates.py`` (SmolLM2-135M, fp32, on CPU); the
calibration constants below say what they were fitted on. A test checks the estimate against a
fresh measurement.

Used by the client (budget check) and the server (memory-aware assignment): no client imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcybgd.model.blocks import EMBED, HEAD
from fedcybgd.rules import MemoryNeeds, rule_spec
from fedcybgd.rules.builtin import LEAN_OPTIONS

if TYPE_CHECKING:
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.precision import Precision

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

MB = 2**20
# Fitted on bench_updates.py (SmolLM2-135M fp32, batch 16 x 32 tokens, 1 thread, 2026-11-30):
# resident after load 1108 MB = runtime + 513 MB of weights; fo on layer.0 / .15 / .29 peaked
# 652 / 353 / 72 MB above that = 40 MB of AdamW state + 30 / 15 / 1 layers of activations.
# The runtime (bench rows' runtime_rss_mb) was 541 MB on 2026-12-01 and fell to 505 MB once
# fedcybgd.data stopped importing datasets/flwr-datasets at import time; the project's CI
# machine measured 602 MB for the same code, so the runtime is a property of the machine: a
# node measures its own (measured_runtime_mb) and RUNTIME_MB is only the default of an estimate
# made away from the node. tests/memory/test_memory_budget.py checks the rest of the model against
# every committed row above that row's own runtime, and a node's own figure against its peak.
RUNTIME_MB = 534.0  # python + torch + transformers + tokenizer + data, before weights
ACT_FLOATS_PER_TOKEN_PER_LAYER = 18.0  # x hidden_size: activations autograd keeps per layer
# Frozen blocks in bf16/int8 (fedcybgd.model.precision), fitted on fo/bf16 and fo/int8 on
# layer.0 (bench_updates_precision_bottom.json, 2026-12-01): 620 / 609 MB above the loaded
# model through 30 layers = 19.6 / 18.7 MB a layer, i.e. 16.7 / 16.0 floats per token (fp32:
# 17.6); the CPU computes frozen matmuls in fp32 and casts only norm inputs to bf16.
ACT_FLOATS_LOW_PRECISION = 16.5
# An int8 forward dequantizes into one reused workspace of DEQUANT_CHUNK (1M) fp32 elements.
DEQUANT_TRANSIENT_MB = 4.0
INFERENCE = "inference"  # not a rule: the forward-only floor

RULE_ORDER = ("fo", "zerolock", "lezo")  # most to least memory; the fallback order


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    param_bytes: int  # all parameters, in their own dtype
    bytes_per_param: int  # 4 for fp32
    # (block, elements, rows) of the weights frozen-quant int8 quantizes, per block
    int8_weights: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, model: object, blocks: BlockMap) -> ModelShape:
        """Read the shape of a loaded Hugging Face model."""
        from fedcybgd.model.precision import int8_weights

        config = model.config  # type: ignore[attr-defined]
        params = list(model.parameters())  # type: ignore[attr-defined]
        total = sum(b.numel for b in blocks.blocks.values())
        width = params[0].element_size() if params else 4
        quantized = int8_weights(model, blocks)  # type: ignore[arg-type]
        return cls(
            num_layers=blocks.num_layers,
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            param_bytes=total * width,
            bytes_per_param=width,
            int8_weights=tuple((b, e, r) for b, (e, r) in quantized.items()),
        )

    def frozen_bytes(self, blocks: BlockMap, block: str, precision: Precision | None) -> int:
        """Bytes ``block`` takes in its frozen form (``precision``; ``None``: as loaded)."""
        numel = blocks.info(block).numel
        if precision is None or precision.full:
            return numel * self.bytes_per_param
        width = _DTYPE_BYTES[precision.dtype]
        if precision.quant != "int8":
            return numel * width
        elements, rows = next(((e, r) for b, e, r in self.int8_weights if b == block), (0, 0))
        return (numel - elements) * width + elements + 4 * rows


def weights_mb(shape: ModelShape, blocks: BlockMap, trained: str | None,
               precision: Precision | None) -> float:
    """The model's weights as a client holds them: ``trained`` in fp32 (``None``: no block
    trained, e.g. inference), every other block in its frozen form."""
    if precision is None or precision.full:
        return shape.param_bytes / MB
    total = 0
    for name in blocks.names:
        if name == trained:
            total += blocks.info(name).numel * 4
        else:
            total += shape.frozen_bytes(blocks, name, precision)
    return total / MB


def memory_needs(
    shape: ModelShape, blocks: BlockMap, block: str, batch_size: int, seq_len: int,
    precision: Precision | None = None, options: Mapping[str, Any] | None = None,
    trained: bool = True, scored_tokens: int | None = None,
) -> MemoryNeeds:
    """What one client-round on ``block`` costs, before a rule's own additions.

    ``precision``: how frozen blocks are held; ``options``: the run's rule options (a rule's
    estimate reads its own, e.g. ``fo-recompute``); ``trained = False``: no block is held in
    fp32 (the inference floor); ``scored_tokens``: the positions of a batch that reach the LM
    head (:meth:`fedcybgd.tasks.base.Task.max_scored_tokens`; ``None``: one a row, as
    classification scores).
    """
    scored = batch_size if scored_tokens is None else int(scored_tokens)
    if scored < 0:
        raise ValueError(f"scored_tokens must be >= 0, got {scored_tokens}")
    info = blocks.info(block)
    block_bytes = info.numel * 4
    tokens = batch_size * seq_len
    if info.name == EMBED:
        lowest, own_layers = 0, 0
    elif info.name == HEAD:
        lowest, own_layers = shape.num_layers, 0
    else:
        assert info.layers is not None
        lowest, own_layers = info.layers[0], info.layers[1] - info.layers[0] + 1
    low = precision is not None and not precision.full
    int8 = precision is not None and precision.quant == "int8"
    return MemoryNeeds(
        weights_mb=weights_mb(shape, blocks, block if trained else None, precision),
        block_mb=block_bytes / MB,
        optimizer_mb=3 * block_bytes / MB + (
            block_bytes / MB if shape.bytes_per_param != 4 else 0),
        layer_activations_mb=tokens * shape.hidden_size * 4 / MB * (
            ACT_FLOATS_LOW_PRECISION if low else ACT_FLOATS_PER_TOKEN_PER_LAYER),
        logits_mb=scored * shape.vocab_size * 4 / MB,
        layers_from_block=shape.num_layers - lowest,
        own_layers=own_layers,
        num_layers=shape.num_layers,
        options=dict(options or {}),
        layer_input_mb=tokens * shape.hidden_size * 4 / MB,
        frozen_transient_mb=DEQUANT_TRANSIENT_MB if int8 else 0.0,
        scored_rows=scored,
    )


def estimate_peak_mb(
    shape: ModelShape,
    blocks: BlockMap,
    rule: str,
    block: str,
    batch_size: int,
    seq_len: int,
    precision: Precision | None = None,
    options: Mapping[str, Any] | None = None,
    scored_tokens: int | None = None,
    runtime_mb: float = RUNTIME_MB,
) -> float:
    """Estimated peak resident memory, in MiB, of one client-round (see the module docstring).

    ``rule`` is a registered update rule, or ``"inference"``; ``precision`` how the client
    holds its frozen blocks (``frozen-dtype``, ``frozen-quant``), ``options`` the run's rule
    options (``fo-recompute``), ``scored_tokens`` the positions of a batch the LM head scores
    (``None``: one a row; an sft batch scores every response token), ``runtime_mb`` what the
    process holds besides the weights (a node's :func:`measured_runtime_mb`).

    Raises
    ------
    ConfigError
        ``rule`` is not registered.
    ValueError
        The rule's estimate is not a finite number >= 0.
    """
    needs = memory_needs(shape, blocks, block, batch_size, seq_len, precision, options,
                         trained=rule != INFERENCE, scored_tokens=scored_tokens)
    if rule == INFERENCE:
        extra = needs.layer_activations_mb + needs.logits_mb + needs.frozen_transient_mb
    else:
        extra = rule_spec(rule).memory(needs)
        if isinstance(extra, bool) or not isinstance(extra, int | float) or not (
                math.isfinite(extra) and extra >= 0):
            raise ValueError(f"update rule {rule!r}: memory estimate {extra!r} for block "
                             f"{block} is not a finite number >= 0")
    return runtime_mb + needs.weights_mb + extra


def measured_runtime_mb(shape: ModelShape, blocks: BlockMap, precision: Precision | None,
                        rss_mb: float) -> float:
    """A node's own runtime term: its resident memory ``rss_mb`` (taken between rounds, with
    the model, tokenizer and data loaded) less the weights it holds then, every block in its
    frozen form. The imports, libraries and allocator behind it differ from machine to
    machine (505 MB here, 602 MB on the CI machine, for the same code), so a node does not
    rely on :data:`RUNTIME_MB`."""
    return rss_mb - weights_mb(shape, blocks, None, precision)


def fitting_rule(*args: Any, **kwargs: Any) -> str | None:
    """The rule of :func:`fitting_rule_options` (same arguments): ``preferred`` if it fits
    ``budget_mb``, else the first rule in :data:`RULE_ORDER` after it (after ``preferred`` not
    in that order, such as a plug-in rule: all of it) that fits; ``None`` when nothing fits."""
    fit = fitting_rule_options(*args, **kwargs)
    return None if fit is None else fit[0]


def fallback_order(preferred: str, allowed: Sequence[str] | None = None) -> list[str]:
    """The rules a memory budget tries, in order: ``preferred``, then those after it in
    :data:`RULE_ORDER` (after a rule not in that order, such as a plug-in rule: all of it),
    less those not in ``allowed`` (when given)."""
    order = [preferred] + [r for r in RULE_ORDER if r != preferred]
    if preferred in RULE_ORDER:
        order = list(RULE_ORDER[RULE_ORDER.index(preferred):])
    return order if allowed is None else [r for r in order if r in allowed]


def fitting_rule_options(
    shape: ModelShape,
    blocks: BlockMap,
    block: str,
    budget_mb: float,
    batch_size: int,
    seq_len: int,
    preferred: str,
    precision: Precision | None = None,
    options: Mapping[str, Any] | None = None,
    scored_tokens: int | None = None,
    runtime_mb: float = RUNTIME_MB,
    allowed: Sequence[str] | None = None,
) -> tuple[str, dict[str, Any]] | None:
    """The rule that fits ``budget_mb`` and the options it fits at: ``preferred`` if it fits,
    else the first rule in :data:`RULE_ORDER` after it (after ``preferred`` not in that order,
    such as a plug-in rule: all of it) that fits; ``None`` when nothing fits. A budget of 0
    means "no budget declared". Each rule is tried at the run's options, then with
    :data:`LEAN_OPTIONS` over them (a rule that trades speed for memory, e.g. the zeroth-order
    step cache, is tried without it before the next, smaller rule). ``allowed``: the rules the
    node can train with (e.g. those with a block program); the others are passed over."""
    run_options = dict(options or {})
    if budget_mb <= 0:
        return preferred, run_options
    for rule in fallback_order(preferred, allowed):
        for tried in (run_options, {**run_options, **LEAN_OPTIONS}):
            if estimate_peak_mb(shape, blocks, rule, block, batch_size, seq_len, precision,
                                tried, scored_tokens, runtime_mb) <= budget_mb:
                return rule, tried
    return None
