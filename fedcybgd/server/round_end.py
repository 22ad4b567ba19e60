"""FedCyBGD's rounds through Flower's own loop (``Strategy.start``), closed by a round-end hook.

Flower's loop sends each round's instructions, hands the replies to the strategy, and then calls
its ``evaluate_fn`` with the round's number. :class:`RoundEnd` is that function: it closes the
round the strategy just aggregated, in this order:

1. **evaluate** the global model when the round is due (``eval-every``, the last round);
2. **checkpoint**, then the round's ``metrics.jsonl`` row (a round has a row only once it is
   durable, so a resumed run never lists a round twice) and the progress line;
3. **verdict**: a run that trains nothing fails (:mod:`fedcybgd.server.verdict`);
4. **early stop** on the evaluations (``early-stop-*``), and the differential-privacy budget.

A run that ends before its last round (a failure, an early stop, the privacy budget) ends
Flower's loop by raising :class:`RunEnds`; :func:`train` catches it. Round 0 is the evaluation
before training; the rounds a resumed run's checkpoint holds pass through the loop untouched
(the strategy sends nothing for them).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fedcybgd.config import RunConfig
from fedcybgd.server.checkpoint import Checkpointer
from fedcybgd.server.common import Evaluator, eval_extras, write_samples
from fedcybgd.server.early_stop import EarlyStop
from fedcybgd.server.metrics import MetricsWriter, Segments
from fedcybgd.server.report import print_progress
from fedcybgd.server.resume import Resumed, checkpoint_state
from fedcybgd.server.verdict import ReplyWatch, Verdict, installed_any
from fedcybgd.strategies.fedcybgd import FedCyBGD
from fedcybgd.strategies.record import RoundRecord, run_totals

log = logging.getLogger(__name__)


class RunEnds(Exception):
    """Ends Flower's loop before its last round: ``failure`` (None: the run succeeded)."""

    def __init__(self, failure: str | None, stopped_early: str | None = None) -> None:
        super().__init__(failure or stopped_early or "the run ends")
        self.failure, self.stopped_early = failure, stopped_early


