"""Seed-log downloads: a node rebuilds a block's new versions from the step logs that made them.

When every upload of a block was a zeroth-order step log (``upload-codec = "seedlog"``), the
server's install is a function of the block's previous version and those logs: each log is
replayed (:func:`fedcybgd.protocol.zeroth_order.replay`), the replays are averaged
(:func:`fedcybgd.protocol.selfsync.weighted_mean`) and the server's ``sgd`` step is taken
(:func:`fedcybgd.protocol.selfsync.sgd_step`). A node that holds the previous version exactly can
then be sent the logs (a few kB) instead of the weights (``download-codec = "seedlog"``, DeComFL /
FedKSeed style). The server records an install as a :class:`LoggedInstall` only after
computing it once more through :func:`rebuild` itself and finding it bit-equal to what it
installed, so a server step, an aggregator or a rounding a node cannot reproduce falls back to
weights instead of giving a node a wrong copy. The node checks the checksum of every version it
rebuilds; a mismatch is a bad download (the node asks for a resync). A node reads every log
of a chain (:func:`read_log`) before it replays any (:func:`replay_chain`), so it knows the
replay's cost, and can refuse it by its own limits (:mod:`fedcybgd.client.limits`), first.

The wire form of a :class:`LogChain`, every number little-endian, nothing ever unpickled::

    b"FCSD" | u16 format | u32 header length | JSON header | the step logs, back to back

The header names the block, the version the chain starts from and, per install, its version,
checksum, step size, upload weights and the byte length of each of its logs
(:mod:`fedcybgd.protocol.seedlog`'s format). Neither the strategy nor the client imports the
other; both import this module.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedcybgd.core.checksum import content_checksum
from fedcybgd.protocol.seedlog import decode_seedlog
from fedcybgd.protocol.selfsync import Tensors, sgd_step, weighted_mean
from fedcybgd.protocol.zeroth_order import SeedLog, replay

MAGIC = b"FCSD"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<4sHI")
MAX_HEADER = 1 << 20
MAX_INSTALLS = 64  # a longer chain is sent as weights
MAX_LOGS = 256  # uploads of one install
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class LoggedInstall:
    """One install of a block as its step logs: ``version`` (with ``checksum``) is
    ``sgd_step(start, weighted_mean(replays), size)``, the replays weighted by ``weights``."""

    version: int
    checksum: str
    size: float
    weights: tuple[float, ...]
    logs: tuple[bytes, ...]  # each an encoded step log
    # the logs' replay work in passes over the block (the server's measure; not on the wire)
    replay_passes: float = 0.0


@dataclass(frozen=True)
class LogChain:
    """The installs that take a block from ``base_version`` (0: pretrained) to its newest."""

    block: str
    base_version: int
    base_checksum: str  # "" for version 0
    installs: tuple[LoggedInstall, ...]

    @property
    def replay_passes(self) -> float:
        """A node's work to rebuild the block from the chain, in passes over the block."""
        return sum(install.replay_passes for install in self.installs)


@torch.no_grad()
def rebuild(start: Mapping[str, torch.Tensor], replays: Sequence[tuple[float, Tensors]],
            size: float) -> Tensors:
    """The block the server installs from ``start`` and the replayed uploads ``replays``
    (``(weight, tensors)``) under the ``mean`` aggregator and an ``sgd`` step of ``size``."""
    merged = weighted_mean(list(replays))
    return sgd_step(start, {name: merged[name].to(t.dtype) for name, t in start.items()}, size)


def encode_chain(chain: LogChain) -> bytes:
    """Serialize ``chain`` (see the module docstring)."""
    installs = [{"version": i.version, "checksum": i.checksum, "size": i.size,
                 "weights": list(i.weights), "logs": [len(x) for x in i.logs]}
                for i in chain.installs]
    head = json.dumps({"block": chain.block, "base_version": chain.base_version,
                       "base_checksum": chain.base_checksum, "installs": installs},
                      separators=(",", ":"), allow_nan=False).encode()
    body = b"".join(x for i in chain.installs for x in i.logs)
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(head)) + head + body


def _int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"seed-log download: {what} must be an integer >= {low}, got "
                         f"{value!r:.40}")
    return value


def _positive(value: Any, what: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 < float(value) < math.inf):
        raise ValueError(f"seed-log download: {what} must be a finite number > 0, got "
                         f"{value!r:.40}")
    return float(value)


