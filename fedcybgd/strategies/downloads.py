"""Download planning: which blocks a node is sent, through which codec, against which base.

Delta sync: a node is sent only blocks whose current version it lacks. The block it will train
must arrive exact (``exact_codec``, lossless). A frozen block it lacks comes through
``download_codec``, possibly lossy, which leaves the node an approximate copy (its checksum says
so); a frozen block already held at the current version, even approximately, is not sent again.
With ``max_staleness = s > 0`` a frozen copy may lag the global block by up to ``s`` installs
of it before it is sent again (bounded staleness); with ``fraction < 1`` (the paper's random
dropping) a node gets only that share of its stale frozen blocks each round. A delta is taken
against the best exact base the node holds
(:meth:`fedcybgd.strategies.versions.BlockVersions.base_for`); a block the server installed
through a low-bit delta (``install-codec``) goes to nodes holding its previous version as that
delta, which is exact for them; a node that missed several such installs gets their deltas one
after another (``install-chain``; the record :data:`fedcybgd.protocol.DOWNLOAD_CHAIN`), when
they weigh at most :data:`CHAIN_SHARE` of the block in fp32: a lossless copy of a trained block
(``xor+zstd``) takes 55-75% of it. A chain keeps a frozen copy exact, so it is sent for a frozen
block too, except at a traffic budget's levels below the run's own settings. With seed-log
downloads (``download-codec = "seedlog"``) a block whose every install since the node's exact
copy was made from step logs goes as those logs (:mod:`fedcybgd.protocol.seedsync`), when the
node's z fingerprint and torch are the server's and the logs weigh less than a sixteenth of the
block in fp32 (below any int4 delta of it).

A node the server cannot vouch for (``unconfirmed``: it was sent instructions in the round a
killed server lost, so it may or may not have applied that round's downloads) is sent every
block of its plan as one lossless payload against the pretrained block, which every node holds:
the very content the plan would leave it holding, so its copy ends bit for bit what it would
have been, whatever it held before.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord

from fedcybgd.compression import (
    decode,
    encode,
    payload_from_array,
    payload_to_array,
    raw_fp32_bytes,
    read_header,
    uses_base,
)
from fedcybgd.protocol import Holding, chain_key
from fedcybgd.protocol.seedsync import encode_chain
from fedcybgd.strategies.versions import BlockVersions

# One round's encoded payloads, shared between the nodes that need the same one.
PayloadCache = dict[tuple[Any, ...], bytes]
# Most bytes a chain of more than one install delta may weigh, as a share of the block in fp32.
CHAIN_SHARE = 0.5


@dataclass
class Download:
    """What one node is sent, what it will hold after applying it, and what that costs."""

    arrays: ArrayRecord = field(default_factory=ArrayRecord)  # block -> payload
    logs: ArrayRecord = field(default_factory=ArrayRecord)  # block -> step-log chain
    chained: ArrayRecord = field(default_factory=ArrayRecord)  # chain_key(block, i) -> payload
    expect: dict[str, Holding] = field(default_factory=dict)  # block -> holding after
    bytes: int = 0  # encoded payload bytes
    raw_bytes: int = 0  # the same blocks as plain fp32


def stale_blocks(versions: BlockVersions, held: Mapping[str, Holding], assigned: str,
                 max_staleness: int = 0) -> tuple[list[str], list[str]]:
    """``(exact, frozen)``: the blocks to send exactly (the assigned one, if the node lacks
    its current version exactly) and those to send through the download codec (frozen
    copies more than ``max_staleness`` installs behind), in model order."""
    exact: list[str] = []
    frozen: list[str] = []
    for block in versions.block_map.names:
        have, want = held.get(block), versions.current(block)
        if have == want:
            continue
        if block == assigned:
            exact.append(block)
        elif want is not None and have is not None and have.version == want.version:
            continue  # an approximate copy of the current version is good enough frozen
        elif max_staleness and versions.lag(block, have) <= max_staleness:
            continue  # close enough behind to stay frozen as it is
        else:
            frozen.append(block)
    return exact, frozen


class DownloadPlanner:
    """Plan each node's download (see the module docstring).

    Parameters
    ----------
    versions : BlockVersions
        The global blocks, their versions and delta bases.
    exact_codec, download_codec : str
        Codec specs for the block a node trains (lossless) and for frozen blocks.
    fraction : float
        Share of a node's stale frozen blocks sent each round, in (0, 1].
    max_staleness : int
        Installs a node's frozen copy of a block may lag before it is sent (0: none).
    seed : int
        Seeds the random dropping.
    log_downloads : Callable[[int], bool], optional
        Whether a node may be sent step logs (its z fingerprint and torch are the server's);
        ``None``: no seed-log downloads.
    max_replay : float
        Most replay work, in passes over the block, a chain of step logs may cost a node; a
        costlier chain is sent as weights (0: no cap).
    unconfirmed : Callable[[int], bool], optional
        Whether what a node holds is unconfirmed (see the module docstring): its downloads
        then go against the pretrained block.
    """

    def __init__(self, versions: BlockVersions, *, exact_codec: str, download_codec: str,
                 fraction: float = 1.0, seed: int = 0, max_staleness: int = 0,
                 log_downloads: Callable[[int], bool] | None = None,
                 max_replay: float = 0.0,
                 unconfirmed: Callable[[int], bool] | None = None) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"download-fraction must be in (0, 1], got {fraction}")
        if max_staleness < 0:
            raise ValueError(f"max-staleness must be >= 0, got {max_staleness}")
        if max_replay < 0:
            raise ValueError(f"seedlog-max-replay must be >= 0, got {max_replay}")
        self.versions = versions
        self.exact_codec = exact_codec
        self.download_codec = download_codec
        self.fraction = fraction
        self.seed = seed
        self.max_staleness = max_staleness
        self.log_downloads = log_downloads
        self.max_replay = max_replay
        self.unconfirmed = unconfirmed

    def dropped(self, frozen: list[str], server_round: int, node: int) -> list[str]:
        """The frozen blocks kept after random dropping (all of them at ``fraction = 1``)."""
        if self.fraction >= 1 or not frozen:
            return frozen
        rng = random.Random(f"{self.seed}:drop:{server_round}:{node}")
        return rng.sample(frozen, math.ceil(self.fraction * len(frozen)))

    @staticmethod
    def chain_fits(deltas: list[bytes], tensors: Mapping[str, Any], trained: bool,
                   frozen_chains: bool) -> bool:
        """Whether ``deltas`` (the install deltas a node lacks, in order) go instead of the
        block: when they weigh at most :data:`CHAIN_SHARE` of the block in fp32 (an upload
        kept as a delta is the uploading node's bytes: this bounds what it can make others
        download), and, for a frozen block, are one delta or ``frozen_chains`` allows more."""
        cheap = sum(map(len, deltas)) <= CHAIN_SHARE * raw_fp32_bytes(tensors)
        return cheap and (len(deltas) == 1 or trained or frozen_chains)

    def plan(self, server_round: int, node: int, assigned: str, held: Mapping[str, Holding],
             payloads: PayloadCache | None = None, *, download_codec: str | None = None,
             max_staleness: int | None = None, frozen_chains: bool = True) -> Download:
        """``node``'s download for training ``assigned`` while holding ``held``.

        ``payloads`` caches encodings within a round: nodes needing the same block at the
        same version from the same base share one payload. ``download_codec`` and
        ``max_staleness`` override the planner's own for this plan (a traffic budget's level);
        ``frozen_chains=False`` sends frozen blocks no chain of install deltas.
        """
        payloads = {} if payloads is None else payloads
        if self.unconfirmed is not None and self.unconfirmed(node):
            return self.restated(self._plan(server_round, node, assigned, held, payloads,
                                            download_codec, max_staleness, frozen_chains),
                                 held, payloads)
        return self._plan(server_round, node, assigned, held, payloads, download_codec,
                          max_staleness, frozen_chains)

    def _plan(self, server_round: int, node: int, assigned: str, held: Mapping[str, Holding],
              payloads: PayloadCache, download_codec: str | None, max_staleness: int | None,
              frozen_chains: bool) -> Download:
        codec = download_codec or self.download_codec
        staleness = self.max_staleness if max_staleness is None else max_staleness
        exact, frozen = stale_blocks(self.versions, held, assigned, staleness)
        frozen = self.dropped(frozen, server_round, node)
        out = Download()
        # what the node keeps: its holdings, then the blocks sent below
        out.expect = {b: held[b] for b in self.versions.block_map.names if b in held}
        logs_ok = self.log_downloads is not None and self.log_downloads(node)
        for block, spec in [(b, self.exact_codec) for b in exact] + [
            (b, codec) for b in frozen
        ]:
            tensors = self.versions.tensors(block)
            version = self.versions.versions[block]
            chain = self.versions.log_chain(block, held.get(block)) if logs_ok else None
            if chain is not None and self.max_replay and chain.replay_passes > self.max_replay:
                chain = None  # rebuilding would cost the node more than the cap: weights
            if chain is not None:
                logs_key: tuple[Any, ...] = ("logs", block, version, held.get(block))
                if logs_key not in payloads:
                    payloads[logs_key] = encode_chain(chain)
                if len(payloads[logs_key]) * 16 < raw_fp32_bytes(tensors):
                    out.logs[block] = payload_to_array(payloads[logs_key])
                    out.expect[block] = Holding(version, self.versions.checksums[block])
                    out.bytes += len(payloads[logs_key])
                    out.raw_bytes += raw_fp32_bytes(tensors)
                    continue
            # Installed through deltas from what the node holds: those deltas are exact
            deltas = self.versions.install_chain(block, held.get(block))
            if deltas is not None and not self.chain_fits(deltas, tensors, block in exact,
                                                          frozen_chains):
                deltas = None
            if deltas is not None and len(deltas) > 1:
                for index, delta in enumerate(deltas):
                    out.chained[chain_key(block, index)] = payload_to_array(delta)
                out.expect[block] = Holding(version, self.versions.checksums[block])
                out.bytes += sum(map(len, deltas))
                out.raw_bytes += raw_fp32_bytes(tensors)
                continue
            payload = deltas[0] if deltas is not None else None
            if payload is None:
                base_version, base = self.versions.base_for(block, held.get(block))
                key = (block, version, spec, base_version, held.get(block))
                if key not in payloads:
                    payloads[key] = encode(tensors, spec, block=block, target_version=version,
                                           base_version=base_version,
                                           base=base if uses_base(spec) else None)
                payload = payloads[key]
            out.arrays[block] = payload_to_array(payload)
            out.expect[block] = Holding(version, read_header(payload, max_bytes=len(payload))
                                        .checksum)
            out.bytes += len(payload)
            out.raw_bytes += raw_fp32_bytes(tensors)
        return out

    def restated(self, planned: Download, held: Mapping[str, Holding],
                 payloads: PayloadCache) -> Download:
        """``planned`` with every block it sends from what the node holds (a delta against its
        copy, a chain of install deltas, step logs) sent instead as one ``exact_codec`` payload
        against the pretrained block, carrying exactly what ``planned`` leaves the node holding:
        decodable whatever the node holds now. A payload ``planned`` takes from the pretrained
        block (or from nothing) is sent as it is."""
        out = Download(expect=dict(planned.expect))
        sent = [*planned.arrays.keys(), *planned.logs.keys(),
                *(key.rpartition("#")[0] for key in planned.chained)]
        for block in dict.fromkeys(sent):
            target = planned.expect[block]
            if block in planned.arrays:
                payload = payload_from_array(planned.arrays[block])
                header = read_header(payload, max_bytes=len(payload))
                if not uses_base(header.spec) or header.base_version == 0:
                    out.arrays[block] = planned.arrays[block]
                    out.bytes += len(payload)
                    out.raw_bytes += raw_fp32_bytes(self.versions.tensors(block))
                    continue
            key: tuple[Any, ...] = ("restated", block, target)
            if key not in payloads:
                payloads[key] = encode(self._content(block, target, planned, held),
                                       self.exact_codec, block=block,
                                       target_version=target.version, base_version=0,
                                       base=self.versions.pretrained(block))
            out.arrays[block] = payload_to_array(payloads[key])
            out.bytes += len(payloads[key])
            out.raw_bytes += raw_fp32_bytes(self.versions.tensors(block))
        return out

    def _content(self, block: str, target: Holding, planned: Download,
                 held: Mapping[str, Holding]) -> dict[str, Any]:
        """The tensors ``planned`` leaves the node holding of ``block`` (``target``): the global
        block when that is its current version exactly, else its weights payload decoded
        against the base it was encoded from (a lossy copy of a frozen block)."""
        if target == self.versions.current(block):
            return self.versions.tensors(block)
        payload = payload_from_array(planned.arrays[block])
        header = read_header(payload, max_bytes=len(payload))
        base_version, base = self.versions.base_for(block, held.get(block))
        if uses_base(header.spec) and header.base_version != base_version:
            raise AssertionError(f"block {block}: planned from version {header.base_version}, "
                                 f"its base is version {base_version}")
        return decode(payload, base=base if uses_base(header.spec) else None,
                      expect_block=block, max_bytes=len(payload)).tensors
