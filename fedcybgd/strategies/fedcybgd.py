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
import inspect
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
from fedcybgd.protocol import PRIVACY_BUDGET, SEEDLOG, zeroth_order
from fedcybgd.protocol.message_size import message_bytes
from fedcybgd.protocol.prior import ClassPriorSpec, with_class_prior
from fedcybgd.strategies.aggregate import Aggregator, build_aggregator
from fedcybgd.strategies.downloads import DownloadPlanner, PayloadCache
from fedcybgd.strategies.installing import Admitted, BlockInstaller
from fedcybgd.strategies.instructions import RunTerms, train_message
from fedcybgd.strategies.lr_schedule import build_lr_schedule
from fedcybgd.strategies.matching import RuleForBudget, match
from fedcybgd.strategies.privacy import PrivacyPolicy
from fedcybgd.strategies.quantized_install import QuantizedInstall
from fedcybgd.strategies.reader import NodeBook, ReplyReader
from fedcybgd.strategies.record import RoundInFlight, RoundRecord
from fedcybgd.strategies.replies import NO_REPLY, DropLog, Dropped, guarded
from fedcybgd.strategies.sampling import NodeSampler
from fedcybgd.strategies.schedule import Schedule, build_schedule
from fedcybgd.strategies.screen import UpdateScreen
from fedcybgd.strategies.server_step import ServerStep
from fedcybgd.strategies.traffic_budget import TrafficBudget
from fedcybgd.strategies.versions import BlockVersions, Tensors

log = logging.getLogger(__name__)
# The app's defaults (the run config's; no other place keeps them): a strategy built in code
# with no arguments runs the algorithm `flwr run` runs with no overrides.
_RUN = RunConfig()
SERVER_STATE = "server-opt."  # checkpoint entries of the server optimizer's per-block state
INSTALL_PAYLOAD = "install-via."  # ... and of the delta a block was installed through


