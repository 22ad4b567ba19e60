"""The parts a FedCyBGD server is made of, each built from its section of the run config.

:func:`assemble` builds them; :class:`Parts` holds them and gathers what the strategy reports
and checkpoints from them: :meth:`Parts.settings` (what each part holds, by run-config key)
and :meth:`Parts.state` / :meth:`Parts.load_state` (each part's own state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedcybgd.config import RunConfig
from fedcybgd.model.blocks import BlockMap
from fedcybgd.protocol import SEEDLOG, zeroth_order
from fedcybgd.strategies.aggregate import Aggregator, build_aggregator
from fedcybgd.strategies.downloads import DownloadPlanner
from fedcybgd.strategies.installing import BlockInstaller
from fedcybgd.strategies.privacy import PrivacyPolicy
from fedcybgd.strategies.quantized_install import QuantizedInstall
from fedcybgd.strategies.reader import NodeBook, ReplyReader
from fedcybgd.strategies.sampling import NodeSampler
from fedcybgd.strategies.schedule import Schedule, build_schedule
from fedcybgd.strategies.screen import UpdateScreen
from fedcybgd.strategies.server_step import ServerStep
from fedcybgd.strategies.traffic_budget import TrafficBudget
from fedcybgd.strategies.versions import BlockVersions, Tensors

EXACT_CODEC = "xor+zstd"  # the trained block's own download: lossless


@dataclass
class Parts:
    """A FedCyBGD server's parts (see :func:`assemble`)."""

    config: RunConfig
    cycle: list[str]
    schedule: Schedule
    blocks: BlockVersions
    nodes: NodeBook
    sampler: NodeSampler
    downloads: DownloadPlanner
    budget: TrafficBudget | None
    reader: ReplyReader
    screen: UpdateScreen
    step: ServerStep
    aggregate: Aggregator
    aggregate_name: str
    installer: BlockInstaller
    privacy: PrivacyPolicy
    zo: str  # the step-log arithmetic the server replays with ("": no step-log downloads)
    self_sync: bool  # in effect: it needs one node a block, an sgd step and no central noise

    def settings(self) -> dict[str, Any]:
        """The settings in effect, by run-config key, read from the parts that hold them."""
        cohort, reader, downloads, step = self.config.cohort, self.reader, self.downloads, self.step
        quantized = self.installer.quantized
        return {
            "block-schedule": getattr(self.schedule, "order", type(self.schedule).__name__),
            "cycle": list(self.cycle),
            "clients-per-round": cohort.clients_per_round,
            "clients-per-block": cohort.clients_per_block,
            "update-rule": cohort.update_rule,
            "seed": cohort.seed,
            "local-steps": cohort.local_steps,
            "upload-codec": reader.upload_codec,
            "seedlog-fallback": reader.seedlog_fallback,
            "max-payload-bytes": reader.max_payload_bytes,
            "max-examples": reader.max_examples,
            "download-codec": downloads.download_codec,
            "download-fraction": downloads.fraction,
            "max-staleness": downloads.max_staleness,
            "seedlog-max-replay": downloads.max_replay,
            "traffic-budget-mb": 0.0 if self.budget is None else self.budget.budget_bytes / 2**20,
            "install-codec": "none" if quantized is None else quantized.spec,
            "version-history": self.blocks.history,
            "install-chain": self.blocks.chain,
            "aggregate": self.aggregate_name,
            "trim-fraction": self.config.robust.trim_fraction,
            "max-update-norm": self.screen.max_norm,
            "outlier-factor": self.screen.outlier_factor,
            "max-update-ratio": self.screen.max_ratio,
            "server-step": (step.server_lr, step.damping, step.optimizer, step.beta1,
                            step.beta2, step.eps),
            "self-sync": self.self_sync,
            **self.privacy.settings(self.aggregate),
        }

    def state(self) -> dict[str, Any]:
        """JSON-able state of every part (weights are saved separately, per block)."""
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
                "privacy": self.privacy.state(self.aggregate)}

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
        self.privacy.load_state(state.get("privacy", {}), self.aggregate)


