"""Clients for Flower's own FedAvg: train the whole model, or PEFT LoRA adapters.

These are the baselines FedCyBGD is measured against, and they show the ClientApp speaks plain
Flower: FedAvg sends the global arrays under ``"arrays"`` and its config (with
``"server-round"``) under ``"config"``; the reply carries the trained arrays and
``"num-examples"``, as any FedAvg ClientApp's does. The whole model is exchanged by parameter
name (a tied embedding once); LoRA adapters through peft's ``get/set_peft_model_state_dict``,
peft's stable exchange surface.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import PreTrainedModel

from fedcybgd import data
from fedcybgd.client.runtime import client_tokenizer
from fedcybgd.client.updates.fo import block_loss
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.layerwise import LayerStack
from fedcybgd.memory import PeakMemory
from fedcybgd.models import load_model

ARRAYS = "arrays"  # Flower FedAvg's default ArrayRecord key
CONFIG = "config"  # ... and ConfigRecord key
METRICS = "metrics"


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
            state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
            return {k: v.detach() for k, v in state.items()}
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def signature(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every exchanged tensor."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.get().items()}

    def set(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load exchanged tensors; a clear ``ValueError`` on any mismatch, nothing changed."""
        check_tensors(tensors, self.signature())
        if self.lora:
            set_peft_model_state_dict(self.model, tensors)
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


def lora_config(run: RunConfig) -> LoraConfig:
    """The adapters of a LoRA run (no dropout: the runs compare update rules, not regularisers)."""
    return LoraConfig(r=run.lora_rank, lora_alpha=run.lora_alpha,
                      target_modules=run.lora_modules, lora_dropout=0.0, bias="none")


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
    peft_model = get_peft_model(base, lora_config(run))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    inner = cast(PreTrainedModel, peft_model.base_model.model)  # the LoRA-injected model
    return BaselineModel(peft_model, LayerStack(inner), trainable,
                         lora=True)


def build_baseline(run: RunConfig) -> BaselineModel:
    """The model ``run`` exchanges under FedAvg (``fedavg-params``)."""
    return build_lora(run) if run.fedavg_params == "lora" else build_full(run.model)


def to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """Tensors as a Flower ArrayRecord (numpy-backed, no pickle)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v.cpu().numpy()))
                        for k, v in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """A Flower ArrayRecord as tensors (``np.load`` already made fresh arrays: no copy)."""
    return {k: torch.from_numpy(np.require(v.numpy(), requirements="W"))
            for k, v in record.items()}


_MODELS: dict[tuple[object, ...], BaselineModel] = {}


def _client_model(run: RunConfig) -> BaselineModel:
    # One model per client process, as for FedCyBGD; FedAvg overwrites it every round.
    key = (run.model, run.fedavg_params, run.lora_rank, run.lora_alpha,
           run.lora_target_modules, run.seed)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = build_baseline(run)
    return _MODELS[key]


def is_fedavg_message(msg: Message) -> bool:
    """Does ``msg`` come from Flower's FedAvg (global arrays under ``"arrays"``)?"""
    return ARRAYS in msg.content.array_records


def train_fedavg(msg: Message, context: Context) -> Message:
    """Train the exchanged tensors for ``local-steps`` AdamW steps; reply FedAvg-style."""
    run = RunConfig.from_run_config(context.run_config)
    node = NodeConfig.from_node_config(context.node_config)
    cfg = msg.content.config_records.get(CONFIG, ConfigRecord())
    server_round = int(cfg.get("server-round", 0))  # type: ignore[arg-type]
    bm = _client_model(run)
    # Pop the arrays so the message stops holding a second copy of the model once loaded.
    bm.set(from_record(msg.content.array_records.pop(ARRAYS)))

    seed = run.seed * 1_000_003 + server_round * 1009 + node.partition_id
    examples = data.client_examples(run.dataset, run.partitioner, node.partition_id,
                                    node.num_partitions, run.dirichlet_alpha, run.seed)
    batches = data.batches(examples, client_tokenizer(run.model), run.batch_size,
                           run.max_seq_len, seed=seed, shuffle=True)
    params = bm.trainable
    for p in params:
        p.requires_grad_(True)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=run.lr, weight_decay=run.weight_decay)
    bm.model.train(False)  # no dropout, as for the FedCyBGD rules
    losses: list[float] = []
    seen = 0
    began = time.perf_counter()
    try:
        with PeakMemory() as mem:
            for _ in range(run.local_steps):
                batch = next(batches)
                loss = block_loss(bm.stack, batch, -1)
                if not math.isfinite(float(loss.detach())):
                    continue  # a skipped step counts no examples: FedAvg weighs by them
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                seen += int(batch.labels.shape[0])
                losses.append(float(loss.detach()))
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    metrics = MetricRecord({
        "num-examples": seen,
        "train_loss": sum(losses) / len(losses) if losses else float("nan"),
        "steps": len(losses),
        "peak_mem_mb": mem.peak_mb,
        "train_s": time.perf_counter() - began,
    })
    return Message(RecordDict({ARRAYS: to_record(bm.get()), METRICS: metrics}), reply_to=msg)
