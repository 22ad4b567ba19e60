"""A byte budget per client-round: the strategy picks, per node and round, the least lossy
traffic level whose download plus expected upload fits ``traffic-budget-mb``.

The levels, from the run's own settings down (each keeps what the one before it changed):

0. ``configured``: the run's download codec, staleness bound and upload codec;
1. ``unchained``: frozen blocks through the download codec, not as a chain of the install
   deltas a node missed (``install-chain``: exact, but more bytes than one lossy delta);
2. ``int4-down``: frozen blocks through ``delta+int4+zstd``;
3. ``int2-down``: frozen blocks through ``delta+int2+zstd``;
4. ``int2-up``: the upload through ``delta+int2+zstd`` too (error feedback keeps what it drops);
5. ``topk-up``: the upload through ``delta+topk+int8+zstd`` (fewer bytes than int2, but it keeps
   far less of an update's direction: cosine 0.44 against int2's 0.98 on a SmolLM2 update);
6. ``stale-1``: frozen copies one install behind are not refreshed (``max-staleness = 1``);
7. ``stale``: frozen blocks are not refreshed at all (only the block a node trains is sent, and
   it always arrives exact).

A rung only ever narrows the run's own settings: a download codec no smaller than the run's
(``int4-down`` in a run that downloads int2) is left at the run's, and a rung that then repeats
one already tried is skipped, so no frozen block is encoded for a level that cannot be smaller.

The download's size is known exactly (it is planned, then counted); the upload's is expected
from the median bytes per element of the last uploads through the same codec (a median, so a
few hostile nodes sending oversized or tiny uploads cannot move it far; before any came, a
bound from the codec's stored width). A node whose last level still does not fit is sent at
it and the round's record says it went over. The chosen level per node is the row's
``traffic`` entry.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from fedcybgd.compression import parse_spec
from fedcybgd.compression.codecs import DEFAULT_GROUP_SIZE, QUANT_BITS
from fedcybgd.protocol import SEEDLOG, Holding
from fedcybgd.strategies.downloads import Download, DownloadPlanner, PayloadCache

UNBOUNDED = 2**31  # a staleness bound no block reaches
KEPT = 64  # uploads per codec whose bytes per element the median is taken over


@dataclass(frozen=True)
class TrafficLevel:
    """One rung of the ladder: ``None`` keeps the run's own setting."""

    name: str
    download_codec: str | None = None
    max_staleness: int | None = None
    upload_codec: str | None = None
    frozen_chains: bool = False


LEVELS = (
    TrafficLevel("configured", frozen_chains=True),
    TrafficLevel("unchained"),
    TrafficLevel("int4-down", download_codec="delta+int4+zstd"),
    TrafficLevel("int2-down", download_codec="delta+int2+zstd"),
    TrafficLevel("int2-up", download_codec="delta+int2+zstd", upload_codec="delta+int2+zstd"),
    TrafficLevel("topk-up", download_codec="delta+int2+zstd",
                 upload_codec="delta+topk+int8+zstd"),
    TrafficLevel("stale-1", download_codec="delta+int2+zstd", max_staleness=1,
                 upload_codec="delta+topk+int8+zstd"),
    TrafficLevel("stale", download_codec="delta+int2+zstd", max_staleness=UNBOUNDED,
                 upload_codec="delta+topk+int8+zstd"),
)


def bytes_per_element_bound(spec: str, topk_ratio: float = 0.1) -> float:
    """What one element of an upload through ``spec`` costs at most before zstd: the stored
    width (plus a float32 scale per quantizer group), times the kept share and its index under
    top-k."""
    parsed = parse_spec(spec)
    width = {"fp16": 2.0, "bf16": 2.0}.get(parsed.cast or "", 4.0)
    if parsed.quant:
        width = QUANT_BITS[parsed.quant] / 8 + 4 / DEFAULT_GROUP_SIZE[parsed.quant]
    return topk_ratio * (width + 4) if parsed.topk else width


@dataclass(frozen=True)
class Choice:
    """What a node is sent and asked to send back, at which level, and whether it fits."""

    download: Download
    upload_codec: str
    level: str
    expected_bytes: int
    fits: bool


class TrafficBudget:
    """Choose each node's traffic level (see the module docstring).

    Parameters
    ----------
    budget_bytes : int
        Download plus upload payload bytes allowed per client-round (> 0).
    planner : DownloadPlanner
        The run's download planner (its codec and staleness are level 0's).
    upload_codec : str
        The run's upload codec (a weights codec spec).
    """

    def __init__(self, budget_bytes: int, planner: DownloadPlanner, upload_codec: str) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"traffic-budget-mb must be > 0, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        self.planner = planner
        self.upload_codec = upload_codec
        self.seen: dict[str, list[float]] = {}  # upload codec -> recent bytes per element

    def expected_upload(self, codec: str, numel: int) -> int:
        """Bytes an upload of ``numel`` elements through ``codec`` is expected to take (a step
        log: what logs brought before, nothing before the first)."""
        recent = self.seen.get(codec)
        if recent:
            per = statistics.median(recent)
        else:
            per = 0.0 if codec == SEEDLOG else bytes_per_element_bound(codec)
        return int(per * numel)

    def observe(self, codec: str, payload_bytes: int, numel: int) -> None:
        """Count an upload of ``numel`` elements that came through ``codec``."""
        recent = self.seen.setdefault(codec, [])
        recent.append(payload_bytes / max(numel, 1))
        del recent[:-KEPT]

    def narrower_download(self, codec: str | None) -> str | None:
        """``codec`` if it stores frozen blocks in fewer bytes a value than the run's own
        download codec, else ``None`` (the run's own). A step-log run takes the level's."""
        own = self.planner.download_codec
        if codec is None or own == SEEDLOG:
            return codec
        return codec if bytes_per_element_bound(codec) < bytes_per_element_bound(own) else None

    def choose(self, server_round: int, node: int, block: str, held: Mapping[str, Holding],
               payloads: PayloadCache) -> Choice:
        """The least lossy level whose planned download and expected upload fit."""
        numel = self.planner.versions.block_map.info(block).numel
        choice: Choice | None = None
        tried: set[tuple[str | None, str, int | None, bool]] = set()
        for level in LEVELS:
            download_codec = self.narrower_download(level.download_codec)
            # a step log is what the run asked for: it stays (it is already the smallest)
            codec = (self.upload_codec if self.upload_codec == SEEDLOG
                     else level.upload_codec or self.upload_codec)
            key = (download_codec, codec, level.max_staleness, level.frozen_chains)
            if key in tried:
                continue
            tried.add(key)
            down = self.planner.plan(server_round, node, block, held, payloads,
                                     download_codec=download_codec,
                                     max_staleness=level.max_staleness,
                                     frozen_chains=level.frozen_chains)
            total = down.bytes + self.expected_upload(codec, numel)
            choice = Choice(down, codec, level.name, total, total <= self.budget_bytes)
            if choice.fits:
                return choice
        assert choice is not None
        return choice