class FedCyBGD(Strategy):
    """Cycle block gradient descent over Flower nodes.

    Every setting's default is the run config's (:class:`fedcybgd.config.RunConfig`, the one
    place defaults live), so ``FedCyBGD(block_map=..., weights=...)`` runs the algorithm that
    ``flwr run`` runs with no overrides; :meth:`from_config` builds it from a whole run config.

    Parameters
    ----------
    block_map, weights
        The model's blocks, and its weights by parameter name (updated in place, so a model's
        own parameters stay current).
    cycle, block_schedule, schedule
        Blocks to train, in model order (default: the layer blocks, as the run config's
        ``train-embeddings`` and ``train-head``); the name of their order (a registered
        schedule); or any :class:`~fedcybgd.strategies.schedule.Schedule` object instead (one
        with ``observe(block, update_rms)`` is told each installed block's step size).
    clients_per_round, clients_per_block, update_rule
        Nodes per round, nodes sharing (and merging) one block (0: all of the round's, as
        the run config's ``clients-per-block``), the rule they are asked to use.
    upload_codec, download_codec, exact_codec, seedlog_fallback : str
        Codec specs: uploads (``"seedlog"``: zeroth-order step logs, replayed here; others use
        ``seedlog_fallback``), frozen downloads (may be lossy; ``"seedlog"``, with seed-log
        uploads only: blocks made from step logs alone go to nodes that can replay them as
        those logs, :mod:`fedcybgd.protocol.seedsync`, others as ``seedlog_fallback``), the trained
        block (lossless).
    seedlog_max_replay : float
        Most replay work, in passes over a block, a seed-log download may cost a node; a
        costlier chain goes as weights (0: no cap).
    download_fraction, max_staleness, traffic_budget_mb, install_codec, version_history
        Random dropping of frozen downloads; installs a node's frozen copy may lag before it is
        sent; payload MB per client-round each node's traffic level must fit (0: no budget;
        :mod:`~fedcybgd.strategies.traffic_budget`); ``"none"`` or the lossy delta codec each
        installed block is rounded to (:mod:`~fedcybgd.strategies.quantized_install`); past
        exact versions kept as delta bases.
    install_chain
        Installs per block whose deltas are kept to be sent one after another to a node that
        missed them (:meth:`~fedcybgd.strategies.versions.BlockVersions.install_chain`).
    pretrained, rule_for_budget
        A block's pretrained tensors (without it, copies are kept); ``(rule, block, MB) ->
        rule or None`` for nodes that report a memory budget.
    seed, lineage, base_hash
        Seeds sampling, order and client seeds; this model history and its base's hash.
    max_payload_bytes, node_wait_s, local_steps, batch_size
        Upload bound; wait for nodes; a round's steps (bounds step logs) and batch size
        (``num-examples`` counts at most ``local_steps * batch_size``).
    aggregate, trim_fraction
        Merges one block's uploads: a registered name (``mean`` weighted by examples,
        ``median``, ``trimmed-mean``, plug-ins') or any callable
        ``[(examples, tensors), ...] -> tensors``.
    max_update_norm, outlier_factor, max_update_ratio, client_lr
        :class:`~fedcybgd.strategies.screen.UpdateScreen` (its ``max_norm``, ``outlier_factor``
        and ``max_ratio``); ``round -> client lr``.
    server_lr, parallel_damping, server_optimizer, server_beta1, server_beta2, server_eps
        :class:`~fedcybgd.strategies.server_step.ServerStep` (its state per block is
        checkpointed through :meth:`checkpoint_tensors`).
    class_prior, classes
        The class shares the nodes' training aims at (:mod:`fedcybgd.protocol.prior`;
        ``global`` pools the counts nodes state in their node-key answers) for a task of ``classes``
        classes; sent with every instruction. ``None`` or ``classes < 2``: none sent (equal).
    self_sync : bool
        A node that trained a block alone keeps its decoded upload and, when the installed block
        is what it can compute from it (``sgd`` server step, no clipping: checked here by
        checksum), holds that version without it being sent (:mod:`fedcybgd.protocol.selfsync`).
    return_arrays : bool
        Return the global weights from :meth:`aggregate_train` (``Strategy.start`` needs it).
    device : str
        Where step logs are replayed (a torch device name; the global weights stay on the CPU).
    dp, dp_clip_norm, dp_noise_multiplier, dp_delta, dp_target_epsilon
        User-level differential privacy (:mod:`~fedcybgd.strategies.privacy`, docs/privacy.md):
        with ``dp`` ``"central"`` or ``"local"`` a block's uploads merge as
        :class:`~fedcybgd.strategies.privacy.DpMean` (whatever ``aggregate`` says), under
        ``"central"`` each upload is clipped to ``dp_clip_norm`` first and self-sync is off;
        the ledger accounts every round and no round starts beyond ``dp_target_epsilon``.
    """

    def __init__(
        self,
        *,
        block_map: BlockMap,
        weights: Mapping[str, torch.Tensor],
        cycle: list[str] | None = None,
        block_schedule: str = _RUN.block_schedule,
        schedule: Schedule | None = None,
        clients_per_round: int = _RUN.clients_per_round,
        clients_per_block: int = _RUN.clients_per_block,
        update_rule: str = _RUN.update_rule,
        upload_codec: str = _RUN.upload_codec,
        download_codec: str = _RUN.download_codec,
        exact_codec: str = "xor+zstd",
        seedlog_fallback: str = _RUN.seedlog_fallback,
        seedlog_max_replay: float = _RUN.seedlog_max_replay,
        download_fraction: float = _RUN.download_fraction,
        max_staleness: int = _RUN.max_staleness,
        traffic_budget_mb: float = _RUN.traffic_budget_mb,
        install_codec: str = _RUN.install_spec,
        version_history: int = _RUN.version_history,
        install_chain: int = _RUN.install_chain,
        pretrained: Callable[[str], Tensors] | None = None,
        rule_for_budget: RuleForBudget | None = None,
        seed: int = _RUN.seed,
        lineage: str = "default",
        base_hash: str = "",
        max_payload_bytes: int = int(_RUN.max_payload_mb * 2**20),
        node_wait_s: float = 300.0,
        return_arrays: bool = True,
        local_steps: int = _RUN.local_steps,
        batch_size: int = _RUN.batch_size,
        aggregate: str | Aggregator = _RUN.aggregate,
        trim_fraction: float = _RUN.trim_fraction,
        max_update_norm: float = _RUN.max_update_norm,
        outlier_factor: float = _RUN.outlier_factor,
        max_update_ratio: float = _RUN.max_update_ratio,
        server_lr: float = _RUN.server_lr,
        parallel_damping: str = _RUN.parallel_damping,
        server_optimizer: str = _RUN.server_optimizer,
        server_beta1: float = _RUN.server_beta1,
        server_beta2: float = _RUN.server_beta2,
        server_eps: float = _RUN.server_eps,
        client_lr: Callable[[int], float] | None = None,
        device: str = "cpu",
        self_sync: bool = _RUN.self_sync,
        class_prior: ClassPriorSpec | None = None,
        classes: int = 0,
        dp: str = _RUN.dp,
        dp_clip_norm: float = _RUN.dp_clip_norm,
        dp_noise_multiplier: float = _RUN.dp_noise_multiplier,
        dp_delta: float = _RUN.dp_delta,
        dp_target_epsilon: float = _RUN.dp_target_epsilon,
        dp_adaptive_clip: bool = _RUN.dp_adaptive_clip,
        dp_clip_quantile: float = _RUN.dp_clip_quantile,
        dp_clip_lr: float = _RUN.dp_clip_lr,
        dp_clip_count_stddev: float = _RUN.dp_clip_count_stddev,
    ) -> None:
        clients_per_block = clients_per_block or clients_per_round  # 0: all on one block
        if clients_per_round < 1 or clients_per_block < 1 or clients_per_round % clients_per_block:
            raise ValueError(f"clients-per-round ({clients_per_round}) must be a multiple of "
                             f"clients-per-block ({clients_per_block}), both >= 1")
        if local_steps < 1 or batch_size < 1:
            raise ValueError("local-steps and batch-size must be >= 1")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError(f"schedule {type(schedule).__name__} lacks "
                            "take/requeue/state/load_state")
        self.block_map, self.weights = block_map, dict(weights)
        self.cycle = list(cycle or block_map.cycle(_RUN.train_embeddings, _RUN.train_head))
        self.schedule = schedule or build_schedule(block_schedule, self.cycle, seed)
        self.clients_per_round, self.clients_per_block = clients_per_round, clients_per_block
        self.update_rule, self.upload_codec = update_rule, upload_codec
        self.seedlog_fallback, self.rule_for_budget = seedlog_fallback, rule_for_budget
        self.seed, self.lineage, self.base_hash = seed, lineage, base_hash
        self.node_wait_s, self.return_arrays = node_wait_s, return_arrays
        self.local_steps, self.client_lr = local_steps, client_lr
        # Differential privacy at the points the strategy calls it (strategies.privacy): it
        # may impose the merge and bound the screen; the sampler and the merge draw from its
        # secret under central DP.
        self.dp, self.dp_policy = dp, PrivacyPolicy(
            dp, dp_noise_multiplier, dp_clip_norm, dp_delta, dp_target_epsilon,
            dp_adaptive_clip, dp_clip_quantile, dp_clip_lr, dp_clip_count_stddev,
            clients_per_round)
        self.noise_key = self.dp_policy.noise_key
        self._max_update_norm = max_update_norm  # the robust screen's own bound (0: none)
        aggregate = self.dp_policy.merge() or aggregate
        max_update_norm = self.dp_policy.screen_bound(max_update_norm)
        self.aggregate = (build_aggregator(aggregate, trim_fraction)
                          if isinstance(aggregate, str) else aggregate)
        self.aggregate_name = aggregate if isinstance(aggregate, str) else type(aggregate).__name__
        self.trim_fraction = trim_fraction
        self.screen = UpdateScreen(outlier_factor=outlier_factor, max_norm=max_update_norm,
                                   max_ratio=max_update_ratio)
        self.step = ServerStep(server_lr, parallel_damping, server_optimizer, server_beta1,
                               server_beta2, server_eps)
        self.blocks = BlockVersions(block_map, self.weights, pretrained, version_history,
                                    install_chain)
        log_downloads = download_codec == SEEDLOG
        if log_downloads and upload_codec != SEEDLOG:
            raise ValueError("download-codec 'seedlog' needs upload-codec 'seedlog' (downloads "
                             "resend the uploaded step logs)")
        # a node replays step logs exactly iff its torch and z arithmetic are the server's
        self.zo = (zeroth_order.replay_identity(device)
                   if log_downloads else "")
        self.nodes = NodeBook()
        self.sampler = NodeSampler(seed, secret=self.noise_key)  # the planner reads its keys
        self.downloads = DownloadPlanner(
            self.blocks, exact_codec=exact_codec,
            download_codec=seedlog_fallback if log_downloads else download_codec,
            fraction=download_fraction, seed=seed, max_staleness=max_staleness,
            log_downloads=(lambda node: (self.nodes.zo.get(node)
                                         or self.sampler.keys.zo.get(node)) == self.zo)
            if log_downloads else None, max_replay=seedlog_max_replay,
            unconfirmed=lambda node: node in self.nodes.unconfirmed)
        self.budget = (TrafficBudget(int(traffic_budget_mb * 2**20), self.downloads, upload_codec)
                       if traffic_budget_mb > 0 else None)
        self.reader = ReplyReader(self.blocks, self.nodes, upload_codec=upload_codec,
                                  max_steps=local_steps, max_examples=local_steps * batch_size,
                                  max_payload_bytes=max_payload_bytes,
                                  seedlog_fallback=seedlog_fallback, device=device)
        self.device = device
        self.class_prior, self.classes = class_prior, classes
        # Self-sync needs one node per block and a server step the node can reproduce.
        # (and, under central DP, no noise the node cannot know)
        self.self_sync = (self_sync and clients_per_block == 1 and server_optimizer == "sgd"
                          and dp != "central")
        self.installer = BlockInstaller(
            self.blocks, self.schedule, self.screen, self.step, self.aggregate,
            self.nodes if self.self_sync else None,
            None if install_codec == "none" else QuantizedInstall(install_codec),
            log_downloads=log_downloads)
        self.history: list[RoundRecord] = []
        self.round: RoundInFlight | None = None

    @classmethod
    def from_config(cls, run: RunConfig, block_map: BlockMap,
                    weights: Mapping[str, torch.Tensor], **overrides: Any) -> FedCyBGD:
        """The strategy ``run`` describes: every setting from the run config (the one place a
        default lives), so a ServerApp of one's own runs what ``flwr run`` runs.

        ``overrides`` replace or add keyword arguments of the constructor, e.g. a
        ``schedule=`` or ``aggregate=`` object, ``pretrained``, ``rule_for_budget``,
        ``class_prior``/``classes``, ``device``, ``lineage``, ``return_arrays``;
        ``base_hash`` defaults to the weights' checksum.
        """
        # Every constructor argument named as a run-config field takes that field, but for two
        # whose run-config form is not the object: ``class_prior`` (a spec, resolved with the
        # task's classes by the caller) and ``device`` (``auto`` resolved); the rest are
        # derived from the run config here.
        fields = {f.name for f in dataclasses.fields(run)} - {"class_prior", "device"}
        settings: dict[str, Any] = {
            name: getattr(run, name) for name in inspect.signature(cls.__init__).parameters
            if name in fields}
        settings.update(
            cycle=block_map.cycle(run.train_embeddings, run.train_head),
            install_codec=run.install_spec,
            max_payload_bytes=int(run.max_payload_mb * 2**20),
            node_wait_s=run.node_wait,
            client_lr=build_lr_schedule(run.lr_schedule, run.lr, run.num_server_rounds,
                                        run.warmup_rounds),
        )
        settings.update(overrides)
        if "base_hash" not in settings:
            settings["base_hash"] = content_checksum(weights)
        return cls(block_map=block_map, weights=weights, **settings)

    def settings(self) -> dict[str, Any]:
        """The settings in effect, by run-config key (what two strategies are compared by)."""
        return {
            "block-schedule": getattr(self.schedule, "order", type(self.schedule).__name__),
            "cycle": list(self.cycle),
            "clients-per-round": self.clients_per_round,
            "clients-per-block": self.clients_per_block,
            "update-rule": self.update_rule,
            "upload-codec": self.upload_codec,
            "download-codec": self.downloads.download_codec,
            "download-fraction": self.downloads.fraction,
            "max-staleness": self.downloads.max_staleness,
            "traffic-budget-mb": 0.0 if self.budget is None else self.budget.budget_bytes / 2**20,
            "install-codec": ("none" if self.installer.quantized is None
                              else self.installer.quantized.spec),
            "seedlog-fallback": self.seedlog_fallback,
            "seedlog-max-replay": self.downloads.max_replay,
            "version-history": self.blocks.history,
            "install-chain": self.blocks.chain,
            "seed": self.seed,
            "max-payload-bytes": self.reader.max_payload_bytes,
            "local-steps": self.local_steps,
            "max-examples": self.reader.max_examples,
            "aggregate": self.aggregate_name,
            "trim-fraction": self.trim_fraction,
            "max-update-norm": self.screen.max_norm,
            "outlier-factor": self.screen.outlier_factor,
            "max-update-ratio": self.screen.max_ratio,
            "server-step": (self.step.server_lr, self.step.damping, self.step.optimizer,
                            self.step.beta1, self.step.beta2, self.step.eps),
            "client-lr": None if self.client_lr is None else
            [self.client_lr(r) for r in (1, 2, 10)],
            "self-sync": self.self_sync,
            "dp": self.dp,
            "dp-ledger": None if (ledger := self.dp_policy.ledger) is None else (
                ledger.noise_multiplier, ledger.delta, ledger.target_epsilon),
            "dp-noise": getattr(self.aggregate, "noise_std", None),
            "dp-adaptive-clip": None if (clip := self.dp_policy.adaptive_clip) is None else (
                clip.clip, clip.quantile, clip.lr, clip.count_stddev),
        }

    # What tests and the ServerApp read directly.
    versions = property(lambda self: self.blocks.versions, doc="Block -> version (round).")
    checksums = property(lambda self: self.blocks.checksums, doc="Block -> its checksum.")
    holdings = property(lambda self: self.nodes.holdings, doc="Node -> blocks it holds.")
    budgets = property(lambda self: self.nodes.budgets, doc="Node -> memory budget (MB).")
    excluded = property(lambda self: self.nodes.excluded, doc="Node -> why it sits out.")

    def block_tensors(self, block: str) -> Tensors:
        """The global tensors of ``block`` (views, not copies)."""
        return self.blocks.tensors(block)

    def checkpoint_tensors(self) -> dict[str, tuple[int, Tensors]]:
        """What a checkpoint saves as tensors: ``name -> (version, tensors)`` for every block
        above version 0, and the server optimizer's state of each such block (under
        :data:`SERVER_STATE` + its name, at the block's version: it changes only with it) and
        the deltas of its kept installs (:data:`INSTALL_PAYLOAD` + its name: ``payload.0``,
        the oldest, ``payload.1``, ...)."""
        out = {b: (v, self.blocks.tensors(b)) for b, v in self.versions.items() if v > 0}
        for block, tensors in self.step.state_tensors().items():
            out[SERVER_STATE + block] = (self.versions[block], tensors)
        for block, payloads in self.blocks.install_payloads().items():
            out[INSTALL_PAYLOAD + block] = (self.versions[block], {
                f"payload.{i}": torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                for i, payload in enumerate(payloads)})
        return out

    def install_checkpoint(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put a checkpointed entry of :meth:`checkpoint_tensors` back: a block into the global
        weights, or a block's server optimizer state (before :meth:`load_state`)."""
        if block.startswith(SERVER_STATE):
            name = block.removeprefix(SERVER_STATE)
            if name not in self.versions:
                raise ValueError(f"checkpointed server optimizer state of unknown block {name}")
            self.step.load_tensors(name, tensors)
            return
        if block.startswith(INSTALL_PAYLOAD):
            name = block.removeprefix(INSTALL_PAYLOAD)
            # (checkpoints that kept one install: a single "payload")
            keys = (["payload"] if set(tensors) == {"payload"}
                    else [f"payload.{i}" for i in range(len(tensors))])
            if name not in self.versions or not tensors or set(tensors) != set(keys):
                raise ValueError(f"checkpointed install payload {block!r} is not one of ours")
            self.blocks.restore_install_payloads(
                name, [tensors[key].numpy().tobytes() for key in keys])
            return
        self.blocks.install_checkpoint(block, tensors)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node: its block, rule, seed and download."""
        if len(arrays) and (self.round is None or arrays is not self.round.returned):
            self.blocks.load_weights(arrays.to_torch_state_dict())  # e.g. Strategy.start's
        try:
            nodes = self.sampler.sample(grid, server_round, count=self.clients_per_round,
                                        per_block=self.clients_per_block,
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
            bound = self._max_update_norm
            self.screen.max_norm = min(bound, clip) if bound else clip
            config = ConfigRecord({**dict(config), protocol.DP_CLIP: float(clip)})
        blocks = self.schedule.take(len(nodes) // self.clients_per_block)
        nodes = nodes[: len(blocks) * self.clients_per_block]
        pairs = match(nodes, blocks, per_block=self.clients_per_block, rule=self.update_rule,
                      budgets=self.nodes.budgets, rule_for_budget=self.rule_for_budget,
                      lowest_layer_of=self.block_map.lowest_layer_of)
        record = RoundRecord.training(server_round, self.update_rule)
        record.blocks, record.clients = list(blocks), [a.node for a in pairs]
        live = self.round = RoundInFlight(record, pairs)
        payloads: PayloadCache = {}
        terms = RunTerms(self.lineage, self.base_hash, self.upload_codec, self.local_steps,
                         self.seedlog_fallback, self.device, self.self_sync)
        lr = None if self.client_lr is None else self.client_lr(server_round)
        for assignment in pairs:
            node, block = assignment.node, assignment.block
            live.awaiting[node] = block
            retries = self.installer.retry_seeds
            retry = retries.pop(block, None) if self.clients_per_block == 1 else None
            seed = live.seeds[node] = (retry if retry is not None
                                       else self.sampler.seed_of(server_round, node))
            held = self.nodes.holdings.get(node, {})
            node_terms = terms
            if self.budget is None:
                down = self.downloads.plan(server_round, node, block, held, payloads)
            else:
                choice = self.budget.choose(server_round, node, block, held, payloads)
                down, live.upload_codecs[node] = choice.download, choice.upload_codec
                node_terms = dataclasses.replace(terms, upload_codec=choice.upload_codec)
                record.count_traffic_level(node, choice.level, choice.fits)
            record.bytes_down += down.bytes
            record.bytes_down_raw += down.raw_bytes
            live.sent.append(train_message(server_round, assignment, seed, down, node_terms,
                                           config, lr, self.nodes.promised.get(node)))
            record.wire_bytes_down += message_bytes(live.sent[-1])
        for block in blocks:
            if block not in live.awaiting.values():
                log.info("round %d: no sampled node can fit block %s; re-queued",
                         server_round, block)
        return live.sent

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Admit each upload through the gate, merge each block's, install, re-queue the rest.

        No reply can end the round: whatever goes wrong reading one is a drop, counted by
        reason in the round's ``dropped``.
        """
        live = self.round
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
            asked = live.upload_codecs.get(node, self.upload_codec)
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
                         else self.seedlog_fallback if asked == SEEDLOG else asked)
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
        self.round = RoundInFlight(RoundRecord.training(server_round, self.update_rule), [])
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
                 self.clients_per_round, self.clients_per_block, self.update_rule,
                 self.upload_codec, self.downloads.download_codec)

    def state(self) -> dict[str, Any]:
        """JSON-able state (weights are saved separately, per block)."""
        nodes = self.nodes.state()
        return {**self.blocks.state(), "schedule": self.schedule.state(),
                "holdings": nodes["holdings"], "excluded": nodes["excluded"],
                "budgets": nodes["budgets"], "promised": nodes["promised"],
                "unconfirmed": nodes["unconfirmed"],
                "retry_seeds": dict(self.installer.retry_seeds),
                "update_sizes": self.screen.state(), "node_keys": self.sampler.state(),
                "class_counts": self.sampler.keys.counts_state(),
                "server_steps": self.step.state(),
                "traffic_seen": {} if self.budget is None else {
                    c: list(r) for c, r in self.budget.seen.items()},
                "privacy": self.dp_policy.state(self.aggregate)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output (weights must be restored by the caller)."""
        self.blocks.load_state(state)
        self.schedule.load_state(state["schedule"])
        self.nodes.load_state(state)
        self.installer.retry_seeds = {str(b): int(s)
                                      for b, s in state.get("retry_seeds", {}).items()}
        self.screen.load_state(state.get("update_sizes", {}))
        self.sampler.load_state(state.get("node_keys", {}))
        self.sampler.keys.load_counts_state(state.get("class_counts", {}))
        self.step.load_state(state.get("server_steps", {}))
        if self.budget is not None:
            self.budget.seen = {str(c): [float(x) for x in r]
                                for c, r in state.get("traffic_seen", {}).items()}
        self.dp_policy.load_state(state.get("privacy", {}), self.aggregate)
