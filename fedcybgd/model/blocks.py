"""Cut a decoder-only Hugging Face causal LM into named blocks and move their tensors.

Blocks, in model order:

* ``embed``: the parameters outside the decoder layers that the first layer's input is
  computed from: token and learned position embeddings, an input projection (OPT-350m's
  ``project_in``), an embedding norm. Found from the autograd graph of a short forward, not from
  module types (see :func:`params_before_layers`). A tied LM head shares the token embedding's
  tensor, so it lives here only. An embedding scale (Gemma) is a buffer, not a parameter.
* ``layer.{a}`` or ``layer.{a}-{b}``: decoder layers ``a..b`` (``layers-per-block`` of them).
* ``head``: everything else outside the layers: the final norm, plus the LM head when it is
  not tied (and e.g. OPT's ``project_out`` when present).

Encoder-decoder models and models without one list of decoder layers are refused
(:class:`UnsupportedModelError`) when the map is built.

Parameter names are the model's own ``named_parameters()`` names with duplicates removed, so a
tied weight is listed (and counted, and sent) exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

EMBED = "embed"
HEAD = "head"


class UnsupportedModelError(ValueError):
    """A model this package cannot cut into blocks or run layer by layer exactly.

    Raised when a :class:`BlockMap` or a :class:`fedcybgd.model.layerwise.LayerStack` is built, so a
    model is refused at start, never trained block by block as a different function.
    """


def family_name(model: nn.Module) -> str:
    """``ClassName (model_type 'x')``: how refusals name a model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    kind = type(model).__name__
    return f"{kind} (model_type '{model_type}')" if model_type else kind


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack under a causal LM's head (``model.model``, ``model.transformer``...).

    It is the causal LM's child that holds the decoder layers (the first part of their dotted
    name), which is the child under ``base_model_prefix`` in every family seen so far.

    Raises
    ------
    UnsupportedModelError
        As :func:`find_layers`, or the layers are not under a child (a bare decoder stack
        without an LM head).
    """
    layers_name, _ = find_layers(model)
    if "." not in layers_name:
        raise UnsupportedModelError(
            f"{family_name(model)} holds its decoder layers directly ({layers_name!r}); "
            "expected a Hugging Face *ForCausalLM model with an LM head"
        )
    return model.get_submodule(layers_name.split(".", 1)[0])


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return the dotted name and the ``ModuleList`` holding the decoder layers.

    Encoder-decoder models are refused here, so every entry point refuses them.

    The decoder stack is the outermost ``ModuleList`` whose length is
    ``config.num_hidden_layers``; this holds for Llama, Qwen2/3, Mistral, Gemma2/3, Phi3, GPT-2,
    OPT, GPT-NeoX and most other causal LMs. Lists nested in another candidate (e.g. a layer's
    experts, when their count happens to equal the layer count) do not count.

    Raises
    ------
    UnsupportedModelError
        No such list, or several unrelated ones (which one the forward chains is unknown).
    """
    config = getattr(model, "config", None)
    want = getattr(config, "num_hidden_layers", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{family_name(model)} is an encoder-decoder model; only decoder-only causal LMs "
            "can be trained block by block"
        )
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
        and (want is None or len(module) == want)
    ]
    outer = [
        (name, module) for name, module in found
        if not any(other != name and name.startswith(other + ".") for other, _ in found)
    ]
    if not outer:
        raise UnsupportedModelError(
            f"cannot find the decoder layers of {family_name(model)}: no nn.ModuleList of "
            f"length num_hidden_layers={want}"
        )
    if len(outer) > 1:
        raise UnsupportedModelError(
            f"{family_name(model)} has several lists of num_hidden_layers={want} modules "
            f"({[name for name, _ in outer]}); cannot tell which are the decoder layers"
        )
    return outer[0]


class _StopAtFirstLayer(Exception):
    """Raised by a pre-hook once the first decoder layer's input exists."""


def params_before_layers(model: nn.Module) -> set[str]:
    """Names of the parameters outside the decoder layers that the first layer's input uses.

    Found from the autograd graph of one short forward stopped at the first layer, so it
    covers whatever a family does before its layers: token and learned position embeddings,
    an input projection (OPT's ``project_in``), an embedding norm. An embedding scale is a
    buffer, not a parameter. No backward runs (a dense gradient of the embedding matrix would
    cost its full size).
    """
    base = base_model(model)
    layers_name, layers = find_layers(model)
    prefix = layers_name + "."
    outside = {
        name: p for name, p in model.named_parameters() if not name.startswith(prefix)
    }
    by_id = {id(p): name for name, p in outside.items()}
    # Any parameter tells the device: a model is not split over devices here.
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    captured: list[torch.Tensor] = []

    def stop(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        states = args[0] if args else kwargs.get("hidden_states")
        if isinstance(states, torch.Tensor):
            captured.append(states)
        raise _StopAtFirstLayer

    flags = {name: p.requires_grad for name, p in outside.items()}
    handle = layers[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        for p in outside.values():
            if p.is_floating_point() or p.is_complex():  # integer tensors cannot carry grad
                p.requires_grad_(True)
        # The graph is what tells the parameters apart, so grad must be on even if the caller
        # turned it off.
        with torch.inference_mode(False), torch.enable_grad():
            ids = torch.ones(1, 2, dtype=torch.long, device=device)
            base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except _StopAtFirstLayer:
        pass
    finally:
        handle.remove()
        for name, p in outside.items():
            p.requires_grad_(flags[name])
    if not captured:
        raise UnsupportedModelError(
            f"{family_name(model)}: the forward never reached its first decoder layer with "
            "positional hidden states"
        )
    found: set[str] = set()
    seen: set[int] = set()
    stack = [captured[0].grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf parameter
        if variable is not None and id(variable) in by_id:
            found.add(by_id[id(variable)])
        stack.extend(next_node for next_node, _ in node.next_functions)
    if not found:
        raise UnsupportedModelError(
            f"{family_name(model)}: the first decoder layer's input depends on no parameter "
            "outside the layers; cannot tell which parameters are the embeddings"
        )
    return found


def layer_block_name(start: int, end: int) -> str:
    """Name of the block holding decoder layers ``start..end`` (inclusive)."""
    return f"layer.{start}" if start == end else f"layer.{start}-{end}"


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
        The model to partition. Its structure is read, and one two-token forward up to the first
        decoder layer tells the embedding parameters apart (weights are not changed).
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

        # embed: whatever the first layer's input is computed from (embeddings, learned
        # positions, an input projection); head: the rest outside the layers (final norm,
        # output projection, an untied LM head).
        embedding_params = params_before_layers(model)

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
