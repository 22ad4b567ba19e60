"""The update rules a node trains through its block programs (node config
``trainer = "executorch"``), and what the programs do not cover.

``fo`` runs through the block's training step (:mod:`fedcybgd.client.updates.fo_program`),
``lezo`` and ``mezo`` through its forward program (:mod:`fedcybgd.client.updates.zo_program`).
What the programs do not cover is refused before the round trains, by name (:func:`unsupported`):
another rule, a task other than ``lm``, example-level DP, frozen blocks held in another
precision, a device other than the CPU, ``fo-recompute``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcybgd.core.registry import Registry

if TYPE_CHECKING:
    from fedcybgd.client.updates.fo_program import NodePrograms

__all__ = ["PROGRAM_RULES", "unsupported"]

# The update rules a node trains through a block program, by name: their program classes.
PROGRAM_RULES: Registry[type[NodePrograms]] = Registry("update rule through a block program",
                                                       "update-rule")
PROGRAM_RULES.add_lazy("fo", "fedcybgd.client.updates.fo_program:ProgramFirstOrder")
PROGRAM_RULES.add_lazy("lezo", "fedcybgd.client.updates.zo_program:ProgramLeZO")
PROGRAM_RULES.add_lazy("mezo", "fedcybgd.client.updates.zo_program:ProgramMeZO")


def unsupported(rule: str, task_kind: str, example_dp: bool, frozen: str, device: str,
                recompute: bool) -> str | None:
    """Why a round cannot train through the ExecuTorch program, or ``None`` when it can."""
    if rule not in PROGRAM_RULES.names():
        return (f"update rule {rule!r} (the ExecuTorch trainer runs "
                f"{', '.join(map(repr, PROGRAM_RULES.names()))})")
    if task_kind != "lm":
        return f"task {task_kind!r} (the block programs carry the `lm` task's loss)"
    if example_dp:
        return "dp = 'example' (per-example clipping is not in the program)"
    if frozen != "float32":
        return f"frozen blocks held as {frozen} (the program reads fp32 weights)"
    if device != "cpu":
        return f"device {device!r} (the ExecuTorch trainer runs on the CPU)"
    if recompute:
        return "fo-recompute (the program keeps its own activations)"
    return None
