"""What a client process keeps for the run it serves, between that run's messages.

Flower may hand one process many messages of a run: a simulation runs every node's messages in
a few processes, round after round (the loopback harness in the test's own); a real SuperNode
starts a process a message. What a message needs and costs seconds to make is built by the first
message of a run and handed to every later one:

* the run's task (:func:`fedcybgd.tasks.build.build_task`): its data read and checked, the
  nodes' shares drawn, its truncation counts;
* the FedAvg baselines' model (:mod:`fedcybgd.client.baselines`), which FedAvg overwrites every
  round.

A message of another run (another run id, or the same id under another run config) replaces
the state, and the old run's data goes with it. The loaded pretrained model is not run state:
:func:`fedcybgd.client.runtime.client_model` keeps it per process and brings its blocks to the
node's cached versions on every message, whatever the run.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flwr.app import Context

from fedcybgd.config import RunConfig
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.build import build_task

if TYPE_CHECKING:
    from fedcybgd.baselines import BaselineModel

__all__ = ["RunState", "run_state"]


@dataclass
class RunState:
    """One run's state in a client process (see the module docstring).

    Attributes
    ----------
    run_id : int
        Flower's run id.
    config : str
        The run config the state was built for, as canonical JSON.
    task : Task
        The run's task.
    baseline : BaselineModel or None
        The FedAvg baselines' model, once a FedAvg round has built it.
    """

    run_id: int
    config: str
    task: Task
    baseline: BaselineModel | None = None


_lock = threading.Lock()
_current: RunState | None = None


def run_state(context: Context, run: RunConfig) -> RunState:
    """The state of the run ``context`` belongs to (``run``: its config, as read from
    ``context.run_config``): the one this process holds, or a new one that replaces it."""
    global _current
    config = json.dumps(dict(context.run_config), sort_keys=True, default=str)
    with _lock:
        held = _current
        if held is None or held.run_id != context.run_id or held.config != config:
            _current = None  # the old run's data goes before the new run's is read
            held = _current = RunState(context.run_id, config, build_task(run))
        return held
