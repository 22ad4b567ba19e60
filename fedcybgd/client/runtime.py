"""The model a client process keeps between messages, switched to a node's cached blocks.

Loading the model costs seconds, so each client process loads it once and, for every message,
brings each block to the version the node's cache holds. Going back to a block's pretrained
tensors reads just that block from the model's safetensors files (memory-mapped), so the client
never holds a second copy of the model; models built in memory (tiny test models) keep a copy of
each block the first time it is overwritten instead.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedTokenizerBase

from fedcybgd.checksum import content_checksum
from fedcybgd.client.store import BlockStore
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer, read_tensors, safetensors_index
from fedcybgd.protocol import Holding


class ClientModel:
    """A loaded model plus the version of each block it currently contains."""

    def __init__(self, name: str, layers_per_block: int) -> None:
        self.name = name
        self.model = load_model(name)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.stack = LayerStack(self.model)
        self.blocks = BlockMap(self.model, layers_per_block)
        self.base_hash = content_checksum(dict(self.model.named_parameters()))
        self._weight_files = safetensors_index(name)
        self._pristine: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: dict[str, Holding] = {}  # absent: pretrained

    def _remember_pristine(self, block: str) -> None:
        names = self.blocks.info(block).param_names
        if block in self._pristine or (
            self._weight_files and all(n in self._weight_files for n in names)
        ):
            return
        self._pristine[block] = self.blocks.get(self.model, block)

    def pretrained(self, block: str) -> dict[str, torch.Tensor]:
        """The block's pretrained tensors (read from disk where the model came from a folder)."""
        if block in self._pristine:
            return self._pristine[block]
        if block not in self._loaded:
            return self.blocks.get(self.model, block)  # the model still holds version 0
        return read_tensors(self._weight_files, self.blocks.info(block).param_names)

    def set_block(self, block: str, tensors: dict[str, torch.Tensor], holding: Holding) -> None:
        """Write a block version into the model."""
        self._remember_pristine(block)
        self.blocks.set(self.model, block, tensors)
        self._loaded[block] = holding

    def reset_block(self, block: str) -> None:
        """Put a block back to its pretrained tensors."""
        if block in self._loaded:
            self.blocks.set(self.model, block, self.pretrained(block))
            del self._loaded[block]

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


@functools.lru_cache(maxsize=4)
def client_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The process's tokenizer for ``name`` (loaded once per process)."""
    return load_tokenizer(name)


@functools.lru_cache(maxsize=2)
def client_model(name: str, layers_per_block: int) -> ClientModel:
    """The process's model for ``name`` (loaded once per process)."""
    return ClientModel(name, layers_per_block)

