"""The model a client process keeps between messages, switched to a node's cached blocks.

Loading the model costs seconds, so each client process loads it once and, for every message,
brings each block to the version the node's cache holds. Going back to a block's pretrained
tensors reads just that block from the model's safetensors files (memory-mapped), so the client
never holds a second copy of the model; models built in memory (tiny test models) keep a copy of
each block the first time it is overwritten instead.

With ``frozen-dtype``/``frozen-quant`` the model holds every block but the round's in a frozen
form (:mod:`fedcybgd.model.precision`); exact fp32 tensors of a block always come from the cache
or the pretrained weights (:meth:`ClientModel.exact`), and that is what delta downloads are
decoded against and what the trained block is rebuilt from.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedTokenizerBase

from fedcybgd.client.store import BlockStore
from fedcybgd.compression import CodecError
from fedcybgd.core.checksum import content_checksum
from fedcybgd.core.measure import release_freed
from fedcybgd.memory.estimate import ModelShape
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.devices import to_cpu
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer, read_tensors, safetensors_index
from fedcybgd.model.precision import FrozenBlocks, Precision
from fedcybgd.protocol import Holding


class ClientModel:
    """A loaded model plus the version of each block it currently contains.

    Parameters
    ----------
    name, layers_per_block
        The model and its block partition.
    device : torch.device
        Where the model computes (the client's resolved ``device``).
    precision : Precision
        How blocks other than the trained one are held (``frozen-dtype``, ``frozen-quant``).
        With a lossy form, :meth:`train_block` makes the round's block fp32 again from its
        exact tensors (the node's cache or the pretrained files), never from the frozen copy,
        and :meth:`exact` is what delta downloads are decoded against.
    """

    def __init__(self, name: str, layers_per_block: int,
                 device: torch.device | str = "cpu", precision: Precision | None = None) -> None:
        self.name = name
        self.device = torch.device(device)
        self.precision = precision or Precision()
        self.model = load_model(name)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.stack = LayerStack(self.model)  # verified in fp32 on the CPU, before any change
        self.blocks = BlockMap(self.model, layers_per_block)
        self.base_hash = content_checksum(dict(self.model.named_parameters()))
        self._shapes = {b: self.blocks.shapes(self.model, b) for b in self.blocks.names}
        self.shape = ModelShape.of(self.model, self.blocks)  # read in fp32, before freezing
        self._weight_files = safetensors_index(name)
        self._pristine: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: dict[str, Holding] = {}  # absent: pretrained
        self.frozen: FrozenBlocks | None = None
        self.trained: str | None = None  # the block in fp32 form when frozen blocks are not
        if not self.precision.full:
            self.frozen = FrozenBlocks(self.model, self.blocks, self.precision, self.device)
            for block in self.blocks.names:
                tensors = self.blocks.get(self.model, block)
                if not self._has_files(block):
                    self._pristine[block] = tensors  # nowhere else to get exact v0 back from
                self.frozen.freeze(block, tensors)
            self.frozen.place(self.device)
            release_freed()
        elif self.device.type != "cpu":
            self.model.to(self.device)  # type: ignore[arg-type]  # transformers types .to oddly

    def _has_files(self, block: str) -> bool:
        names = self.blocks.info(block).param_names
        return bool(self._weight_files) and all(n in self._weight_files for n in names)

    def _lossy(self, block: str) -> bool:
        """Whether the model holds ``block`` in a frozen (not exact fp32) form."""
        return self.frozen is not None and self.frozen.is_frozen(block)

    def _remember_pristine(self, block: str) -> None:
        if block in self._pristine or self._has_files(block) or self._lossy(block):
            return
        self._pristine[block] = to_cpu(self.blocks.get(self.model, block))

    def shapes(self, block: str) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape in ``block`` (as fp32 parameters; frozen forms differ)."""
        return self._shapes[block]

    def pretrained(self, block: str) -> dict[str, torch.Tensor]:
        """The block's pretrained fp32 tensors, on the CPU (read from disk where the model came
        from a folder)."""
        if block in self._pristine:
            return self._pristine[block]
        if block not in self._loaded and not self._lossy(block):
            return to_cpu(self.blocks.get(self.model, block))  # the model still holds v0
        return read_tensors(self._weight_files, self.blocks.info(block).param_names)

    def exact(self, block: str, store: BlockStore) -> dict[str, torch.Tensor]:
        """The exact fp32 tensors, on the CPU, of the version of ``block`` installed now.

        Where the model holds the block frozen, they come from where that version came from
        (``store`` or the pretrained weights), never from the frozen copy.

        Raises
        ------
        CodecError
            The cache lost the file (it then no longer lists the block; the server resyncs).
        """
        if not self._lossy(block):
            return to_cpu(self.blocks.get(self.model, block))
        if block not in self._loaded:
            return self.pretrained(block)
        tensors = store.load(block)
        if tensors is None or store.holdings.get(block) != self._loaded[block]:
            raise CodecError(f"block '{block}': its exact tensors are gone from the cache")
        return tensors

    def _install(self, block: str, tensors: dict[str, torch.Tensor]) -> None:
        if self._lossy(block):
            assert self.frozen is not None
            self.frozen.freeze(block, tensors)
        else:
            self.blocks.set(self.model, block, tensors)

    def set_block(self, block: str, tensors: dict[str, torch.Tensor], holding: Holding) -> None:
        """Write a block version into the model (``tensors``: exact fp32)."""
        self._remember_pristine(block)
        self._install(block, tensors)
        self._loaded[block] = holding

    def reset_block(self, block: str) -> None:
        """Put a block back to its pretrained tensors."""
        if block in self._loaded:
            pretrained = self.pretrained(block)
            del self._loaded[block]
            self._install(block, pretrained)

    def sync(self, store: BlockStore) -> None:
        """Make the model hold exactly what ``store`` holds (pretrained elsewhere)."""
        for block in self.blocks.names:
            want = store.holdings.get(block)
            if want == self._loaded.get(block):
                continue
            tensors = store.load(block) if want is not None else None
            if tensors is None:
                self.reset_block(block)
            else:
                self.set_block(block, tensors, want)  # type: ignore[arg-type]

    def train_block(self, block: str, store: BlockStore) -> None:
        """Make ``block`` trainable fp32 and every other block frozen (a no-op in fp32).

        The block trained before goes back to its frozen form from its fp32 tensors (the round
        left its start there); the new one is rebuilt from :meth:`exact`.
        """
        if self.frozen is None or self.trained == block:
            return
        if self.trained is not None:
            previous = to_cpu(self.blocks.get(self.model, self.trained))
            self.frozen.freeze(self.trained, previous)
            self.trained = None
        exact = self.exact(block, store)
        self.frozen.thaw(block, exact)
        self.trained = block


@functools.lru_cache(maxsize=4)
def client_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The process's tokenizer for ``name`` (loaded once per process)."""
    return load_tokenizer(name)


@functools.lru_cache(maxsize=2)
def client_model(name: str, layers_per_block: int, device: str = "cpu",
                 precision: Precision | None = None) -> ClientModel:
    """The process's model for ``name`` on ``device`` (loaded once per process)."""
    return ClientModel(name, layers_per_block, device, precision)