def assemble(
    config: RunConfig,
    block_map: BlockMap,
    weights: dict[str, torch.Tensor],
    *,
    cycle: list[str] | None = None,
    schedule: Schedule | None = None,
    aggregate: Aggregator | None = None,
    pretrained: Callable[[str], Tensors] | None = None,
    device: str = "cpu",
) -> Parts:
    """The parts of a FedCyBGD server: each from its section of ``config`` (``schedule`` and
    ``aggregate`` objects in place of the config's named ones); ``weights`` are the global
    weights the block versions update in place."""
    cohort, codecs, robust = config.cohort, config.codecs, config.robust
    if cohort.clients_per_round % cohort.clients_per_block:
        raise ValueError(f"clients-per-round ({cohort.clients_per_round}) must be a "
                         f"multiple of clients-per-block ({cohort.clients_per_block})")
    if schedule is not None and not isinstance(schedule, Schedule):
        raise TypeError(f"schedule {type(schedule).__name__} lacks "
                        "take/requeue/state/load_state")
    cycle = list(cycle or block_map.cycle(config.train_embeddings, config.train_head))
    schedule = schedule or build_schedule(cohort.block_schedule, cycle, cohort.seed)
    # Differential privacy may impose the merge and bound the screen; the sampler and the
    # merge draw from its secret under central DP.
    privacy = PrivacyPolicy(config.privacy)
    merge = privacy.merge() or aggregate or robust.aggregate
    merger = build_aggregator(merge, robust.trim_fraction) if isinstance(merge, str) else merge
    screen = UpdateScreen.from_config(robust, privacy.screen_bound(robust.max_update_norm))
    step = ServerStep.from_config(config.server_step)
    blocks = BlockVersions(block_map, weights, pretrained, codecs.version_history,
                           codecs.install_chain)
    nodes = NodeBook()
    sampler = NodeSampler(cohort.seed, secret=privacy.noise_key)
    zo, downloads = _download_planner(config, blocks, nodes, sampler, device)
    budget = (TrafficBudget(int(codecs.traffic_budget_mb * 2**20), downloads,
                            codecs.upload_codec) if codecs.traffic_budget_mb > 0 else None)
    reader = ReplyReader(blocks, nodes, upload_codec=codecs.upload_codec,
                         max_steps=cohort.local_steps,
                         max_examples=cohort.local_steps * cohort.batch_size,
                         max_payload_bytes=cohort.max_payload_bytes,
                         seedlog_fallback=codecs.seedlog_fallback, device=device)
    # Self-sync: the node must be able to reproduce the installed block from its own upload.
    self_sync = (codecs.self_sync and cohort.clients_per_block == 1
                 and step.optimizer == "sgd" and privacy.dp != "central")
    installer = BlockInstaller(
        blocks, schedule, screen, step, merger, nodes if self_sync else None,
        None if codecs.install_codec == "none" else QuantizedInstall(codecs.install_codec),
        log_downloads=codecs.download_codec == SEEDLOG)
    return Parts(config, cycle, schedule, blocks, nodes, sampler, downloads, budget, reader,
                 screen, step, merger,
                 merge if isinstance(merge, str) else type(merge).__name__,
                 installer, privacy, zo, self_sync)


def _download_planner(config: RunConfig, blocks: BlockVersions, nodes: NodeBook,
                      sampler: NodeSampler, device: str) -> tuple[str, DownloadPlanner]:
    """The planner of every node's download, and the step-log arithmetic the server replays
    with (``""`` unless blocks go down as step logs)."""
    codecs, seed = config.codecs, config.cohort.seed
    common: dict[str, Any] = dict(
        exact_codec=EXACT_CODEC, fraction=codecs.download_fraction, seed=seed,
        max_staleness=codecs.max_staleness, max_replay=codecs.seedlog_max_replay,
        unconfirmed=lambda node: node in nodes.unconfirmed)
    if codecs.download_codec != SEEDLOG:
        return "", DownloadPlanner(blocks, download_codec=codecs.download_codec, **common)
    if codecs.upload_codec != SEEDLOG:
        raise ValueError("download-codec 'seedlog' needs upload-codec 'seedlog' (downloads "
                         "resend the uploaded step logs)")
    # a node replays step logs exactly iff its torch and z arithmetic are the server's
    zo = zeroth_order.replay_identity(device)
    keys = sampler.keys
    return zo, DownloadPlanner(
        blocks, download_codec=codecs.seedlog_fallback,
        log_downloads=lambda node: (nodes.zo.get(node) or keys.zo.get(node)) == zo, **common)
