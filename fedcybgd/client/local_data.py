"""A node's training data: its own ``data-path`` file, or its partition of the run's dataset.

Each function takes the run's task (a client process's is its
:class:`~fedcybgd.client.run_state.RunState`'s, which keeps the run's data and shares between
messages); without one it builds a new task for ``run``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from fedcybgd.client.runtime import client_tokenizer
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.tasks import shares
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.build import build_task


def node_frame(run: RunConfig, node: NodeConfig, task: Task | None = None) -> pd.DataFrame:
    """This node's training rows, through the run's task: its own ``data-path`` file when the
    node config names one (read here, never sent), else its partition of the run's dataset
    (the task draws the partitions once)."""
    task = build_task(run) if task is None else task
    if node.data_path:
        return task.local_frame(node.data_path)
    return shares.client_examples(task, run.partitioner, node.partition_id, node.num_partitions,
                                  run.dirichlet_alpha, run.seed)


def training_batches(run: RunConfig, node: NodeConfig, seed: int,
                     target_prior: Sequence[float] | None = None,
                     task: Task | None = None) -> shares.BatchIterator:
    """This node's endless training batches (:func:`node_frame`), aiming at ``target_prior``
    (the class shares an instruction carries; ``None``: equal shares)."""
    task = build_task(run) if task is None else task
    return shares.batches(node_frame(run, node, task), client_tokenizer(run.model),
                          run.batch_size, run.max_seq_len, seed=seed, shuffle=True,
                          logit_adjust=run.logit_adjust, task=task,
                          class_balance=run.class_balance, target_prior=target_prior)


def stated_class_counts(run: RunConfig, node: NodeConfig,
                        task: Task | None = None) -> list[int] | None:
    """What the node tells the server of its data for ``class-prior = global``: how many rows
    of each class it trains on; ``None`` for another ``class-prior`` or a task without
    classes."""
    task = build_task(run) if task is None else task
    if run.class_prior.strip().lower() != "global" or task.num_classes() < 2:
        return None
    return shares.class_counts(task, node_frame(run, node, task))


def private_batches(run: RunConfig, node: NodeConfig, seed: int,
                    task: Task | None = None) -> shares.PoissonBatches:
    """This node's DP-SGD batches (``dp = "example"``): Poisson samples of its rows at rate
    ``batch-size / rows`` (see :class:`fedcybgd.tasks.shares.PoissonBatches`)."""
    task = build_task(run) if task is None else task
    return shares.PoissonBatches(node_frame(run, node, task), client_tokenizer(run.model),
                                 run.batch_size, run.max_seq_len, seed, task=task)
