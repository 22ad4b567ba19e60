"""The ClientApp: answer the server's node-key query; train the assigned block and upload it.

One train message = one assignment: the block to train, the update rule, the round's seed and
the blocks to download (only those whose version the node's cache lacks). The reply carries the
encoded new block, the metrics and what the node now holds, so the server never has to guess.
The round's steps are :mod:`fedcybgd.client.training`'s (self-sync, error feedback, seed-log
downloads, the node's limits and memory budget); messages from Flower's own FedAvg (the
baselines) go to :mod:`fedcybgd.client.baselines`.

Flower starts a fresh ClientApp process for every message, so what this module imports is paid
on each one. The training side (transformers, the update rules, the data) is imported by the
first train message of a process, not here: the node-key query, a node's first message of a
run, needs torch and the config alone (about 1.5 s of CPU instead of 4.5 s on a laptop core).
"""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedcybgd import protocol
from fedcybgd.config import NodeConfig, RunConfig
from fedcybgd.model.devices import node_device

app = ClientApp()


@app.query("node_key")
def node_key(msg: Message, context: Context) -> Message:
    """Answer the server's node-key query (:data:`fedcybgd.protocol.QUERY_NODE_KEY`): this
    node's stable key, by which the server orders nodes for sampling and derives their seeds."""
    node = NodeConfig.from_node_config(context.node_config)
    # The server's first message to a node: a device the node lacks fails here, by name.
    device = node_device(str(context.run_config.get("device", "auto")), node.device)
    identity = ConfigRecord({protocol.NODE_KEY: node.key})
    if context.run_config.get("download-codec") == protocol.SEEDLOG:
        # what its zeroth-order replay runs on: may it be sent step logs from its first round?
        from fedcybgd.protocol.zeroth_order import replay_identity

        identity[protocol.ZO_NODE] = replay_identity(device)
    run = RunConfig.from_run_config(context.run_config)
    if run.class_prior.strip().lower() == "global":
        from fedcybgd.client.local_data import stated_class_counts  # the node's data
        from fedcybgd.client.run_state import run_state

        counts = stated_class_counts(run, node, run_state(context, run).task)
        if counts is not None:  # the server pools the nodes' shares
            identity[protocol.CLASS_COUNTS] = counts
    return Message(RecordDict({protocol.IDENTITY: identity}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One FedCyBGD assignment, or a FedAvg round: :func:`fedcybgd.client.training.train`."""
    from fedcybgd.client import training

    return training.train(msg, context)


@app.train("pipeline")
def pipeline_stage(msg: Message, context: Context) -> Message:
    """A turn as a pipeline stage (``strategy = "pipeline"``):
    :func:`fedcybgd.client.pipeline.turn.handle`."""
    from fedcybgd.client.pipeline import turn

    return turn.handle(msg, context)


def __getattr__(name: str) -> Any:
    """The round's steps and helpers (``open_round``, ``zo_node``, ...) as attributes of this
    module too, from :mod:`fedcybgd.client.training`, imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from fedcybgd.client import training

    try:
        return getattr(training, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