def decode_chain(data: bytes, *, max_bytes: int) -> LogChain:
    """Parse :func:`encode_chain` output; ``ValueError`` naming what is malformed. The logs
    are kept encoded (:func:`read_log` decodes them, bounded by the steps asked for)."""
    data = bytes(data)
    if len(data) > max_bytes:
        raise ValueError(f"seed-log download of {len(data)} bytes exceeds {max_bytes}")
    if len(data) < _PREAMBLE.size:
        raise ValueError(f"seed-log download too short ({len(data)} bytes)")
    magic, version, head_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a seed-log download (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ValueError(f"seed-log download format {version} is not supported "
                         f"(this is {FORMAT_VERSION})")
    if head_len > MAX_HEADER or _PREAMBLE.size + head_len > len(data):
        raise ValueError(f"seed-log download header length {head_len} exceeds the data")
    try:
        header = json.loads(data[_PREAMBLE.size:_PREAMBLE.size + head_len].decode(),
                            parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"seed-log download header is not JSON: {type(err).__name__}"
                         ) from None
    if not isinstance(header, dict) or not isinstance(header.get("block"), str):
        raise ValueError("seed-log download header is not an object naming a block")
    base_version = _int(header.get("base_version"), "base_version", 0)
    base_checksum = header.get("base_checksum")
    if not isinstance(base_checksum, str) or not (
            base_checksum == "" if base_version == 0 else _HEX64.fullmatch(base_checksum)):
        raise ValueError(f"seed-log download: base_checksum {base_checksum!r:.80} does not fit "
                         f"base version {base_version}")
    raw = header.get("installs")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_INSTALLS:
        raise ValueError(f"seed-log download: installs must be a list of 1..{MAX_INSTALLS}")
    body = memoryview(data)[_PREAMBLE.size + head_len:]
    at, last = 0, base_version
    installs = []
    for index, entry in enumerate(raw):
        what = f"install {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"seed-log download: {what} is not an object")
        version = _int(entry.get("version"), f"{what} version", last + 1)
        checksum = entry.get("checksum")
        if not isinstance(checksum, str) or not _HEX64.fullmatch(checksum):
            raise ValueError(f"seed-log download: {what} checksum is not a hex digest")
        weights, sizes = entry.get("weights"), entry.get("logs")
        if (not isinstance(weights, list) or not isinstance(sizes, list)
                or not 1 <= len(sizes) <= MAX_LOGS or len(weights) != len(sizes)):
            raise ValueError(f"seed-log download: {what} needs 1..{MAX_LOGS} logs, one weight "
                             "each")
        logs = []
        for size in sizes:
            length = _int(size, f"{what} log length", 1)
            if at + length > len(body):
                raise ValueError(f"seed-log download: {what}'s logs run past the data")
            logs.append(bytes(body[at:at + length]))
            at += length
        installs.append(LoggedInstall(
            version, checksum, _positive(entry.get("size"), f"{what} size"),
            tuple(_positive(w, f"{what} weight") for w in weights), tuple(logs)))
        last = version
    if at != len(body):
        raise ValueError(f"seed-log download has {len(body) - at} bytes after its logs")
    return LogChain(header["block"], base_version, base_checksum, tuple(installs))


def read_log(chain: LogChain, encoded: bytes, *, max_steps: int) -> SeedLog:
    """One step log of ``chain``, decoded (none replayed): ``ValueError`` if it is malformed,
    holds more than ``max_steps`` steps or is a log of another block. Reading a chain's logs
    first tells a node the replay's cost before it does any of it."""
    log = decode_seedlog(encoded, max_steps=max_steps)
    if log.block != chain.block:
        raise ValueError(f"seed-log download for block '{chain.block}' holds a log of "
                         f"'{log.block[:64]}'")
    return log


def replay_chain(start: Mapping[str, torch.Tensor], chain: LogChain,
                 logs: Sequence[Sequence[SeedLog]], layout: Sequence[Sequence[str]], *,
                 device: torch.device | str = "cpu") -> Tensors:
    """The block's newest version, rebuilt from ``start`` (its ``base_version``) through every
    install of ``chain``, whose logs ``logs`` holds decoded (:func:`read_log`), install by
    install; ``ValueError`` if a log does not fit the block or a rebuilt version's checksum
    differs from the chain's."""
    if [len(x) for x in logs] != [len(i.logs) for i in chain.installs]:
        raise ValueError(f"block '{chain.block}': the decoded logs do not match the chain")
    current: Tensors = dict(start)
    for install, decoded in zip(chain.installs, logs, strict=True):
        replays = [replay(current, log, layout, device=device) for log in decoded]
        current = rebuild(current, list(zip(install.weights, replays, strict=True)),
                          install.size)
        got = content_checksum(current)
        if got != install.checksum:
            raise ValueError(f"block '{chain.block}' rebuilt from step logs at version "
                             f"{install.version} has checksum {got[:12]}, the server's is "
                             f"{install.checksum[:12]} (z or arithmetic differ here)")
    return current


def _reject_constant(name: str) -> Any:
    raise ValueError(f"seed-log download header holds {name}")