class RoundEnd:
    """Flower's ``evaluate_fn`` for a FedCyBGD run: closes each round (module docstring).

    After the loop, :attr:`initial` and :attr:`last_eval` are round 0's evaluation and the
    latest one, :attr:`stopped_early` says why the run stopped early, if it did.
    """

    def __init__(self, run: RunConfig, out: Path, strategy: FedCyBGD, writer: MetricsWriter,
                 evaluator: Evaluator, checkpointer: Checkpointer, resumed: Resumed | None,
                 identity: tuple[str, str], segments: Segments, stop: Any,  # app.StopRecord
                 watch: ReplyWatch) -> None:
        self.run, self.out, self.strategy, self.writer = run, out, strategy, writer
        self.evaluator, self.checkpointer, self.segments = evaluator, checkpointer, segments
        self.lineage, self.base_hash = identity
        self.stop, self.watch = stop, watch
        self.first_round = resumed.round + 1 if resumed is not None else 1
        self.initial: Any = resumed.initial_eval if resumed is not None else None
        # The latest evaluation and its round.
        self.last_eval, self.last_eval_round = self.initial, 0
        if resumed is not None and resumed.last_eval is not None:
            self.last_eval, self.last_eval_round = resumed.last_eval, resumed.round
        self.verdict = Verdict(installed=installed_any(writer.records))
        self.early: EarlyStop | None = None  # set once round 0's row is in (see below)
        self.stopped_early: str | None = None
        self.round_start = time.perf_counter()
        watch.on_send = self._sending

    def _sending(self, messages: list[Message]) -> None:
        # Before any instruction goes out: a resume after a kill must not trust what the
        # checkpoint says these nodes hold (fedcybgd.server.resume)
        self.checkpointer.note_sent(m.metadata.dst_node_id for m in messages)
        self.stop.in_round = self.strategy.round.record.round if self.strategy.round else None

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Close round ``server_round`` (0: evaluate before training); raises :class:`RunEnds`
        when the run ends before its last round."""
        if server_round == 0:
            return self._before_training()
        if server_round < self.first_round:
            self.round_start = time.perf_counter()
            return None  # the checkpoint holds it
        if self.strategy.privacy_stop is not None:  # this round would exceed the DP budget
            self._privacy_ends(server_round)
        record = self.strategy.history[-1] if self.strategy.history else None
        if record is None or record.round != server_round:
            raise RuntimeError(f"round {server_round} ended without its record in the "
                               "strategy's history")
        run = self.run
        is_last = server_round == run.num_server_rounds
        if is_last or (run.evaluation.every and server_round % run.evaluation.every == 0):
            self._evaluate_into(record)
        record.round_s = time.perf_counter() - self.round_start
        row = record.to_json()
        assert self.initial is not None and self.last_eval is not None  # round 0 ran first
        self.checkpointer.save(
            server_round, self.strategy.checkpoint_tensors(),
            checkpoint_state(self.lineage, self.base_hash, self.strategy, self.initial,
                             (self.last_eval_round, self.last_eval), run, row,
                             self.segments.listed(server_round)))
        self.stop.in_round = None
        self.writer.write(row)
        print_progress(row, run.num_server_rounds)
        failure = self.verdict.after_round(server_round, self.watch.take_round(),
                                           bool(record.accepted))
        if failure is not None:
            raise RunEnds(failure)
        self._maybe_stop_early(server_round, record)
        self.round_start = time.perf_counter()
        return _metrics(record.eval_loss, record.eval_accuracy)

    def at_end(self) -> str | None:
        """The verdict after the last round (the failure, if the run failed)."""
        return self.verdict.at_end(self.run.num_server_rounds,
                                   run_totals(self.writer.records)["dropped"])

    def _before_training(self) -> MetricRecord | None:
        """Round 0: the evaluation before training (a resumed run's is in its checkpoint)."""
        if self.initial is None:
            initial, cached = self.evaluator.initial()
            self.writer.write(RoundRecord(0, eval_loss=initial.loss,
                                          eval_accuracy=initial.accuracy,
                                          eval_examples=initial.examples,
                                          extra=eval_extras(initial, cached)).to_json())
            write_samples(self.out, 0, initial)
            self.initial = self.last_eval = initial
        log.info("round 0: eval loss %.4f, accuracy %.3f", self.initial.loss,
                 self.initial.accuracy)
        self.stop.initial, self.stop.last_eval = self.initial, self.last_eval
        # The early-stop state is a function of the evaluations so far (a resumed run's too)
        self.early = EarlyStop.of(self.run, self.writer.records)
        if self.first_round > self.run.num_server_rounds and \
                self.last_eval_round != self.first_round - 1:
            # Nothing left to train, and the checkpoint's model was not evaluated: do it now.
            log.info("the checkpoint holds no evaluation of round %d; evaluating it",
                     self.first_round - 1)
            self.last_eval, self.last_eval_round = self.evaluator(), self.first_round - 1
        self.round_start = time.perf_counter()
        return _metrics(self.initial.loss, self.initial.accuracy)

    def _privacy_ends(self, server_round: int) -> None:
        """The budget ends the run before ``server_round``: the model after the round before
        is evaluated (if it was not) and the run ends."""
        if server_round > self.first_round and self.last_eval_round != server_round - 1:
            self.last_eval, self.last_eval_round = self.evaluator(), server_round - 1
        raise RunEnds(self.verdict.at_end(server_round - 1,
                                          run_totals(self.writer.records)["dropped"]))

    def _evaluate_into(self, record: RoundRecord) -> None:
        """Evaluate the model after ``record``'s round, into the record and its samples."""
        began = time.perf_counter()
        result = self.evaluator()
        record.eval_loss, record.eval_accuracy = result.loss, result.accuracy
        record.eval_examples = result.examples
        record.extra.update(eval_extras(result))
        record.eval_s = time.perf_counter() - began
        write_samples(self.out, record.round, result)
        self.last_eval, self.last_eval_round = result, record.round
        self.stop.last_eval = result

    def _maybe_stop_early(self, server_round: int, record: RoundRecord) -> None:
        if self.early is None or record.eval_loss is None or \
                server_round >= self.run.num_server_rounds:
            return
        self.stopped_early = self.early.observe(record.eval_loss, record.eval_accuracy)
        if self.stopped_early is not None:
            log.info("round %d: stopping early: %s", server_round, self.stopped_early)
            raise RunEnds(self.verdict.at_end(server_round,
                                              run_totals(self.writer.records)["dropped"]),
                          self.stopped_early)


def _metrics(loss: float | None, accuracy: float | None) -> MetricRecord | None:
    """What Flower's result keeps of an evaluation."""
    if loss is None:
        return None
    return MetricRecord({"eval_loss": float(loss), "eval_accuracy": float(accuracy or 0.0)})


def train(run: RunConfig, strategy: FedCyBGD, round_end: RoundEnd) -> str | None:
    """The rounds, through Flower's ``Strategy.start``; returns the failure, if the run failed."""
    try:
        strategy.start(round_end.watch, ArrayRecord(), num_rounds=run.num_server_rounds,
                       timeout=run.round_timeout, train_config=ConfigRecord(),
                       evaluate_fn=round_end)
    except RunEnds as end:
        round_end.stopped_early = end.stopped_early
        return end.failure
    return round_end.at_end()
