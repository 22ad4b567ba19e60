"""A node's training data: its own ``data-path`` file, or its partition of the run's dataset."""

from __future__ import annotations

import pandas as pd

from fedcybgd import data
from fedcybgd.client.runtime import client_tokenizer
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.tasks.base import build_task


def training_batches(run: RunConfig, node: NodeConfig, seed: int) -> data.BatchIterator:
    """This node's endless training batches, through the run's task: its own ``data-path``
    file when the node config names one (read here, never sent), else its partition of the
    run's dataset (the partitioning is cached per process)."""
    task = build_task(run)
    examples: pd.DataFrame = (
        task.local_frame(node.data_path) if node.data_path else data.client_examples(
            task, run.partitioner, node.partition_id, node.num_partitions,
            run.dirichlet_alpha, run.seed))
    return data.batches(examples, client_tokenizer(run.model), run.batch_size, run.max_seq_len,
                        seed=seed, shuffle=True, logit_adjust=run.logit_adjust, task=task,
                        class_balance=run.class_balance)
