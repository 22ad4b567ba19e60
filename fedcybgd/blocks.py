"""Cut a decoder-only Hugging Face causal LM into named blocks and move their tensors.

Blocks, in model order:

* ``embed``: every ``nn.Embedding`` outside the decoder layers (token and learned position
  embeddings). A tied LM head shares the token embedding's tensor, so it lives here only.
* ``layer.{a}`` or ``layer.{a}-{b}``: decoder layers ``a..b`` (``layers-per-block`` of them).
* ``head``: everything else outside the layers: the final norm, plus the LM head when it is
  not tied (and e.g. OPT's ``project_out`` when present).

Parameter names are the model's own ``named_parameters()`` names with duplicates removed, so a
tied weight is listed (and counted, and sent) exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

EMBED = "embed"
HEAD = "head"
_LAYER_RE = re.compile(r"^layer\.(\d+)(?:-(\d+))?$")


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return the dotted name and the ``ModuleList`` holding the decoder layers.

    The decoder stack is the ``ModuleList`` whose length is ``config.num_hidden_layers``; this
    holds for Llama, Qwen2, Mistral, GPT-2, OPT, GPT-NeoX and most other causal LMs.
    """
    config = getattr(model, "config", None)
    want = getattr(config, "num_hidden_layers", None)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and (want is None or len(module) == want)
    ]
    if not found:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: no nn.ModuleList of "
            f"length num_hidden_layers={want}"
        )
    return found[0]


def layer_block_name(start: int, end: int) -> str:
    """Name of the block holding decoder layers ``start..end`` (inclusive)."""
    return f"layer.{start}" if start == end else f"layer.{start}-{end}"


def parse_layer_block(name: str) -> tuple[int, int] | None:
    """Inverse of :func:`layer_block_name`; ``None`` for ``embed``/``head``."""
    match = _LAYER_RE.match(name)
    if match is None:
        return None
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) is not None else start
    return start, end


@dataclass(frozen=True)
class BlockInfo:
    """One block: its name, the parameter names it owns and, for layer blocks, their range."""

    name: str
    param_names: tuple[str, ...]
    layers: tuple[int, int] | None  # inclusive layer range, None for embed/head
    numel: int


class BlockMap:
    """The block partition of one model architecture.

    Parameters
    ----------
    model : PreTrainedModel
        The model to partition. Only its structure is read.
    layers_per_block : int
        Decoder layers grouped into one block (the last block may hold fewer).
    """

    def __init__(self, model: PreTrainedModel | nn.Module, layers_per_block: int = 1) -> None:
        if layers_per_block < 1:
            raise ValueError(f"layers-per-block must be >= 1, got {layers_per_block}")
        self.layers_per_block = layers_per_block
        self.layers_name, layers = find_layers(model)
        self.num_layers = len(layers)
        prefix = self.layers_name + "."

        embedding_params: set[str] = set()
        for mod_name, module in model.named_modules():
            if isinstance(module, nn.Embedding) and not mod_name.startswith(prefix):
                embedding_params.update(
                    f"{mod_name}.{p}" if mod_name else p
                    for p, _ in module.named_parameters(recurse=False)
                )

        groups: dict[str, list[str]] = {EMBED: []}
        ranges: dict[str, tuple[int, int]] = {}
        for start in range(0, self.num_layers, layers_per_block):
            end = min(start + layers_per_block, self.num_layers) - 1
            groups[layer_block_name(start, end)] = []
            ranges[layer_block_name(start, end)] = (start, end)
        groups[HEAD] = []

        sizes: dict[str, int] = {name: 0 for name in groups}
        self._owner: dict[str, str] = {}
        # named_parameters() drops duplicates: a tied head weight appears once, as the embedding.
        for pname, param in model.named_parameters():
            if pname.startswith(prefix):
                index = int(pname[len(prefix):].split(".", 1)[0])
                start = (index // layers_per_block) * layers_per_block
                end = min(start + layers_per_block, self.num_layers) - 1
                block = layer_block_name(start, end)
            elif pname in embedding_params:
                block = EMBED
            else:
                block = HEAD
            groups[block].append(pname)
            sizes[block] += param.numel()
            self._owner[pname] = block

        self.blocks: dict[str, BlockInfo] = {
            name: BlockInfo(name, tuple(pnames), ranges.get(name), sizes[name])
            for name, pnames in groups.items()
            if pnames
        }
        output = getattr(model, "get_output_embeddings", lambda: None)()
        inputs = getattr(model, "get_input_embeddings", lambda: None)()
        self.tied = bool(
            output is not None and inputs is not None and output.weight is inputs.weight
        )

    @property
    def names(self) -> list[str]:
        """All block names, in model order (embed, layers bottom-up, head)."""
        return list(self.blocks)

    def cycle(self, train_embeddings: bool, train_head: bool) -> list[str]:
        """The blocks a FedCyBGD cycle trains, in model order."""
        return [
            name
            for name in self.blocks
            if (name != EMBED or train_embeddings) and (name != HEAD or train_head)
        ]

    def info(self, block: str) -> BlockInfo:
        """Describe ``block``; ``KeyError`` naming the known blocks if it does not exist."""
        try:
            return self.blocks[block]
        except KeyError:
            raise KeyError(f"unknown block '{block}'; this model has {self.names}") from None

    def block_of(self, param_name: str) -> str:
        """The block owning parameter ``param_name``."""
        return self._owner[param_name]

    def get(self, model: nn.Module, block: str) -> dict[str, torch.Tensor]:
        """Detached copies of the block's tensors, keyed by parameter name."""
        params = dict(model.named_parameters())
        return {name: params[name].detach().clone() for name in self.info(block).param_names}

    def set(self, model: nn.Module, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into the block's parameters in place.

        Names must match the block exactly and shapes must agree; nothing is written unless
        everything checks out, so a bad payload never leaves a half-updated block.
        """
        info = self.info(block)
        expected = set(info.param_names)
        got = set(tensors)
        if got != expected:
            missing = sorted(expected - got)
            extra = sorted(got - expected)
            raise ValueError(f"block '{block}': missing tensors {missing}, unexpected {extra}")
        params = dict(model.named_parameters())
        for name in info.param_names:
            if tuple(tensors[name].shape) != tuple(params[name].shape):
                raise ValueError(
                    f"block '{block}': tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                    f"the model expects {tuple(params[name].shape)}"
                )
        with torch.no_grad():
            for name in info.param_names:
                params[name].copy_(tensors[name])

    def parameters(self, model: nn.Module, block: str) -> list[nn.Parameter]:
        """The live parameters of ``block`` (for an optimizer)."""
        params = dict(model.named_parameters())
        return [params[name] for name in self.info(block).param_names]

    def shapes(self, model: nn.Module, block: str) -> dict[str, tuple[int, ...]]:
        """Expected shape of each tensor of ``block``."""
        params = dict(model.named_parameters())
        return {name: tuple(params[name].shape) for name in self.info(block).param_names}

    def lowest_layer_of(self, block: str) -> int:
        """First decoder layer of ``block`` (``embed``: -1, ``head``: the layer count)."""
        return self.lowest_layer([block])

    def lowest_layer(self, blocks: Iterable[str]) -> int:
        """First decoder layer touched by any of ``blocks`` (``embed`` counts as -1)."""
        lowest = self.num_layers
        for block in blocks:
            info = self.info(block)
            if info.name == EMBED:
                return -1
            if info.layers is not None:
                lowest = min(lowest, info.layers[0])
        return lowest
