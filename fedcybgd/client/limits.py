"""What a node lets a server ask of it, checked before the work it bounds.

A server's instruction, and the run config it started the run with, are untrusted: a hostile
server could ask a node for a million training steps, a learning rate of ``1e30``, or step logs
whose replay costs minutes. Each such demand is capped by a key of the node's own
``--node-config`` (:class:`fedcybgd.config.NodeConfig`, where the defaults live):

================== ===========================================================================
``max-local-steps`` training steps of a round (run config ``local-steps``) and the steps the
                    instruction's ``local-steps`` lets one downloaded step log hold
``max-lr``          the round's learning rate (instruction ``lr``, else run config ``lr``)
``max-batch-size``  rows of one training batch (run config ``batch-size``), and of the
                    activations a pipeline stage takes
``max-micro-batches`` micro-batches of one pipeline stage message (run config
                    ``micro-batches``)
``max-row-tokens``  tokens of one row of a pipeline stage (run config ``max-seq-len``), and so
                    of the activations it takes
``max-activation-mb`` bytes of the activations (or gradients) one pipeline stage message
                    carries, all micro-batches together
``max-replay-steps`` steps replayed from all of one instruction's step-log downloads
``max-replay-logs`` step logs (the chains' length) of one instruction's step-log downloads
``max-download-mb`` payload bytes of one instruction's downloads, all records together
``max-decoded-mb``  bytes the tensors of one downloaded block decode to
``max-chain-mb``    bytes all of one instruction's chained install deltas decode to
``dp-min-noise-multiplier`` the least noise the node's upload carries (run config ``dp`` and
                    ``dp-noise-multiplier``)
``dp-max-clip-norm`` the largest clip of node-side DP (run config ``dp-clip-norm``)
================== ===========================================================================

Beyond a limit the node does none of the work and answers ``refused``
(:data:`fedcybgd.protocol.REFUSED`) with a :class:`Refusal` naming the instruction or run-config
field, the value asked and the node's limit. The checks read only sizes, counts and headers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from flwr.app import ArrayRecord

from fedcybgd.compression.header import PayloadHeader
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.core.measure import CgroupMemory

MB = 2**20
log = logging.getLogger(__name__)


class Refusal(ValueError):
    """An instruction this node does not carry out: malformed, or beyond one of its limits.

    The message names the field, the value asked and, for a limit, the node-config key.
    """


def beyond(field: str, asked: object, key: str, limit: object) -> Refusal:
    """The refusal of ``field`` = ``asked`` over the node's ``key`` = ``limit``."""
    return Refusal(f"{field} = {asked} is beyond this node's limit {key} = {limit} "
                   "(node config)")


def check_training(run: RunConfig, node: NodeConfig, lr: float | None = None,
                   local_steps: int | None = None) -> float:
    """Check the round's training work against the node's limits; returns the learning rate.

    Parameters
    ----------
    run : RunConfig
        The run config (the server's too): ``local-steps``, ``batch-size``, ``lr``.
    node : NodeConfig
        The node's limits.
    lr : float, optional
        The instruction's ``lr`` (the server's schedule); ``None``: the run config's is used.
    local_steps : int, optional
        The instruction's ``local-steps`` (what one downloaded step log may hold).

    Raises
    ------
    Refusal
        A value beyond its limit, named.
    """
    if local_steps is not None and local_steps > node.max_local_steps:
        raise beyond("instruction field 'local-steps'", local_steps, "max-local-steps",
                     node.max_local_steps)
    if run.local_steps > node.max_local_steps:
        raise beyond("run-config 'local-steps'", run.local_steps, "max-local-steps",
                     node.max_local_steps)
    if run.batch_size > node.max_batch_size:
        raise beyond("run-config 'batch-size'", run.batch_size, "max-batch-size",
                     node.max_batch_size)
    field, rate = ("instruction field 'lr'", lr) if lr is not None else ("run-config 'lr'", run.lr)
    if rate > node.max_lr:
        raise beyond(field, f"{rate:g}", "max-lr", f"{node.max_lr:g}")
    return rate


def check_privacy(run: RunConfig, node: NodeConfig) -> None:
    """Refuse a round whose upload would carry less privacy than the node's own floor: the
    server's run config chooses ``dp`` and its settings, and a hostile one would choose none.

    Raises
    ------
    Refusal
        ``dp`` leaves the noise to the server (or off) while the node asks for a minimum, a
        noise multiplier below ``dp-min-noise-multiplier``, or a clip above
        ``dp-max-clip-norm``, named.
    """
    floor = node.dp_min_noise_multiplier
    node_side = run.dp in ("local", "example")
    if floor and not node_side:
        raise Refusal(f"run-config 'dp' = {run.dp!r} leaves this node's upload without its own "
                      f"noise, below its dp-min-noise-multiplier = {floor:g} (node config): "
                      "it takes part only under dp = 'local' or 'example'")
    if floor and run.dp_noise_multiplier < floor:
        raise Refusal(f"run-config 'dp-noise-multiplier' = {run.dp_noise_multiplier:g} is below "
                      f"this node's dp-min-noise-multiplier = {floor:g} (node config)")
    if node_side and node.dp_max_clip_norm and run.dp_clip_norm > node.dp_max_clip_norm:
        raise beyond("run-config 'dp-clip-norm'", f"{run.dp_clip_norm:g}", "dp-max-clip-norm",
                     f"{node.dp_max_clip_norm:g}")


