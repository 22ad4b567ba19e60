"""The model a FedAvg baseline exchanges: the whole model, or PEFT LoRA adapters.

The whole model is exchanged by parameter name (a tied embedding once); LoRA adapters through
peft's ``get/set_peft_model_state_dict``, peft's stable exchange surface. peft is imported only
for a LoRA baseline: it takes seconds to import, and FedCyBGD runs never need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from fedcybgd.config import Baseline, RunConfig
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model

if TYPE_CHECKING:
    from peft import LoraConfig


def _peft() -> ModuleType:
    import peft  # only a LoRA baseline needs it (see the module docstring)

    return peft


@dataclass
class BaselineModel:
    """A model, its trainable parameters and the tensors FedAvg exchanges for it."""

    model: nn.Module  # the module whose forward trains (a PeftModel for LoRA)
    stack: LayerStack
    trainable: list[nn.Parameter]
    lora: bool

    def get(self) -> dict[str, torch.Tensor]:
        """The exchanged tensors, detached (LoRA: peft's adapter state dict)."""
        if self.lora:
            # save_embedding_layers=False: peft would otherwise re-read the base model's config
            # on every call to decide whether embeddings belong in the adapter.
            state = _peft().get_peft_model_state_dict(self.model, save_embedding_layers=False)
            return {k: v.detach() for k, v in state.items()}
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def signature(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every exchanged tensor."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.get().items()}

    def set(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load exchanged tensors; a clear ``ValueError`` on any mismatch, nothing changed."""
        check_tensors(tensors, self.signature())
        if self.lora:
            _peft().set_peft_model_state_dict(self.model, tensors)
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])


def check_tensors(
    got: dict[str, torch.Tensor], want: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> None:
    """Raise ``ValueError`` unless ``got`` has exactly the names, shapes and dtypes in ``want``
    and only finite values."""
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing or unexpected:
        raise ValueError(f"arrays do not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    for name, tensor in got.items():
        shape, dtype = want[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"array '{name}' has shape {tuple(tensor.shape)}, "
                             f"the model's is {shape}")
        if tensor.dtype != dtype:
            raise ValueError(f"array '{name}' has dtype {tensor.dtype}, the model's is {dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"array '{name}' holds NaN or Inf")


def lora_config(baseline: Baseline) -> LoraConfig:
    """The adapters of a LoRA run (no dropout: the runs compare update rules, not regularisers)."""
    config: LoraConfig = _peft().LoraConfig(
        r=baseline.lora_rank, lora_alpha=baseline.lora_alpha,
        target_modules=list(baseline.lora_modules), lora_dropout=0.0, bias="none")
    return config


def build_full(model_name: str) -> BaselineModel:
    """The whole model, every parameter trained and exchanged."""
    model = load_model(model_name)
    return BaselineModel(model, LayerStack(model), list(model.parameters()), lora=False)


def build_lora(run: RunConfig) -> BaselineModel:
    """The model with LoRA adapters; only the adapters train and travel.

    Adapter initialisation is seeded by ``seed``; FedAvg sends the start to every client anyway.
    """
    base = load_model(run.model)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(run.seed)
    peft_model = _peft().get_peft_model(base, lora_config(run.baseline))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    inner = cast(PreTrainedModel, peft_model.base_model.model)  # the LoRA-injected model
    return BaselineModel(peft_model, LayerStack(inner), trainable, lora=True)


def build_baseline(run: RunConfig) -> BaselineModel:
    """The model ``run`` exchanges under FedAvg (``fedavg-params``)."""
    return build_lora(run) if run.baseline.params == "lora" else build_full(run.model)
