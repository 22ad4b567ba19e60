"""Pipeline mode's cut, which the server and every stage must agree on: decoder layers
``0..L-1`` in K contiguous chunks of equal size, the remainder going to the lowest."""

from __future__ import annotations


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``[a, b)`` decoder layers of each of ``stages`` stages."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"stages must be in 1..{num_layers} (the decoder layers), got {stages}")
    base, extra = divmod(num_layers, stages)
    cut, at = [], 0
    for k in range(stages):
        size = base + (1 if k < extra else 0)
        cut.append((at, at + size))
        at += size
    return cut
