"""The ServerApp: build everything from the run config, run FedCyBGD rounds, write outputs.

Per round: the strategy picks nodes and blocks and sends each node its assignment; replies are
merged into the global model (the server's own model object, updated in place); the model is
evaluated on the held-out test split every ``eval-every`` rounds; a checkpoint and a
``metrics.jsonl`` line are written. At the end the model is saved with ``save_pretrained`` and
``summary.json`` is written. With ``resume = true`` the run goes on from its checkpoint, read
back and checked against the model and the run config first (:mod:`fedcybgd.server.resume`);
a finished run resumed writes the summary it wrote, with one more segment. A run stopped before
its end writes a summary that says so (:mod:`fedcybgd.server.stops`). ``strategy = "fedavg"``
runs the baselines instead (:mod:`fedcybgd.server.baselines`): :data:`RUNNERS` maps each
``strategy`` to its runner, for the ServerApp and the experiments harness alike.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedcybgd.config import RunConfig
from fedcybgd.core.atomic import write_bytes
from fedcybgd.core.checksum import content_checksum
from fedcybgd.memory.estimate import ModelShape, fitting_rule
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.devices import resolve_device
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer, read_tensors, safetensors_index
from fedcybgd.model.precision import Precision
from fedcybgd.server.baselines import run_fedavg
from fedcybgd.server.checkpoint import Checkpointer, CheckpointError
from fedcybgd.server.common import (
    Evaluator,
    class_prior_of,
)
from fedcybgd.server.metrics import (
    MetricsWriter,
    Segments,
    run_status,
    run_totals,
    stopped_status,
    write_summary,
)
from fedcybgd.server.outputs import (
    remove_final,
    write_model_card,
)
from fedcybgd.server.pipeline.runner import run_pipeline_server
from fedcybgd.server.preflight import check_model, checked_task
from fedcybgd.server.resume import Resumed, read_checkpoint
from fedcybgd.server.round_end import RoundEnd, train
from fedcybgd.server.session import RunSession
from fedcybgd.server.stops import STOPS, stop_handling, stop_reason
from fedcybgd.server.verdict import ReplyWatch
from fedcybgd.strategies.fedcybgd import FedCyBGD
from fedcybgd.strategies.plugins import check_names
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.build import build_task

log = logging.getLogger(__name__)
app = ServerApp()


def pretrained_reader(
    model: str, blocks: BlockMap
) -> Callable[[str], dict[str, torch.Tensor]] | None:
    """Read a block's pretrained tensors from the model's files (no second copy in memory)."""
    files = safetensors_index(model)
    if not files:
        return None
    return lambda block: read_tensors(files, blocks.info(block).param_names)


def build_strategy(run: RunConfig, blocks: BlockMap, weights: dict[str, Any],
                   lineage: str, base_hash: str, shape: ModelShape | None = None,
                   device: str = "cpu", task: Task | None = None) -> FedCyBGD:
    """The FedCyBGD strategy for ``run`` (``shape`` enables memory-aware assignment; step logs
    are replayed on ``device``; ``task``: the run's, default a new one)."""

    task = build_task(run) if task is None else task
    # the task's scored positions a batch: the LM head's rows (every sft response token)
    scored = task.max_scored_tokens(run.batch_size, run.max_seq_len)
    prior, classes = class_prior_of(run, task.num_classes())

    def rule_for_budget(preferred: str, block: str, budget_mb: float) -> str | None:
        assert shape is not None
        return fitting_rule(shape, blocks, block, budget_mb, run.batch_size, run.max_seq_len,
                            preferred, Precision(run.frozen_dtype, run.frozen_quant),
                            run.options, scored)

    return FedCyBGD.from_config(
        run, blocks, weights,
        pretrained=pretrained_reader(run.model, blocks),
        rule_for_budget=rule_for_budget if shape is not None else None,
        lineage=lineage,
        base_hash=base_hash,
        return_arrays=False,
        device=device,
        class_prior=prior,
        classes=classes,
    )


def run_server(
    grid: Grid,
    run: RunConfig,
    node_wait_s: float | None = None,
    on_checkpoint_file: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Run a whole FedCyBGD training; returns the summary it also writes.

    A run stopped before its end (SIGTERM, Ctrl-C, Flower's stop, an exception; see
    :mod:`fedcybgd.server.stops`) writes a summary that says so, then raises what stopped it.
    ``on_checkpoint_file`` is called after each checkpoint file is written (a seam for crash
    tests, see :class:`fedcybgd.server.checkpoint.Checkpointer`); ``node_wait_s`` replaces
    ``node-wait`` for the wait at the start.
    """
    # Plug-in names are known once the run's plugin-modules are imported (RunConfig did).
    check_names(run.block_schedule, run.aggregate)
    # The data before anything else: a file no client could train on stops the run now.
    task = checked_task(run)
    device = resolve_device(run.device)  # before waiting for nodes: a bad device fails now
    session = RunSession(grid, run, run.clients_per_round, can_resume=True,
                         node_wait_s=node_wait_s)
    out, started = session.out, session.started
    model = load_model(run.model)
    for p in model.parameters():
        p.requires_grad_(False)
    stack = LayerStack(model)
    blocks = BlockMap(model, run.layers_per_block)
    weights = dict(model.named_parameters())
    base_hash = content_checksum(weights)
    checkpointer = Checkpointer(out / "checkpoint", on_file_written=on_checkpoint_file)

    lineage = uuid.uuid4().hex[:16]
    resumed: Resumed | None = None
    if run.resume and checkpointer.exists():
        # Checked before anything is installed: the files, the weights, the run config.
        resumed = read_checkpoint(checkpointer, run, blocks, weights, base_hash)
        lineage = resumed.lineage
        log.info("resuming from %s after round %d", checkpointer.root, resumed.round)
    elif run.resume:
        log.info("resume requested but %s holds no checkpoint: starting fresh",
                 checkpointer.root)
    # this start of the server, after those the checkpoint records
    segments = Segments(resumed.segments if resumed else (),
                        resumed.round if resumed else None, since=started)

    strategy = build_strategy(run, blocks, weights, lineage, base_hash,
                              ModelShape.of(model, blocks), device=str(device), task=task)
    if resumed is not None:
        resumed.install(strategy)  # the strategy sends nothing for the rounds it holds
    # Resuming: rows after the checkpoint belong to rounds about to be redone. Without a
    # checkpoint, any rows are those of a run that never reached one (it starts again).
    keep_through: int | None = None
    if run.resume:
        keep_through = resumed.round if resumed is not None else -1
    writer = session.records(keep_through)
    if resumed is not None and not writer.has_round(resumed.round) and resumed.record:
        # Stopped between the checkpoint and its metrics row: the row is in the checkpoint.
        log.warning("metrics.jsonl lacks round %d; restoring its row from the checkpoint",
                    resumed.round)
        writer.write(dict(resumed.record))
    evaluator = Evaluator(run, stack, blocks, device, task)
    stop = StopRecord(run, out, writer, segments, checkpointer)
    round_end = RoundEnd(run, out, strategy, writer, evaluator, checkpointer, resumed,
                         (lineage, base_hash), segments, stop, ReplyWatch(grid))
    with stop_handling(stop.write):
        try:
            failure = train(run, strategy, round_end)
            summary = _finish(run, out, strategy, blocks, model, writer, checkpointer,
                              segments, stop, (round_end.initial, round_end.last_eval),
                              failure, round_end.stopped_early)
        except STOPS as err:
            stop.write(stop_reason(err))
            raise
    return session.finish(summary, failure, writer.records,
                          f"FedCyBGD-{run.update_rule}, {run.model}, seed {run.seed}")


class StopRecord:
    """What a run stopped before its end writes: ``summary.json`` with ``"status": "stopped"``,
    its figures so far, and its segment's end in the checkpoint (so the resume after it lists
    the segment as stopped, with its whole wall time)."""

    def __init__(self, run: RunConfig, out: Path, writer: MetricsWriter, segments: Segments,
                 checkpointer: Checkpointer) -> None:
        self.run, self.out, self.writer = run, out, writer
        self.segments, self.checkpointer = segments, checkpointer
        self.initial: Any = None  # the evaluation before round 1, once known
        self.last_eval: Any = None  # the latest evaluation
        self.in_round: int | None = None  # the round running (sent, not yet checkpointed)
        self.finished = False  # the run's own summary is written: nothing to add
        self.thread = threading.current_thread()  # the one that runs the rounds and saves

    def write(self, reason: str) -> None:
        """Write the stopped summary (and the segment's end), once the run has a metrics file
        and until it has written its own summary."""
        if self.finished:
            return
        last = self.checkpointer.round or 0
        rows = self.writer.records
        listed = self.segments.listed(last, "stopped")
        summary: dict[str, Any] = {
            "model": self.run.model,
            "update_rule": self.run.update_rule,
            "rounds": self.run.num_server_rounds,
            "rounds_run": max((int(r["round"]) for r in rows), default=0),
            **run_totals(rows),
            "initial_eval_loss": getattr(self.initial, "loss", None),
            "initial_eval_accuracy": getattr(self.initial, "accuracy", None),
            "final_eval_loss": getattr(self.last_eval, "loss", None),
            "final_eval_accuracy": getattr(self.last_eval, "accuracy", None),
            "wall_s": Segments.wall_s(listed),
            "segments": listed,
            "output_dir": str(self.out),
            "run_config": self.run.to_run_config(),
            **stopped_status(reason, last, self.in_round),
        }
        write_summary(self.out, summary)
        log.error("run %s after round %d; %s wrote why; resume = true goes on from round %d",
                  reason, last, self.out / "summary.json", last + 1)
        # Only the thread that saves checkpoints may touch one (Flower's exit handler may call
        # this from another while a save is under way; the segment then reads "interrupted")
        if self.checkpointer.exists() and threading.current_thread() is self.thread:
            end_segment(self.checkpointer, listed)


def end_segment(checkpointer: Checkpointer, segments: list[dict[str, Any]]) -> None:
    """Record in the checkpoint how this segment ended (a damaged checkpoint is left as it is,
    and said: its resume refuses it by name anyway)."""
    try:
        checkpointer.amend("segments", segments)
    except CheckpointError as err:
        log.warning("could not record the segment's end in the checkpoint: %s", err)


def _finish(run: RunConfig, out: Path, strategy: FedCyBGD, blocks: BlockMap, model: Any,
            writer: MetricsWriter, checkpointer: Checkpointer, segments: Segments,
            stop: StopRecord, evaluations: tuple[Any, Any], failure: str | None,
            stopped_early: str | None) -> dict[str, Any]:
    """The final model (a completed run's), ``summary.json``, the segment's end and the model
    card; returns the summary. ``evaluations``: round 0's and the last one."""
    initial, last_eval = evaluations
    final_dir = out / "final"
    if failure is not None:
        remove_final(final_dir)  # an untrained model is not a run's result
    else:
        if final_dir.exists():
            log.info("replacing the final model in %s", final_dir)
        model.save_pretrained(final_dir)
        load_tokenizer(run.model).save_pretrained(final_dir)
    privacy = privacy_summary(run, strategy)
    if privacy and failure is None:
        write_bytes(final_dir / "privacy.json", json.dumps(privacy, indent=1).encode())
    rounds_run = max((int(r["round"]) for r in writer.records), default=0)
    listed = segments.listed(rounds_run, "completed" if failure is None else "failed")
    summary = {
        "model": run.model,
        "update_rule": run.update_rule,
        "rounds": run.num_server_rounds,
        "rounds_run": rounds_run,
        **run_totals(writer.records),
        # round 0's and the last round's evaluations (either may come from the checkpoint)
        "initial_eval_loss": initial.loss,
        "initial_eval_accuracy": initial.accuracy,
        "final_eval_loss": last_eval.loss,
        "final_eval_accuracy": last_eval.accuracy,
        "eval_examples": last_eval.examples,  # the rows the final evaluation rests on
        "final_samples": list(last_eval.samples),  # a generative task's answers, else []
        "wall_s": Segments.wall_s(listed),  # every segment's (a resumed run's earlier ones too)
        "segments": listed,
        "blocks": blocks.names,
        "cycle": strategy.cycle,
        "block_versions": strategy.versions,
        "output_dir": str(out),
        "run_config": run.to_run_config(),
        "early_stop": stopped_early,
        **privacy,
        **run_status(failure, writer.records),
    }
    write_summary(out, summary)
    stop.finished = True
    if checkpointer.exists():
        end_segment(checkpointer, listed)
    if failure is None:
        write_model_card(final_dir, summary)
    return summary


def privacy_summary(run: RunConfig, strategy: FedCyBGD) -> dict[str, Any]:
    """What DP spent (empty with ``dp = "off"``): the summary's ``dp_*`` keys and the final
    model's ``privacy.json``. For ``dp = "example"`` the figure is the largest epsilon a node
    reported for this run (each node keeps and enforces its own account)."""
    ledger = strategy.dp_policy.ledger
    if run.dp == "example":
        return {"dp": run.dp, "dp_epsilon": strategy.dp_policy.example_epsilon,
                "dp_delta": run.dp_delta,
                "dp_clip_norm": run.dp_clip_norm,
                "dp_noise_multiplier": run.dp_noise_multiplier,
                "dp_target_epsilon": run.dp_target_epsilon, "dp_stop": strategy.privacy_stop,
                "dp_accounting": "per node: RDP, Poisson-subsampled Gaussian per local step "
                                 "(DP-SGD), as reported by the nodes; each node declines a "
                                 "round beyond dp-target-epsilon or its own max-dp-epsilon"}
    if ledger is None:
        return {}
    return {"dp": run.dp, "dp_epsilon": ledger.spent(), "dp_delta": ledger.delta,
            "dp_clip_norm": run.dp_clip_norm, "dp_noise_multiplier": run.dp_noise_multiplier,
            "dp_target_epsilon": run.dp_target_epsilon, "dp_stop": strategy.privacy_stop,
            "dp_accounting": ("RDP, Poisson-subsampled Gaussian per round" if run.dp == "central"
                              else "RDP, Gaussian per round a node took part in (no "
                                   "amplification), the node that took part most")}


def configure_logging() -> None:
    """Our INFO lines on stderr, without raising the level of Flower's or httpx's loggers."""
    logger = logging.getLogger("fedcybgd")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


# A whole run of each ``strategy`` (fedcybgd.choices.STRATEGIES): it writes the run's outputs
# and returns its summary. The ServerApp and experiments/run_experiments.py both pick from here.
Runner = Callable[[Grid, RunConfig], dict[str, Any]]
RUNNERS: dict[str, Runner] = {"fedcybgd": run_server, "fedavg": run_fedavg,
                              "pipeline": run_pipeline_server}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point: validate the run config (update rules and their plug-in modules
    included) and the model (:mod:`fedcybgd.server.preflight`) before anything else, then run
    the ``strategy``'s runner, which checks the data first (its run's task)."""
    configure_logging()
    run = RunConfig.from_run_config(context.run_config)
    check_model(run)
    RUNNERS[run.strategy](grid, run)
