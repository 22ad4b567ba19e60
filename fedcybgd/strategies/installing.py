"""Closing a FedCyBGD round: merge each block's admitted uploads, take the server's step,
install the result at a new version, re-queue the blocks that brought nothing usable.

Kept apart from the strategy so the Flower choreography (:mod:`~fedcybgd.strategies.fedcybgd`)
stays readable and this bookkeeping can be tested on its own.
"""

from __future__ import annotations

import functools
import logging
import statistics
from dataclasses import dataclass, field

import torch

from fedcybgd.compression import raw_fp32_bytes
from fedcybgd.core.checksum import content_checksum
from fedcybgd.protocol import SEEDLOG
from fedcybgd.protocol.seedsync import LoggedInstall, rebuild
from fedcybgd.protocol.selfsync import Promotion, sgd_step
from fedcybgd.strategies.aggregate import Aggregator
from fedcybgd.strategies.quantized_install import RESIDUAL, QuantizedInstall
from fedcybgd.strategies.reader import BlockUpload, NodeBook
from fedcybgd.strategies.record import RoundInFlight
from fedcybgd.strategies.replies import INSTALL_FAILED, NON_FINITE, DropLog, Dropped, guarded
from fedcybgd.strategies.schedule import ObservingSchedule, Schedule
from fedcybgd.strategies.screen import UpdateScreen, all_finite, update_rms
from fedcybgd.strategies.server_step import ServerStep, merge_block
from fedcybgd.strategies.versions import BlockVersions

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
Admitted = tuple[int, BlockUpload, float]  # (node, its upload, the update's RMS)


