"""An in-process Flower ``Grid``: a ServerApp talks to ClientApps in the same process.

For tests and quick experiments: no SuperLink, no network, no Ray. Each node has its own
``Context`` (node config and persistent state), as on a real SuperNode. A ClientApp that raises
yields an error reply, as Flower's runtimes do; a node can be made to drop its replies to
simulate a timeout.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


def node_configs(
    num_nodes: int, node_config: Callable[[int], dict[str, Any]] | None, first_node_id: int
) -> dict[int, dict[str, Any]]:
    """Node id -> node config: ``partition-id``, ``num-partitions`` and the extra keys."""
    configs: dict[int, dict[str, Any]] = {}
    for i in range(num_nodes):
        config: dict[str, Any] = {"partition-id": i, "num-partitions": num_nodes}
        if node_config is not None:
            config.update(node_config(i))
        configs[first_node_id + i] = config
    return configs


class LocalGrid(Grid):
    """What a Grid needs besides delivering messages: the run, node ids, reply bookkeeping.

    Subclasses implement :meth:`push_messages` and put each reply in ``self._replies``. This
    process plays the SuperLink side (node id 1), whose identity instruction messages read.
    """

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id=1)
        TaskIdentity.run_id = 1
        TaskIdentity.node_id = 1
        TaskIdentity.task_id = 1

    def set_run(self, run: Run) -> None:
        """Set the run."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Deprecated in Flower; kept for the interface."""
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """All node ids."""
        return list(self.node_ids)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies to the given message ids (missing ones are simply absent)."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull."""
        return self.pull_messages(self.push_messages(messages))


class LoopbackGrid(LocalGrid):
    """A Grid whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Number of nodes; node ``i`` gets ``partition-id = i`` and ``num-partitions``.
    run_config : dict
        The run config every node's Context sees.
    node_config : Callable[[int], dict], optional
        Extra node config for node ``i`` (e.g. a per-node update rule or cache folder).
    keep_sent : int, optional
        Keep only the last ``keep_sent`` instructions in :attr:`sent` (default: all, for
        tests that inspect them; long runs should bound it, downloads are large).
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: dict[str, Any],
        node_config: Callable[[int], dict[str, Any]] | None = None,
        first_node_id: int = 1001,
        keep_sent: int | None = None,
    ) -> None:
        configs = node_configs(num_nodes, node_config, first_node_id)
        super().__init__(list(configs))
        self.client_app = client_app
        self.contexts = {
            node_id: Context(run_id=1, node_id=node_id, node_config=config,
                             state=RecordDict(), run_config=dict(run_config))
            for node_id, config in configs.items()
        }
        self.silent: set[int] = set()  # nodes whose replies are lost (timeouts)
        self.sent: deque[Message] = deque(maxlen=keep_sent)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's ClientApp and keep the reply."""
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if message.has_content():
                # A real runtime deserialises one content per node; strategies such as FedAvg
                # share one RecordDict (and the global ArrayRecord) between messages, so each
                # node gets its own records (the arrays themselves are shared, not copied).
                message.content = RecordDict(
                    {k: type(r)(dict(r.items())) for k, r in message.content.items()}  # type: ignore[arg-type]
                )
            try:
                reply = self.client_app(message, self.contexts[node])
            except Exception as err:  # the runtime turns a crash into an error reply
                reason = f"{type(err).__name__}: {err}"
                error = Error(int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION), reason)
                reply = Message(error, reply_to=message)
            if node not in self.silent:
                self._replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids


def run_in_process(config: dict[str, Any], nodes: int, out: str | Path,
                   node_config: Callable[[int], dict[str, Any]] | None = None,
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One whole run of ``config`` (a run config) in this process: the ServerApp's own runner
    for its ``strategy`` and ``nodes`` ClientApps on a :class:`LoopbackGrid`, outputs and node
    caches under ``out`` (replaced). Returns the run's summary and its ``metrics.jsonl`` rows.

    For experiments that compare learning (no Ray, no SuperLink, no process per node: the
    fastest real run); what crosses a wire is measured by the process grid instead.
    """
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.server.app import RUNNERS  # the ServerApp's own table: strategy -> runner

    root = Path(out)
    shutil.rmtree(root, ignore_errors=True)
    config = {**config, "output-dir": str(root / "run")}

    def with_cache(i: int) -> dict[str, Any]:
        extra = node_config(i) if node_config is not None else {}
        return {"cache-dir": str(root / f"cache-{i}"), **extra}

    grid = LoopbackGrid(client_app, nodes, config, node_config=with_cache, keep_sent=0)
    run = RunConfig.from_run_config(config)
    summary = RUNNERS[run.strategy](grid, run)
    rows = [json.loads(line)
            for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line]
    return summary, rows
