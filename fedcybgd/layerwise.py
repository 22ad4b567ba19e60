"""Run a causal LM piece by piece: embeddings, any range of decoder layers, final norm + head.

Block-wise training needs to stop at a layer (ZeroLock never runs the layers above its block),
start at a layer (a cached prefix is reused across steps), and apply the LM head only where a
loss is taken (vocabulary-sized logits for every token would dwarf a block's memory).

The model's own forward computes what every decoder layer receives besides the hidden states
(rotary position embeddings, attention masks, position ids). We run it once up to the first
layer, capture those inputs with a pre-hook and stop; every layer of these families receives the
same extra inputs, so the captured ones drive any layer range. A test checks, per family, that
the pieces chained together equal the model's own logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from fedcybgd.blocks import find_layers

_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


class _StopForward(Exception):
    """Raised by the capture hook once the first layer's inputs are known."""


@dataclass
class Hidden:
    """Hidden states between two layers, plus the extra inputs every layer receives."""

    states: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def with_states(self, states: torch.Tensor) -> Hidden:
        """Same extra inputs, new hidden states."""
        return Hidden(states, self.args, self.kwargs)

    def detach(self) -> Hidden:
        """Detach the hidden states (the extra inputs never carry grad)."""
        return self.with_states(self.states.detach())


class LayerStack:
    """Piecewise access to a Hugging Face causal LM.

    Parameters
    ----------
    model : PreTrainedModel
        A decoder-only causal LM (Llama, Qwen2, Mistral, GPT-2, OPT, GPT-NeoX, ...).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.base: nn.Module = getattr(model, model.base_model_prefix)
        _, self.layers = find_layers(model)
        self.norm = self._find_final_norm()
        # OPT-350m style: a projection between the final norm and the tied head.
        decoder = getattr(self.base, "decoder", self.base)
        self.project_out: nn.Module | None = getattr(decoder, "project_out", None)
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
        self.head: nn.Module = head

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layers)

    def _find_final_norm(self) -> nn.Module:
        for owner in (self.base, getattr(self.base, "decoder", None)):
            if owner is None:
                continue
            for name in _FINAL_NORM_NAMES:
                module = getattr(owner, name, None)
                if isinstance(module, nn.Module):
                    return module
        raise ValueError(
            f"cannot find the final norm of {type(self.model).__name__}; "
            f"looked for {_FINAL_NORM_NAMES}"
        )

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Hidden:
        """Embeddings of a batch plus the extra inputs every layer receives."""
        captured: dict[str, Any] = {}

        def capture(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured["args"] = args
            captured["kwargs"] = kwargs
            raise _StopForward

        handle = self.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            handle.remove()
        if "args" not in captured:
            raise RuntimeError(f"{type(self.model).__name__} never called its first layer")
        args = captured["args"]
        return Hidden(args[0], tuple(args[1:]), dict(captured["kwargs"]))

    def run(self, hidden: Hidden, start: int, end: int) -> Hidden:
        """Apply decoder layers ``start`` to ``end - 1`` (Python slice semantics)."""
        states = hidden.states
        for layer in self.layers[start:end]:
            out = layer(states, *hidden.args, **hidden.kwargs)
            states = out[0] if isinstance(out, tuple) else out
        return hidden.with_states(states)

    def final_hidden(self, states: torch.Tensor) -> torch.Tensor:
        """Final norm (and output projection, if any) applied to the last layer's output."""
        states = self.norm(states)
        if self.project_out is not None:
            states = self.project_out(states)
        return states

    def logits_at(self, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LM-head logits at one position per row: ``[B, T, H]`` and ``[B]`` -> ``[B, V]``.

        Only the gathered rows go through the norm and the head, so memory stays ``B x V``.
        """
        rows = states[torch.arange(states.shape[0], device=states.device), positions]
        return self.head(self.final_hidden(rows))

    def forward_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The whole model, piece by piece, returning logits at ``positions``."""
        hidden = self.run(self.embed(input_ids, attention_mask), 0, self.num_layers)
        return self.logits_at(hidden.states, positions)
