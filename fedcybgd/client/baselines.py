"""The FedAvg baselines' client: train the whole model, or PEFT LoRA adapters, FedAvg-style.

These are the baselines FedCyBGD is measured against, and they show the ClientApp speaks plain
Flower: FedAvg sends the global arrays under ``"arrays"`` and its config (with
``"server-round"``) under ``"config"``; the reply carries the trained arrays and
``"num-examples"``, as any FedAvg ClientApp's does. The model and the record conversion are
shared with the server: :mod:`fedcybgd.baselines`.
"""

from __future__ import annotations

import math
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedcybgd.baselines import (  # build_full, build_lora: re-exported for earlier callers
    ARRAYS,
    CONFIG,
    METRICS,
    BaselineModel,
    build_baseline,
    build_full,
    build_lora,
    from_record,
    is_fedavg_message,
    to_record,
)
from fedcybgd.client import limits
from fedcybgd.client.instruction import read_lr
from fedcybgd.client.local_data import training_batches
from fedcybgd.client.run_state import RunState, run_state
from fedcybgd.client.updates.fo import block_loss
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.core.measure import PeakMemory
from fedcybgd.protocol import class_prior

__all__ = ["ARRAYS", "METRICS", "build_full", "build_lora", "is_fedavg_message", "train_fedavg"]

def _client_model(state: RunState, run: RunConfig) -> BaselineModel:
    # Built by the run's first FedAvg round in this process; FedAvg overwrites it every round.
    if state.baseline is None:
        state.baseline = build_baseline(run)
    return state.baseline


def train_fedavg(msg: Message, context: Context) -> Message:
    """Train the exchanged tensors for ``local-steps`` AdamW steps at the round's rate (the
    instruction's ``lr``, the server's schedule; absent: the run config's); reply FedAvg-style.

    Beyond one of the node's limits (:mod:`fedcybgd.client.limits`) the round is not trained:
    the :class:`~fedcybgd.client.limits.Refusal` naming it becomes Flower's error reply, which
    FedAvg leaves out of its average.
    """
    run = RunConfig.from_run_config(context.run_config)
    node = NodeConfig.from_node_config(context.node_config)
    cfg = msg.content.config_records.get(CONFIG, ConfigRecord())
    lr = limits.check_training(run, node, read_lr(cfg))  # the server's schedule, else `lr`
    limits.check_privacy(run, node)
    limits.check_download_bytes({ARRAYS: msg.content.array_records.get(ARRAYS, ArrayRecord())},
                                node)
    server_round = int(cfg.get("server-round", 0))  # type: ignore[arg-type]
    state = run_state(context, run)
    bm = _client_model(state, run)
    # Pop the arrays so the message stops holding a second copy of the model once loaded.
    bm.set(from_record(msg.content.array_records.pop(ARRAYS)))

    seed = run.seed * 1_000_003 + server_round * 1009 + node.partition_id
    batches = training_batches(run, node, seed, class_prior(cfg), state.task)
    params = bm.trainable
    for p in params:
        p.requires_grad_(True)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=run.weight_decay)
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
                seen += len(batch)
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
