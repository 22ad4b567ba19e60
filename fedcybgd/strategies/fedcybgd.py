"""FedCyBGD: federated cycle block gradient descent as a Flower Message-API strategy.

Each round, ``clients-per-round`` nodes are sampled (in node-key order, see
:mod:`~fedcybgd.strategies.node_keys`) and ``clients-per-round / clients-per-block`` distinct
blocks are taken from the schedule (:mod:`~fedcybgd.strategies.schedule`); every block goes to
``clients-per-block`` nodes (:mod:`~fedcybgd.strategies.matching`), which train only it and
upload only it. Each node downloads only the blocks whose version it lacks
(:mod:`~fedcybgd.strategies.downloads`). Replies pass the gate
(:mod:`~fedcybgd.strategies.reader`) and the update screen; the uploads of one block are merged
(:mod:`~fedcybgd.strategies.aggregate`), the server takes its step and installs the block at a
new version (:mod:`~fedcybgd.strategies.versions`). Distinct blocks train in parallel (a Jacobi
step over disjoint blocks). A block that brought no update goes back to the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcybgd import protocol
from fedcybgd.config import RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.blocks import BlockMap
from fedcybgd.protocol import PRIVACY_BUDGET, SEEDLOG
from fedcybgd.protocol.message_size import message_bytes
from fedcybgd.protocol.prior import ClassPriorSpec, with_class_prior
from fedcybgd.strategies.aggregate import Aggregator
from fedcybgd.strategies.checkpoint_entries import checkpoint_entries, restore_entry
from fedcybgd.strategies.downloads import PayloadCache
from fedcybgd.strategies.installing import Admitted
from fedcybgd.strategies.instructions import RunTerms, train_message
from fedcybgd.strategies.lr_schedule import build_lr_schedule
from fedcybgd.strategies.matching import Assignment, RuleForBudget, match
from fedcybgd.strategies.parts import assemble
from fedcybgd.strategies.record import RoundInFlight, RoundRecord
from fedcybgd.strategies.replies import NO_REPLY, DropLog, Dropped, guarded
from fedcybgd.strategies.schedule import Schedule
from fedcybgd.strategies.versions import Tensors

log = logging.getLogger(__name__)
# The app's defaults (the run config's; no other place keeps them): a strategy built in code
# with no config runs the algorithm `flwr run` runs with no overrides.
_RUN = RunConfig()


class FedCyBGD(Strategy):
    """Cycle block gradient descent over Flower nodes.

    The strategy is its parts, each built from its section of the run config (the one place
    defaults live, :class:`fedcybgd.config.RunConfig`): ``FedCyBGD(block_map=...,
    weights=...)`` runs the algorithm ``flwr run`` runs with no overrides, and
    :meth:`from_config` what a given run config describes.

    Parameters
    ----------
    block_map, weights
        The model's blocks, and its weights by parameter name (updated in place, so a model's
        own parameters stay current).
    config : RunConfig
        The settings; its sections go to the parts (:attr:`RunConfig.cohort`, ``codecs``,
        ``robust``, ``server_step``, ``privacy``).
    cycle
        Blocks to train, in model order (default: the layer blocks, as the config's
        ``train-embeddings`` and ``train-head`` say).
    schedule, aggregate
        Objects in place of the config's named ones: any
        :class:`~fedcybgd.strategies.schedule.Schedule` (one with ``observe(block,
        update_rms)`` is told each installed block's step size); any callable ``[(examples,
        tensors), ...] -> tensors`` merging one block's uploads.
    pretrained, rule_for_budget
        A block's pretrained tensors (without it, copies are kept); ``(rule, block, MB) ->
        rule or None`` for nodes that report a memory budget.
    client_lr
        ``round -> client lr`` (``None``: the nodes' own run-config ``lr``).
    class_prior, classes
        The class shares the nodes' training aims at (:mod:`fedcybgd.protocol.prior`) for a
        task of ``classes`` classes; ``None`` or ``classes < 2``: none sent (equal).
    device : str
        Where step logs are replayed (the global weights stay on the CPU).
    lineage, base_hash
        This model's history and its base's hash (default: the weights' checksum).
    return_arrays : bool
        Return the global weights from :meth:`aggregate_train` (``Strategy.start`` needs it).
    """

    def __init__(
        self,
        *,
        block_map: BlockMap,
        weights: Mapping[str, torch.Tensor],
        config: RunConfig = _RUN,
        cycle: list[str] | None = None,
        schedule: Schedule | None = None,
        aggregate: Aggregator | None = None,
        pretrained: Callable[[str], Tensors] | None = None,
        rule_for_budget: RuleForBudget | None = None,
        client_lr: Callable[[int], float] | None = None,
        class_prior: ClassPriorSpec | None = None,
        classes: int = 0,
        device: str = "cpu",
        lineage: str = "default",
        base_hash: str = "",
        return_arrays: bool = True,
    ) -> None:
        self.block_map, self.weights = block_map, dict(weights)
        parts = self.parts = assemble(config, block_map, self.weights, cycle=cycle,
                                      schedule=schedule, aggregate=aggregate,
                                      pretrained=pretrained, device=device)
        self.cohort, self.codecs, self.robust = config.cohort, config.codecs, config.robust
        self.cycle, self.schedule, self.blocks, self.nodes = (
            parts.cycle, parts.schedule, parts.blocks, parts.nodes)
        self.sampler, self.downloads, self.budget, self.reader = (
            parts.sampler, parts.downloads, parts.budget, parts.reader)
        self.screen, self.step, self.aggregate, self.installer = (
            parts.screen, parts.step, parts.aggregate, parts.installer)
        self.dp_policy, self.noise_key = parts.privacy, parts.privacy.noise_key
        self.zo, self.self_sync = parts.zo, parts.self_sync
        self.rule_for_budget, self.client_lr = rule_for_budget, client_lr
        self.lineage, self.base_hash = lineage, base_hash or content_checksum(weights)
        self.return_arrays, self.device = return_arrays, device
        self.class_prior, self.classes = class_prior, classes
        self.history: list[RoundRecord] = []
        self.round: RoundInFlight | None = None
        self.done_through = 0  # rounds a checkpoint restored: asked again, nothing is sent

    @classmethod
    def from_config(cls, run: RunConfig, block_map: BlockMap,
                    weights: Mapping[str, torch.Tensor], **objects: Any) -> FedCyBGD:
        """The strategy ``run`` describes, its client lr the run's ``lr-schedule``: a
        ServerApp of one's own runs what ``flwr run`` runs. ``objects`` are the constructor's
        other keyword arguments (``schedule=``, ``aggregate=``, ``pretrained=``, ...)."""
        objects.setdefault("client_lr", build_lr_schedule(
            run.lr_schedule, run.lr, run.num_server_rounds, run.warmup_rounds))
        return cls(block_map=block_map, weights=weights, config=run, **objects)

    def settings(self) -> dict[str, Any]:
        """The settings in effect, by run-config key (what two strategies are compared by)."""
        return {**self.parts.settings(), "client-lr": None if self.client_lr is None else
                [self.client_lr(r) for r in (1, 2, 10)]}

    # What tests and the ServerApp read directly.
    versions = property(lambda self: self.blocks.versions, doc="Block -> version (round).")
    checksums = property(lambda self: self.blocks.checksums, doc="Block -> its checksum.")
    holdings = property(lambda self: self.nodes.holdings, doc="Node -> blocks it holds.")
    budgets = property(lambda self: self.nodes.budgets, doc="Node -> memory budget (MB).")
    excluded = property(lambda self: self.nodes.excluded, doc="Node -> why it sits out.")

    @property
    def node_wait_s(self) -> float:
        """Seconds to wait for nodes (``node-wait``; settable, e.g. by a test rig)."""
        return self.cohort.node_wait_s

    @node_wait_s.setter
    def node_wait_s(self, seconds: float) -> None:
        self.cohort = dataclasses.replace(self.cohort, node_wait_s=seconds)

    def block_tensors(self, block: str) -> Tensors:
        """The global tensors of ``block`` (views, not copies)."""
        return self.blocks.tensors(block)

    def checkpoint_tensors(self) -> dict[str, tuple[int, Tensors]]:
        """What a checkpoint saves as tensors
        (:func:`~fedcybgd.strategies.checkpoint_entries.checkpoint_entries`)."""
        return checkpoint_entries(self.blocks, self.step)

    def install_checkpoint(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put a checkpointed entry of :meth:`checkpoint_tensors` back (before
        :meth:`load_state`)."""
        restore_entry(self.blocks, self.step, block, tensors)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node: its block, rule, seed and download."""
        if server_round <= self.done_through:
            log.info("round %d: restored from the checkpoint; nothing to send", server_round)
            return []
        if len(arrays) and (self.round is None or arrays is not self.round.returned):
            self.blocks.load_weights(arrays.to_torch_state_dict())  # e.g. Strategy.start's
        cohort = self.cohort
        try:
            nodes = self.sampler.sample(grid, server_round, count=cohort.clients_per_round,
                                        per_block=cohort.clients_per_block,
                                        excluded=self.nodes.excluded, wait_s=self.node_wait_s)
        except RuntimeError as short:
            # dp = "example": nodes that declined on their own budgets end the run
            if not self.dp_policy.declined(str(short), self.nodes.excluded, PRIVACY_BUDGET):
                raise
            return self._no_more_rounds(server_round)
        if self.class_prior is not None:  # after sampling: the new nodes' counts are known
            config = with_class_prior(config, self.class_prior, self.classes,
                                      self.sampler.keys.class_counts)
        if not self.dp_policy.allows(server_round, nodes, self.sampler.population):
            return self._no_more_rounds(server_round)
        clip = self.dp_policy.round_clip(self.aggregate)  # an adaptive clip: this round's
        if clip is not None:  # the nodes' clip, the screen's bound (the merge's noise is set)
            bound = self.robust.max_update_norm
            self.screen.max_norm = min(bound, clip) if bound else clip
            config = ConfigRecord({**dict(config), protocol.DP_CLIP: float(clip)})
        blocks = self.schedule.take(len(nodes) // cohort.clients_per_block)
        nodes = nodes[: len(blocks) * cohort.clients_per_block]
        pairs = match(nodes, blocks, per_block=cohort.clients_per_block, rule=cohort.update_rule,
                      budgets=self.nodes.budgets, rule_for_budget=self.rule_for_budget,
                      lowest_layer_of=self.block_map.lowest_layer_of)
        record = RoundRecord.training(server_round, cohort.update_rule)
        record.blocks, record.clients = list(blocks), [a.node for a in pairs]
        live = self.round = RoundInFlight(record, pairs)
        payloads: PayloadCache = {}
        lr = None if self.client_lr is None else self.client_lr(server_round)
        for assignment in pairs:
            live.sent.append(self._instruction(live, assignment, config, lr, payloads))
            record.wire_bytes_down += message_bytes(live.sent[-1])
        for block in blocks:
            if block not in live.awaiting.values():
                log.info("round %d: no sampled node can fit block %s; re-queued",
                         server_round, block)
        return live.sent

    def _instruction(self, live: RoundInFlight, assignment: Assignment, config: ConfigRecord,
                     lr: float | None, payloads: PayloadCache) -> Message:
        """The training message of one node: its block, seed, download and upload codec."""
        server_round, record = live.record.round, live.record
        node, block = assignment.node, assignment.block
        live.awaiting[node] = block
        retries = self.installer.retry_seeds
        retry = retries.pop(block, None) if self.cohort.clients_per_block == 1 else None
        seed = live.seeds[node] = (retry if retry is not None
                                   else self.sampler.seed_of(server_round, node))
        held = self.nodes.holdings.get(node, {})
        terms = RunTerms(self.lineage, self.base_hash, self.codecs.upload_codec,
                         self.cohort.local_steps, self.codecs.seedlog_fallback, self.device,
                         self.self_sync)
        if self.budget is None:
            down = self.downloads.plan(server_round, node, block, held, payloads)
        else:
            choice = self.budget.choose(server_round, node, block, held, payloads)
            down, live.upload_codecs[node] = choice.download, choice.upload_codec
            terms = dataclasses.replace(terms, upload_codec=choice.upload_codec)
            record.count_traffic_level(node, choice.level, choice.fits)
        record.bytes_down += down.bytes
        record.bytes_down_raw += down.raw_bytes
        return train_message(server_round, assignment, seed, down, terms, config, lr,
                             self.nodes.promised.get(node))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Admit each upload through the gate, merge each block's, install, re-queue the rest.

        No reply can end the round: whatever goes wrong reading one is a drop, counted by
        reason in the round's ``dropped``.
        """
        live = self.round
        if server_round <= self.done_through or (live is not None and not live.sent
                                                 and self.privacy_stop is not None):
            return None, None  # a restored round; the round the privacy budget refused
        if live is None or live.record.round != server_round:
            raise RuntimeError(f"aggregate_train({server_round}) without its configure_train")
        record, drops = live.record, DropLog(server_round)
        arrived: list[tuple[str, Admitted]] = []
        # Replies are matched to this round's instructions by message id: an error reply made
        # by the SuperLink (e.g. the node died) comes from the SuperLink's own id, and a late
        # reply to an earlier round must not pass for this round's upload.
        by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in live.sent}
        for reply in replies:
            record.wire_bytes_up += message_bytes(reply)  # late or forged ones came too
            node = by_id.get(reply.metadata.reply_to_message_id)
            block = live.awaiting.pop(node, None) if node is not None else None
            if node is None or block is None:
                log.warning("round %d: ignored a reply from node %d that answers no open "
                            "instruction of this round (late, duplicate or forged)",
                            server_round, reply.metadata.src_node_id)
                continue
            asked = live.upload_codecs.get(node, self.codecs.upload_codec)
            try:
                got = guarded(functools.partial(self.reader.read, reply, node, block, record,
                                                asked))
                got.tensors, rms = guarded(functools.partial(
                    self.screen.admit, block, self.blocks.tensors(block), got.tensors))
            except Dropped as drop:
                drops.add(node, f"upload of block {block}", drop)
                continue
            if self.budget is not None:
                # a step log counts as one; weights sent instead of an asked-for log as the
                # fallback codec they came through
                codec = (SEEDLOG if got.kind == SEEDLOG
                         else self.codecs.seedlog_fallback if asked == SEEDLOG else asked)
                self.budget.observe(codec, got.payload_bytes, self.block_map.info(block).numel)
            arrived.append((block, (node, got, rms)))
        for node, block in live.awaiting.items():
            drops.add(node, f"upload of block {block}", Dropped(NO_REPLY, "timeout or lost"))
        live.awaiting = {}
        self.installer.close(live, arrived, drops)
        self.dp_policy.account(record.extra, [got.metrics for _, (_, got, _) in arrived],
                               protocol.DP_UNCLIPPED, bool(live.sent))
        self.history.append(record)
        if not record.accepted or not self.return_arrays:
            return None, record.to_metric_record()
        live.returned = ArrayRecord({k: v.detach().clone() for k, v in self.weights.items()})
        return live.returned, record.to_metric_record()

    def _no_more_rounds(self, server_round: int) -> list[Message]:
        """The differential-privacy budget ends the run (:attr:`privacy_stop` says why): an
        empty round, no instructions."""
        log.warning("privacy budget: %s; no more rounds", self.privacy_stop)
        self.round = RoundInFlight(RoundRecord.training(server_round, self.cohort.update_rule), [])
        return []

    @property
    def privacy_stop(self) -> str | None:
        """Why the privacy budget ended the run, once it has."""
        return self.dp_policy.stop

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model itself."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    def summary(self) -> None:
        """Log the strategy's settings."""
        log.info("FedCyBGD: %d blocks in the cycle (%s), %d clients/round, %d clients/block, "
                 "rule %s, upload %s, download %s", len(self.cycle),
                 getattr(self.schedule, "order", type(self.schedule).__name__),
                 self.cohort.clients_per_round, self.cohort.clients_per_block,
                 self.cohort.update_rule, self.codecs.upload_codec, self.downloads.download_codec)

    def state(self) -> dict[str, Any]:
        """JSON-able state (weights are saved separately, per block)."""
        return self.parts.state()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output (weights must be restored by the caller)."""
        self.parts.load_state(state)