@dataclass
class BlockInstaller:
    """Installs a round's merged blocks into ``blocks``.

    ``retry_seeds`` keeps the seed of each re-queued block, so the node that next trains it
    (alone) can resume its in-round checkpoint. With ``self_sync_book`` (the strategy's node book),
    the node that trained a block alone is credited with the installed version when it can
    compute it from its own upload (:mod:`fedcybgd.protocol.selfsync`). With ``log_downloads``, an
    install made from step logs alone is kept as those logs when a node can rebuild it from them
    bit for bit (:mod:`fedcybgd.protocol.seedsync`), for seed-log downloads.
    """

    blocks: BlockVersions
    schedule: Schedule
    screen: UpdateScreen
    step: ServerStep
    aggregate: Aggregator
    self_sync_book: NodeBook | None = None
    quantized: QuantizedInstall | None = None
    log_downloads: bool = False
    retry_seeds: dict[str, int] = field(default_factory=dict)

    def close(self, live: RoundInFlight, arrived: list[tuple[str, Admitted]],
              drops: DropLog) -> None:
        """Install every block of ``live`` whose admitted uploads (``(block, admitted)`` as they
        arrived) merge to a finite result; re-queue the others; count the uploads and fill the
        record's ``accepted``, ``failed_blocks``, ``train_loss`` (example-weighted over finite
        losses) and ``dropped``. Nothing that goes wrong installing one block ends the round:
        its uploads count as dropped (``non-finite`` or ``install-failed``) and it is
        re-queued."""
        record = live.record
        # Merge in the order the instructions went out, not the order replies arrived: float
        # sums depend on their order, and the same seed must give the same run.
        sent_order = {m.metadata.dst_node_id: i for i, m in enumerate(live.sent)}
        admitted: dict[str, list[Admitted]] = {}
        losses: list[tuple[float, float]] = []
        for block, (node, got, rms) in sorted(arrived, key=lambda a: sent_order[a[1][0]]):
            admitted.setdefault(block, []).append((node, got, rms))
            losses.append((got.weight, got.metrics["train_loss"]))
            record.count_upload(got.weight, raw_fp32_bytes(got.tensors), got.rule,
                                got.metrics["peak_mem_mb"], got.metrics["train_s"])
        block_seed = {a.block: live.seeds[a.node] for a in live.pairs}
        # Only a schedule that asks is told the step's size (it costs a pass over the block).
        observer = self.schedule if isinstance(self.schedule, ObservingSchedule) else None
        for block in record.blocks or []:
            uploads = admitted.get(block, [])
            installed = False
            if uploads:
                try:
                    guarded(functools.partial(self._install, block, uploads, len(admitted),
                                              record.round, observer), INSTALL_FAILED)
                    installed = True
                except Dropped as failed:
                    drops.counts[failed.reason] += len(uploads)
                    log.warning("round %d: block %s not installed (%s): %s", record.round,
                                block, failed.reason, failed.detail)
            if installed:
                record.accepted[block] = [node for node, _, _ in uploads]  # type: ignore[index]
                continue
            self.schedule.requeue(block)
            if block in block_seed:
                self.retry_seeds[block] = block_seed[block]
            record.failed_blocks.append(block)  # type: ignore[union-attr]
        finite = [(w, loss) for w, loss in losses if loss == loss]
        if finite:
            record.train_loss = sum(w * x for w, x in finite) / sum(w for w, _ in finite)
        record.dropped = drops.as_dict()

    def _install(self, block: str, uploads: list[Admitted], parallel: int, version: int,
                 observer: ObservingSchedule | None) -> None:
        """Merge ``block``'s uploads, take the server's step, round and install the result at
        ``version``. Everything that can fail runs before anything is changed; the block is
        left as it was (and ``Dropped``, ``non-finite``, raised) when the result is not finite,
        whatever the screen's settings."""
        start = self.blocks.tensors(block)
        merged = merge_block(self.aggregate, self.step, block, start,
                             [(got.weight, got.tensors) for _, got, _ in uploads], parallel)
        if merged is None:
            raise Dropped(NON_FINITE, "the merged update is not finite in the model's dtypes")
        moved = 0.0 if observer is None else update_rms(merged.tensors, start)
        synced = self._self_synced(block, uploads, parallel)
        payload = None
        if self.quantized is not None and synced is None:
            current = self.blocks.current(block)
            rounded = self.quantized.round(
                block, start, current.version if current else 0, merged.tensors, version,
                self.step.moments.get(block, {}).get(RESIDUAL))
            if not (all_finite(rounded.tensors) and all_finite(rounded.residual)):
                raise Dropped(NON_FINITE, "the block rounded to the install codec is not finite")
            merged.tensors, payload = rounded.tensors, rounded.payload
            merged.moments[RESIDUAL] = rounded.residual
        elif synced is not None:
            # the block is what the only upload decodes to (a step of size 1): that upload is
            # the delta other nodes holding the start need (kept if its header says so)
            payload = uploads[0][1].payload or None
        logged = (self._logged(block, uploads, merged.tensors, version, parallel)
                  if self.log_downloads else None)
        self.blocks.install(block, merged.tensors, version, payload, logged)
        if synced is not None:
            self._credit(uploads[0][0], block, *synced)
        self.step.commit(block, merged)
        if observer is not None:
            observer.observe(block, moved)
        # the history's entry: the merged step, and no more than the median admitted upload
        # (under `mean` a minority moves the merge, not the median of the uploads)
        self.screen.installed(block, min(merged.merged_rms,
                                         statistics.median(rms for _, _, rms in uploads)))

    def _logged(self, block: str, uploads: list[Admitted], installed: Tensors, version: int,
                parallel: int) -> LoggedInstall | None:
        """``block``'s install as the step logs it came from, if every upload was one and
        :func:`~fedcybgd.protocol.seedsync.rebuild` (what a node runs) gives exactly ``installed``
        (called before the install: it needs the start)."""
        if not uploads or any(got.kind != SEEDLOG or not got.log for _, got, _ in uploads):
            return None
        size = self.step.size(parallel)
        rebuilt = rebuild(self.blocks.tensors(block),
                          [(got.weight, got.decoded) for _, got, _ in uploads], size)
        if any(not torch.equal(rebuilt[name], t) for name, t in installed.items()):
            return None  # another aggregator, step, clip or rounding: a node gets weights
        return LoggedInstall(version, content_checksum(installed), size,
                             tuple(got.weight for _, got, _ in uploads),
                             tuple(got.log for _, got, _ in uploads),
                             sum(got.replay_passes for _, got, _ in uploads))

    def _self_synced(self, block: str, uploads: list[Admitted], parallel: int
                     ) -> tuple[str, float] | None:
        """``(checksum, step size)`` of what the node of ``block``'s only upload will compute
        from its pending copy (called before the block is installed: it needs the start), or
        ``None`` when self-sync does not apply."""
        if self.self_sync_book is None or len(uploads) != 1 or not uploads[0][1].pending:
            return None
        size = self.step.size(parallel)
        expected = sgd_step(self.blocks.tensors(block), uploads[0][1].decoded, size)
        return content_checksum(expected), size

    def _credit(self, node: int, block: str, checksum: str, size: float) -> None:
        """Record that ``node`` holds the installed ``block`` by self-sync, if what it computes
        (``checksum``) is what was installed; it is told in its next instruction."""
        current = self.blocks.current(block)
        if self.self_sync_book is None or current is None or current.checksum != checksum:
            log.info("block %s: the installed version is not what node %d can compute from its "
                     "upload (clipped, or another aggregate); it will be sent", block, node)
            return
        self.self_sync_book.holdings.setdefault(node, {})[block] = current
        self.self_sync_book.promised.setdefault(node, {})[block] = Promotion(current.version,
                                                                       checksum, size)
