"""Node-to-block matching: which sampled node trains which block, with which update rule.

Each block of the round goes to ``per_block`` nodes. Without memory budgets the nodes take the
blocks in sampling order and every node gets the run's rule. With budgets (nodes declare them
in their replies) the roomiest nodes take the blocks the preferred rule finds most expensive
(the lowest layers, for ``fo``: backprop runs through every layer above), and each node gets
the first rule that fits its budget; a node that fits nothing sits the round out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

# (preferred rule, block, budget MB) -> a rule that fits, or None
RuleForBudget = Callable[[str, str, float], "str | None"]


class Assignment(NamedTuple):
    """One node's part in a round."""

    node: int
    block: str
    rule: str


def match(
    nodes: list[int],
    blocks: list[str],
    *,
    per_block: int,
    rule: str,
    budgets: Mapping[int, float] | None = None,
    rule_for_budget: RuleForBudget | None = None,
    lowest_layer_of: Callable[[str], int] | None = None,
) -> list[Assignment]:
    """Pair ``nodes`` with ``blocks`` (``per_block`` nodes each) and pick each node's rule.

    Parameters
    ----------
    nodes, blocks : list
        The round's sampled nodes (in sampling order) and blocks; ``len(nodes)`` is at most
        ``per_block * len(blocks)``.
    per_block : int
        Nodes sharing one block.
    rule : str
        The run's update rule.
    budgets : Mapping[int, float], optional
        Node -> declared memory budget (MB); a node without one has room for anything.
    rule_for_budget : RuleForBudget, optional
        Picks a fitting rule; without it (or without any budget among ``nodes``) budgets are
        ignored.
    lowest_layer_of : Callable[[str], int], optional
        A block's first layer (e.g. :meth:`fedcybgd.model.blocks.BlockMap.lowest_layer_of`), to
        order blocks by cost; required with budgets.
    """
    budgets = budgets or {}
    if rule_for_budget is None or not any(n in budgets for n in nodes):
        return [Assignment(node, blocks[i // per_block], rule) for i, node in enumerate(nodes)]
    if lowest_layer_of is None:
        raise ValueError("matching by memory budget needs lowest_layer_of to order the blocks")
    roomy = sorted(nodes, key=lambda n: -budgets.get(n, math.inf))
    ordered = sorted(blocks, key=lowest_layer_of)
    pairs = []
    for i, node in enumerate(roomy):
        block = ordered[i // per_block]
        budget = budgets.get(node, 0.0)
        fitting = rule_for_budget(rule, block, budget) if budget else rule
        if fitting is not None:
            pairs.append(Assignment(node, block, fitting))
    return pairs
