"""Block versions and delta bases: what each block of the global model is, and was.

A block's version is the round it last changed (0: pretrained), identified on the wire by a
:class:`fedcybgd.protocol.Holding` (version and content checksum). Downloads are deltas against
a base the node already holds exactly, so the server keeps, per block, the pretrained tensors
(read back from the model's files, or copied before the block is first overwritten) and the
last ``history`` exact versions it replaced. The payloads of a block's last ``chain`` installs
(each a low-bit delta that makes the version before into the installed one exactly) are kept
in order, so a node that missed several installs is sent them one after another
(:meth:`BlockVersions.install_chain`). Installs made from step logs alone are kept as
those logs (:class:`fedcybgd.protocol.seedsync.LoggedInstall`, the newest run of them per block),
for seed-log downloads; they are not checkpointed (a resumed server sends weights until new logs
accumulate).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedcybgd.compression import read_header
from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.blocks import BlockMap
from fedcybgd.protocol import Holding
from fedcybgd.protocol.seedsync import MAX_INSTALLS, LogChain, LoggedInstall

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class InstallStep:
    """One install of a block made through a payload: the holding it started from (``None``:
    pretrained), the one it made and the payload that makes the first into the second."""

    start: Holding | None
    target: Holding
    payload: bytes


def _copy(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    return {k: v.detach().clone() for k, v in tensors.items()}


class BlockVersions:
    """The global weights by block, with each block's version, checksum and past versions.

    Parameters
    ----------
    block_map : BlockMap
        The model's blocks.
    weights : dict[str, torch.Tensor]
        The global weights by parameter name, updated in place by :meth:`install`.
    pretrained : Callable[[str], dict[str, torch.Tensor]], optional
        Reads a block's pretrained tensors; without it a copy is kept before the block is
        first overwritten.
    history : int
        Past exact versions kept per block as delta bases (0: only the pretrained one).
    chain : int
        Installs per block whose payloads are kept to be sent one after another (>= 1).
    """

    def __init__(self, block_map: BlockMap, weights: dict[str, torch.Tensor],
                 pretrained: Callable[[str], Tensors] | None = None, history: int = 2,
                 chain: int = 1) -> None:
        if history < 0:
            raise ValueError(f"version-history must be >= 0, got {history}")
        if chain < 1:
            raise ValueError(f"install-chain must be >= 1, got {chain}")
        self.block_map = block_map
        self.weights = weights
        self.history = history
        self.chain = chain
        self.versions: dict[str, int] = {name: 0 for name in block_map.names}
        self.checksums: dict[str, str] = {}  # block -> checksum of its current (version > 0)
        self._read_pretrained = pretrained
        self._pristine: dict[str, Tensors] = {}
        self._kept: dict[str, dict[Holding, Tensors]] = {}
        # block -> its last installs made through payloads, oldest first, unbroken
        self._installed_via: dict[str, list[InstallStep]] = {}
        self.install_rounds: dict[str, list[int]] = {}  # block -> the rounds it changed in
        # block -> the newest installs made from step logs alone, each with what it started from
        self._logged: dict[str, list[tuple[Holding | None, LoggedInstall]]] = {}

    def tensors(self, block: str) -> Tensors:
        """The global tensors of ``block`` (views, not copies)."""
        return {name: self.weights[name] for name in self.block_map.info(block).param_names}

    def current(self, block: str) -> Holding | None:
        """The global version of ``block`` as a holding (``None`` while pretrained)."""
        version = self.versions[block]
        return Holding(version, self.checksums[block]) if version else None

    def pretrained(self, block: str) -> Tensors:
        """Version 0 of ``block``: what every node has without downloading anything."""
        if block in self._pristine:
            return self._pristine[block]
        if self._read_pretrained is not None:
            return self._read_pretrained(block)
        return self.tensors(block)  # never overwritten yet: still pretrained

    def base_for(self, block: str, held: Holding | None) -> tuple[int, Tensors]:
        """The best delta base a node has: its exact held version if we kept it, else v0."""
        if held is not None:
            if held == self.current(block):
                return held.version, self.tensors(block)
            kept = self._kept.get(block, {}).get(held)
            if kept is not None:
                return held.version, kept
        return 0, self.pretrained(block)

    def _keep_current(self, block: str) -> None:
        """Copy what ``block`` is now before it is overwritten, if it may serve as a base."""
        previous = self.current(block)
        if previous is None:
            if self._read_pretrained is None and block not in self._pristine:
                self._pristine[block] = _copy(self.tensors(block))
        elif self.history:
            kept = self._kept.setdefault(block, {})
            kept[previous] = _copy(self.tensors(block))
            while len(kept) > self.history:
                del kept[min(kept, key=lambda h: h.version)]

    def install(self, block: str, tensors: Mapping[str, torch.Tensor], version: int,
                payload: bytes | None = None, logged: LoggedInstall | None = None) -> None:
        """Make ``tensors`` the global ``block`` at ``version`` (the round); the replaced
        version is kept as a delta base. ``payload``: a delta that decodes the replaced
        version into exactly ``tensors`` (:mod:`~fedcybgd.strategies.quantized_install`, or a
        self-synced node's upload), sent as it is to nodes holding that version
        (:meth:`install_chain`); kept only when its header says so. ``logged``:
        the step logs that rebuild ``tensors`` from the replaced version (:meth:`log_chain`);
        an install without them ends the block's run of logged installs."""
        previous = self.current(block)
        self._keep_current(block)
        steps = self._installed_via.pop(block, [])
        if steps and steps[-1].target != previous:
            steps = []  # (restored deltas that end elsewhere): a chain never skips a version
        if logged is None:
            self._logged.pop(block, None)
        else:
            chain = self._logged.setdefault(block, [])
            chain.append((previous, logged))
            del chain[:-MAX_INSTALLS]
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.weights[name].copy_(tensor)
        self.versions[block] = version
        self.checksums[block] = content_checksum(self.tensors(block))
        self.install_rounds.setdefault(block, []).append(version)
        current = self.current(block)
        assert current is not None
        if payload is not None and self._makes(payload, block, previous, current):
            steps.append(InstallStep(previous, current, payload))
            self._installed_via[block] = steps[-self.chain:]
        # (an install without such a payload breaks the chain)

    @staticmethod
    def _makes(payload: bytes, block: str, start: Holding | None, target: Holding) -> bool:
        """Whether ``payload``'s header says it makes ``start`` into ``target`` of ``block``
        (a delta or xor payload; a node's decode checks the bytes against both checksums)."""
        header = read_header(payload, max_bytes=len(payload))
        return (header.block == block and header.base_checksum is not None
                and header.base_version == (start.version if start else 0)
                and (start is None or header.base_checksum == start.checksum)
                and header.target_version == target.version
                and header.checksum == target.checksum)

    def lag(self, block: str, held: Holding | None) -> int:
        """How many installs of ``block`` a node holding ``held`` (``None``: pretrained) is
        behind the current version."""
        since = held.version if held is not None else 0
        return sum(1 for r in self.install_rounds.get(block, []) if r > since)

    def install_chain(self, block: str, held: Holding | None) -> list[bytes] | None:
        """The payloads that make ``held`` into ``block``'s current version exactly, in the
        order to apply them, when every install since ``held`` was made through one and is
        still kept (``None`` otherwise, or when ``held`` is current)."""
        steps = self._installed_via.get(block, [])
        if not steps or steps[-1].target != self.current(block):
            return None
        for index, step in enumerate(steps):
            if step.start == held:
                return [s.payload for s in steps[index:]]
        return None

    def log_chain(self, block: str, held: Holding | None) -> LogChain | None:
        """The logged installs that take ``held`` (``None``: pretrained) to ``block``'s current
        version, when every install since ``held`` was logged (``None`` otherwise)."""
        chain = self._logged.get(block, [])
        for index, (start, _) in enumerate(chain):
            if start == held:
                return LogChain(block, held.version if held else 0,
                                held.checksum if held else "",
                                tuple(install for _, install in chain[index:]))
        return None

    def install_payloads(self) -> dict[str, list[bytes]]:
        """Block -> the payloads of its kept installs, oldest first (checkpointed, so a resumed
        server sends nodes what the uninterrupted one would)."""
        return {block: [step.payload for step in steps]
                for block, steps in self._installed_via.items()}

    def restore_install_payloads(self, block: str, payloads: list[bytes]) -> None:
        """Put back an :meth:`install_payloads` entry: each payload's header names the holding
        it starts from (version 0: the pretrained block) and the one it makes, and each must
        start where the one before ends."""
        steps: list[InstallStep] = []
        for payload in payloads:
            header = read_header(payload, max_bytes=len(payload))
            if header.block != block or header.base_checksum is None:
                raise ValueError(f"checkpointed install payload of block {block} is for block "
                                 f"{header.block!r} with base {header.base_checksum!r}")
            start = (Holding(header.base_version, header.base_checksum)
                     if header.base_version else None)
            if steps and start != steps[-1].target:
                raise ValueError(f"checkpointed install payloads of block {block} do not "
                                 f"follow each other (version {header.base_version} after "
                                 f"{steps[-1].target.version})")
            steps.append(InstallStep(start, Holding(header.target_version, header.checksum),
                                     payload))
        self._installed_via[block] = steps[-self.chain:]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every global weight from ``state`` (versions stay as they are)."""
        if missing := set(self.weights) - set(state):
            raise ValueError(f"initial arrays lack parameters {sorted(missing)[:5]} ...")
        with torch.no_grad():
            for name, tensor in self.weights.items():
                tensor.copy_(state[name])

    def install_checkpoint(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put a checkpointed block into the weights (before :meth:`load_state`, which sets
        its version). Its pretrained tensors are kept first when no reader can bring them
        back, since deltas to nodes are taken against them."""
        if self._read_pretrained is None and block not in self._pristine:
            self._pristine[block] = _copy(self.tensors(block))
        target = self.tensors(block)
        if set(tensors) != set(target):
            raise ValueError(f"checkpoint of block '{block}' has tensors {sorted(tensors)}")
        with torch.no_grad():
            for name, tensor in target.items():
                tensor.copy_(tensors[name])

    def state(self) -> dict[str, Any]:
        """JSON-able versions and checksums (the tensors are checkpointed by the server)."""
        return {"versions": dict(self.versions), "checksums": dict(self.checksums),
                "install_rounds": {b: list(r) for b, r in self.install_rounds.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output."""
        self.versions.update({k: int(v) for k, v in state["versions"].items()})
        self.checksums = {k: str(v) for k, v in state["checksums"].items()}
        # (checkpoints from before install_rounds existed: one install per changed block)
        rounds = state.get("install_rounds") or {b: [v] for b, v in self.versions.items() if v}
        self.install_rounds = {str(b): [int(r) for r in rs] for b, rs in rounds.items()}