def check_download_bytes(records: Mapping[str, ArrayRecord], node: NodeConfig) -> int:
    """The payload bytes of ``records`` (record name -> block -> payload Array), refused over
    ``max-download-mb`` before any is read; returns the total."""
    total = sum(len(array.data) for record in records.values() for array in record.values())
    if total > node.max_download_mb * MB:
        names = " + ".join(f"'{name}'" for name, record in records.items() if len(record))
        raise beyond(f"instruction records {names}", f"{total / MB:.1f} MB", "max-download-mb",
                     node.max_download_mb)
    return total


def check_decoded(record: str, block: str, header: PayloadHeader, node: NodeConfig) -> None:
    """Refuse a payload whose tensors (or decompressed body) would exceed ``max-decoded-mb``;
    ``header`` is the payload's, read without decoding."""
    size = max(header.decoded_bytes, header.raw_body_length)
    if size > node.max_decoded_mb * MB:
        raise beyond(f"instruction record '{record}' block '{block}' (decoded)",
                     f"{size / MB:.1f} MB", "max-decoded-mb", node.max_decoded_mb)


def check_chain_decoded(total: int, node: NodeConfig) -> None:
    """Refuse chained install deltas (record ``download-chain``) as soon as what those read so
    far decode to exceeds ``max-chain-mb`` (the node's work applying them)."""
    if total > node.max_chain_mb * MB:
        raise beyond("instruction record 'download-chain' (decoded, all deltas)",
                     f"at least {total / MB:.1f} MB", "max-chain-mb", node.max_chain_mb)


def check_replay_logs(count: int, node: NodeConfig) -> None:
    """Refuse step-log downloads holding more than ``max-replay-logs`` logs in all."""
    if count > node.max_replay_logs:
        raise beyond("instruction record 'download-logs' (step logs)", count,
                     "max-replay-logs", node.max_replay_logs)


def check_replay_steps(counted: int, node: NodeConfig) -> None:
    """Refuse step-log downloads as soon as the steps counted so far exceed
    ``max-replay-steps`` (the logs not yet counted are not read)."""
    if counted > node.max_replay_steps:
        raise beyond("instruction record 'download-logs' (steps to replay)",
                     f"at least {counted}", "max-replay-steps", node.max_replay_steps)


def check_pipeline(run: RunConfig, node: NodeConfig) -> None:
    """Check a pipeline stage's work (``strategy = "pipeline"``) against the node's limits,
    beyond :func:`check_training`'s: the micro-batches of one message, the tokens of a row, and
    AdamW's weight decay, which at ``lr x weight-decay`` above 1 would flip and grow the
    weights every step whatever the rate's limit.

    Raises
    ------
    Refusal
        A value beyond its limit, named.
    """
    if run.pipeline.micro_batches > node.max_micro_batches:
        raise beyond("run-config 'micro-batches'", run.pipeline.micro_batches, "max-micro-batches",
                     node.max_micro_batches)
    if run.max_seq_len > node.max_row_tokens:
        raise beyond("run-config 'max-seq-len'", run.max_seq_len, "max-row-tokens",
                     node.max_row_tokens)
    if run.lr * run.weight_decay > 1:
        raise Refusal(f"run-config 'lr' x 'weight-decay' = {run.lr:g} x {run.weight_decay:g} "
                      "is above 1: AdamW's decay would scale the weights by "
                      f"{1 - run.lr * run.weight_decay:g} every step")


def check_activation_bytes(total: int, node: NodeConfig) -> None:
    """Refuse a pipeline stage message whose activations (or gradients) take ``total`` bytes,
    all micro-batches together, over ``max-activation-mb``; read before any is decoded."""
    if total > node.max_activation_mb * MB:
        raise beyond("instruction record 'activations'", f"{total / MB:.2f} MB",
                     "max-activation-mb", f"{node.max_activation_mb:g}")


def enforced_budget(node: NodeConfig, cgroup: CgroupMemory | None) -> NodeConfig:
    """``node`` with its memory budget lowered to what the operating system lets it use.

    A node in a container (or a systemd unit) with a hard memory limit would be killed mid-round
    by the kernel if it trained a rule the limit cannot hold. The room under the limit (less what
    the rest of the group holds: the SuperNode process) caps ``memory-budget-mb``, or becomes
    it where none was given, so the budget check picks a rule that fits or declines the round.
    """
    if cgroup is None:
        return node
    room = max(cgroup.room_mb(), 1.0)
    if node.memory_budget_mb and node.memory_budget_mb <= room:
        return node
    log.info("memory limit %.0f MB (%.0f MB held beside this process): budget %.0f MB",
             cgroup.limit_bytes / MB, cgroup.others_bytes / MB, room)
    return dataclasses.replace(node, memory_budget_mb=round(room, 1))
