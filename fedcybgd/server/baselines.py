"""The FedAvg baselines: Flower's own ``FedAvg`` over the whole model or LoRA adapters.

A run writes the same ``metrics.jsonl`` and ``summary.json`` as a FedCyBGD run, so experiments
compare like with like. Flower's FedAvg averages whatever arrives; :class:`CheckedFedAvg` first
drops (and names) a reply whose arrays do not match the model or hold NaN/Inf, so one bad client
cannot corrupt the global model. It samples nodes in node-key order
(:mod:`fedcybgd.strategies.node_keys`) instead of Flower's ``random.sample`` over node ids, and
averages replies in that order, so the same ``seed`` gives the same run in every runtime.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

from fedcybgd import protocol
from fedcybgd.baselines import (
    ARRAYS,
    METRICS,
    BaselineModel,
    build_baseline,
    check_tensors,
    from_record,
    to_record,
)
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.model.loading import load_tokenizer
from fedcybgd.protocol.dp import NoiseKey, epsilon
from fedcybgd.protocol.message_size import message_bytes
from fedcybgd.protocol.prior import ClassPriorSpec, with_class_prior
from fedcybgd.server.common import (
    Evaluator,
    class_prior_of,
    eval_extras,
    write_samples,
)
from fedcybgd.server.metrics import MetricsWriter, run_status, run_totals, write_summary
from fedcybgd.server.outputs import (
    remove_final,
    write_model_card,
)
from fedcybgd.server.preflight import checked_task
from fedcybgd.server.report import print_progress
from fedcybgd.server.session import RunSession
from fedcybgd.server.stops import STOPS, UncheckpointedStop, stop_handling, stop_reason
from fedcybgd.server.verdict import ReplyWatch, Verdict
from fedcybgd.strategies.lr_schedule import build_lr_schedule
from fedcybgd.strategies.node_keys import NodeKeys
from fedcybgd.strategies.record import RoundRecord
from fedcybgd.strategies.replies import (
    BAD_PAYLOAD,
    CLIENT_ERROR,
    MALFORMED,
    DropLog,
    Dropped,
    examples_weight,
    guarded,
    only_records,
    scalar_metrics,
)

log = logging.getLogger(__name__)


class CheckedFedAvg(FedAvg):
    """Flower's FedAvg behind the reply gate (:mod:`fedcybgd.strategies.replies`).

    A reply is kept only with exactly one ArrayRecord (``"arrays"``) matching the model's
    names, shapes and dtypes with finite values, and one MetricRecord (``"metrics"``) of finite
    scalars whose ``num-examples`` is positive (capped at ``max_examples``, so no node owns the
    average) and whose keys are those of the other kept replies (Flower's FedAvg raises on mixed
    keys). Anything else, including any exception while reading a reply, drops that reply with
    a named reason; the round goes on.

    Parameters
    ----------
    reference : dict[str, tuple[tuple[int, ...], torch.dtype]]
        The exchanged tensors' names, shapes and dtypes.
    max_examples : float
        The most examples a node can train on in a round (local steps x batch size).
    seed : int
        Seeds node sampling (over nodes in node-key order).
    sampling_secret : NoiseKey, optional
        Draw the sample from this server-side secret instead (central DP: its amplification
        by sampling holds only against someone who cannot predict the sample from ``seed``).
    class_prior, classes
        The class shares the nodes' training aims at (as :class:`~fedcybgd.strategies.fedcybgd.
        FedCyBGD`'s), sent in every round's config.
    client_lr : callable, optional
        ``round -> learning rate`` (:func:`~fedcybgd.strategies.lr_schedule.build_lr_schedule`),
        sent in every round's config as FedCyBGD sends it; ``None``: the nodes use their run
        config's ``lr``.
    **kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg`.
    """

    def __init__(self, reference: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 max_examples: float = math.inf, seed: int = 0,
                 class_prior: ClassPriorSpec | None = None, classes: int = 0,
                 client_lr: Callable[[int], float] | None = None,
                 sampling_secret: NoiseKey | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reference = reference
        self.sampling_secret = sampling_secret
        self.client_lr = client_lr
        self.max_examples = max_examples
        self.seed = seed
        self.class_prior, self.classes = class_prior, classes
        self.node_keys = NodeKeys()
        self.last_replies: list[Message] = []  # kept replies of the last round
        self.last_dropped: list[Message] = []
        self.last_drops: dict[str, int] = {}  # reason -> count, last round
        self.last_sent_bytes = 0
        self.last_sent_wire_bytes = 0  # the serialised messages (fedcybgd.protocol.message_size)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's messages, to nodes sampled by :meth:`sample`; remembers the payload bytes
        they carry."""
        if self.fraction_train == 0.0:
            return []
        size = max(int(len(list(grid.get_node_ids())) * self.fraction_train),
                   self.min_train_nodes)
        nodes = self.sample(grid, server_round, size)
        if self.class_prior is not None:  # after sampling: the new nodes' counts are known
            config = with_class_prior(config, self.class_prior, self.classes,
                                      self.node_keys.class_counts)
        config["server-round"] = server_round
        if self.client_lr is not None:
            config[protocol.LR] = float(self.client_lr(server_round))
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        messages = list(self._construct_messages(record, nodes, MessageType.TRAIN))
        self.last_sent_bytes = payload_bytes(arrays) * len(messages)
        self.last_sent_wire_bytes = sum(message_bytes(m) for m in messages)
        return messages

    def sample(self, grid: Grid, server_round: int, size: int) -> list[int]:
        """``size`` nodes, drawn with a generator seeded by ``seed`` and the round from the
        nodes in node-key order (a node that has not told its key sits the round out).

        Waits, as Flower's FedAvg does, until ``min_available_nodes`` and ``size`` nodes are
        connected.
        """
        wanted = max(self.min_available_nodes, size)
        while len(connected := list(grid.get_node_ids())) < wanted:
            log.info("waiting for nodes: %d connected, %d needed", len(connected), wanted)
            time.sleep(1.0)
        self.node_keys.learn(grid, connected, server_round)
        ordered = self.node_keys.order(connected)
        if len(ordered) < size:
            log.warning("round %d: only %d of %d connected nodes told their node key; "
                        "sampling %d instead of %d", server_round, len(ordered),
                        len(connected), len(ordered), size)
        rng = (self.sampling_secret.rng(f"nodes/{server_round}") if self.sampling_secret
               else random.Random(f"{self.seed}:nodes:{server_round}"))
        return rng.sample(ordered, min(size, len(ordered)))

    def _check(self, reply: Message, metric_keys: set[str] | None) -> None:
        """Raise :class:`Dropped` unless the reply is safe to average; caps num-examples."""
        content = reply.content
        only_records(content, arrays={ARRAYS}, metrics={METRICS}, configs=set())
        record = content.metric_records[METRICS]
        metrics = scalar_metrics(record)
        examples = examples_weight(metrics, "num-examples", self.max_examples)
        if metric_keys is not None and set(metrics) != metric_keys:
            raise Dropped(MALFORMED, f"metric keys {sorted(metrics)[:8]} differ from the other "
                                     "replies'")
        try:
            check_tensors(from_record(content.array_records[ARRAYS]), self.reference)
        except (ValueError, TypeError) as err:
            raise Dropped(BAD_PAYLOAD, str(err)) from None
        record["num-examples"] = examples

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop unsafe uploads (logged and counted by reason), then average as FedAvg does."""
        kept: list[Message] = []
        dropped: list[Message] = []
        drops = DropLog(server_round)
        keys: set[str] | None = None
        # In node-key order: the average's sums then run in the same order in every run,
        # whatever order the replies arrived in.
        replies = sorted(replies, key=lambda r: self.node_keys.sort_key(r.metadata.src_node_id))
        for reply in replies:
            if reply.has_content():
                try:
                    guarded(functools.partial(self._check, reply, keys))
                except Dropped as drop:
                    drops.add(reply.metadata.src_node_id, "upload", drop)
                    dropped.append(reply)
                    continue
                keys = set(reply.content.metric_records[METRICS])
            else:
                drops.counts[CLIENT_ERROR] += 1
            kept.append(reply)
        self.last_replies, self.last_dropped = kept, dropped
        self.last_drops = drops.as_dict()
        if not any(r.has_content() for r in kept):
            return None, None  # nothing usable: the global model stays as it was
        return super().aggregate_train(server_round, kept)


@dataclass(frozen=True)
class FedAvgPrivacy:
    """Central user-level DP for a FedAvg baseline, accounted as FedCyBGD's ``central`` mode:
    each round a Poisson-subsampled Gaussian at ``q = clients-per-round / nodes``, composed
    under RDP (:func:`fedcybgd.protocol.dp.epsilon`). A ``dp-target-epsilon`` caps the rounds
    up front: the run trains only as many as fit."""

    rate: float
    noise_multiplier: float
    delta: float
    target: float
    adaptive: bool = False

    @classmethod
    def of(cls, run: RunConfig, population: int) -> FedAvgPrivacy | None:
        """The run's DP (``None`` with ``dp = "off"``).

        Raises
        ------
        ConfigError
            ``dp`` is a mode Flower's server-side wrapper does not give (local, example).
        """
        if run.dp == "off":
            return None
        if run.dp != "central":
            raise ConfigError(f"dp = {run.dp!r}: the FedAvg baselines run under Flower's "
                              "server-side DP wrapper, so only dp = 'central'")
        return cls(min(1.0, run.clients_per_round / max(population, 1)),
                   run.dp_noise_multiplier, run.dp_delta, run.dp_target_epsilon,
                   run.dp_adaptive_clip)

    def spent(self, rounds: int) -> float:
        """Epsilon after ``rounds`` rounds."""
        return epsilon([(self.rate, rounds)], self.noise_multiplier, self.delta) if rounds else 0.0

    def rounds_within(self, wanted: int) -> int:
        """The most rounds, up to ``wanted``, whose epsilon fits the target (all without one)."""
        rounds = wanted
        while self.target and rounds and self.spent(rounds) > self.target:
            rounds -= 1
        return rounds

    def summary(self, rounds: int) -> dict[str, Any]:
        """The summary's ``dp_*`` keys."""
        return {"dp": "central", "dp_epsilon": self.spent(rounds), "dp_delta": self.delta,
                "dp_noise_multiplier": self.noise_multiplier, "dp_target_epsilon": self.target,
                "dp_accounting": f"Flower's DifferentialPrivacyServerSide"
                                 f"{'Adaptive' if self.adaptive else 'Fixed'}Clipping; RDP, "
                                 f"Poisson-subsampled Gaussian per round at q = {self.rate:.3g}"}


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of the arrays in ``record`` as Flower carries them."""
    return sum(len(array.data) for array in record.values())


def _train_record(strategy: CheckedFedAvg, run: RunConfig, server_round: int) -> RoundRecord:
    """A round's traffic and client metrics, as the record a FedCyBGD round fills."""
    kept = [r for r in strategy.last_replies if r.has_content()]
    metrics = [{k: float(v)  # type: ignore[arg-type]
                for k, v in r.content.metric_records[METRICS].items()} for r in kept]
    examples = sum(m["num-examples"] for m in metrics)
    down = strategy.last_sent_bytes
    up = sum(payload_bytes(r.content.array_records.get(ARRAYS, ArrayRecord()))
             for r in kept + strategy.last_dropped)  # dropped uploads crossed the wire too
    return RoundRecord(
        server_round,
        rule=f"fedavg-{run.baseline.params}",
        clients=[r.metadata.src_node_id for r in kept],
        dropped_uploads=len(strategy.last_dropped),
        dropped=strategy.last_drops,
        bytes_down=down, bytes_up=up, bytes_down_raw=down, bytes_up_raw=up,
        wire_bytes_down=strategy.last_sent_wire_bytes,
        wire_bytes_up=sum(message_bytes(r) for r in kept + strategy.last_dropped),
        client_peak_mem_mb=max([m.get("peak_mem_mb", 0.0) for m in metrics] or [0.0]),
        client_train_s=max([m.get("train_s", 0.0) for m in metrics] or [0.0]),
        examples=int(examples),
        train_loss=(sum(m.get("train_loss", math.nan) * m["num-examples"] for m in metrics)
                    / examples if examples else math.nan),
    )


def save_final(server: BaselineModel, run: RunConfig, final: Path) -> None:
    """Write the trained model to ``final`` in Hugging Face ``save_pretrained`` layout.

    Parameters
    ----------
    server : BaselineModel
        The server's model, holding the last round's arrays. A LoRA model is merged in
        place (its adapters are gone afterwards): call this once, at the end of the run.
    run : RunConfig
        The run; ``model`` names the base model a LoRA adapter records.
    final : Path
        The folder to write. Full: the whole model and its tokenizer. LoRA: the merged
        model (base weights plus the averaged adapters, peft's ``merge_and_unload``) and
        its tokenizer, so ``AutoModelForCausalLM.from_pretrained(final)`` loads the trained
        model either way; the adapter alone goes to ``final/adapter/`` (peft's format, its
        ``base_model_name_or_path`` set to ``run.model``).
    """
    model = server.model
    if server.lora:
        model.peft_config["default"].base_model_name_or_path = run.model  # type: ignore[index,union-attr]
        # A LoRA run never changes the base's embeddings: without save_embedding_layers=False
        # peft looks the base up (on the hub) to decide whether to save them.
        model.save_pretrained(final / "adapter",  # type: ignore[operator]
                              save_embedding_layers=False)
        model = model.merge_and_unload()  # type: ignore[operator]
    model.save_pretrained(final)  # type: ignore[operator]
    load_tokenizer(run.model).save_pretrained(final)


def run_fedavg(grid: Grid, run: RunConfig) -> dict[str, Any]:
    """Run a FedAvg baseline (``fedavg-params`` = full | lora); returns the summary it writes."""
    task = checked_task(run)  # the data before anything else
    # FedAvg keeps no checkpoint: resume = true is refused over earlier outputs.
    session = RunSession(grid, run, run.clients_per_round, can_resume=False)
    out, started, population = session.out, session.started, session.population
    server = build_baseline(run)
    for p in server.model.parameters():
        p.requires_grad_(False)
    initial = server.get()
    evaluator = Evaluator(run, server.stack, task=task)
    prior, classes = class_prior_of(run, evaluator.task.num_classes())
    writer = session.records()
    strategy = _fedavg(run, server, prior, classes)
    # With DP the budget may allow fewer rounds than asked (FedAvgPrivacy.rounds_within)
    privacy = FedAvgPrivacy.of(run, population)
    rounds = run.num_server_rounds if privacy is None else privacy.rounds_within(
        run.num_server_rounds)
    marks: dict[str, float] = {"round_start": 0.0}
    # A run in which no round averaged a single update fails (fedcybgd.server.verdict); the
    # watch keeps each round's replies so the failure can name the clients' error.
    watch, verdict = ReplyWatch(grid), Verdict()
    last_samples: list[dict[str, str]] = []  # the latest evaluation's sample answers

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        # Flower calls this after every round: it closes the round's record.
        began = time.perf_counter()
        record = (_train_record(strategy, run, server_round) if server_round > 0
                  else RoundRecord(0))
        if server_round > 0:
            verdict.after_round(server_round, watch.take_round(), bool(record.clients))
        is_last = server_round == rounds  # the rounds that run (a DP budget may cut them)
        if server_round == 0 or is_last or (
            run.evaluation.every and server_round % run.evaluation.every == 0
        ):
            server.set(from_record(arrays))
            result, cached = evaluator.initial() if server_round == 0 else (evaluator(), False)
            record.eval_loss, record.eval_accuracy = result.loss, result.accuracy
            record.extra.update(eval_extras(result, cached))
            write_samples(out, server_round, result)
            last_samples[:] = result.samples
        now = time.perf_counter()
        record.eval_s = now - began
        if server_round > 0:
            record.round_s = now - marks["round_start"]
        row = record.to_json()
        writer.write(row)
        if server_round > 0:
            print_progress(row, rounds)
        marks["round_start"] = now
        if record.eval_loss is None:
            return None
        return MetricRecord({"eval_loss": record.eval_loss,
                             "eval_accuracy": record.eval_accuracy})  # type: ignore[dict-item]

    driver = strategy if privacy is None else _with_dp(strategy, run)
    head = {"model": run.model, "strategy": "fedavg",
            "update_rule": f"fedavg-{run.baseline.params}", "rounds": rounds,
            "run_config": run.to_run_config()}
    stop = UncheckpointedStop(out, head, writer, started)
    with stop_handling(stop.write):
        try:
            driver.start(watch, to_record(initial), num_rounds=rounds,
                         timeout=run.round_timeout, train_config=ConfigRecord(),
                         evaluate_fn=evaluate_fn)
            summary, failure = _finish(run, out, server, writer, verdict, rounds, privacy,
                                       initial, last_samples, stop)
        except STOPS as err:
            stop.write(stop_reason(err))
            raise
    return session.finish(summary, failure, writer.records,
                          f"FedAvg-{run.baseline.params}, {run.model}, seed {run.seed}")


def _fedavg(run: RunConfig, server: BaselineModel, prior: Any, classes: Any) -> CheckedFedAvg:
    """The run's FedAvg: exactly ``clients-per-round`` nodes a round, each reply's examples
    bounded, the class prior and the nodes' rate schedule; under central DP the node sample
    drawn from a secret of this server."""
    return CheckedFedAvg(
        server.signature(),
        # A fraction of ~0 makes FedAvg sample exactly min_train_nodes, however many connect.
        fraction_train=1e-9,
        fraction_evaluate=0.0,
        min_train_nodes=run.clients_per_round,
        min_available_nodes=run.clients_per_round,
        max_examples=run.local_steps * run.batch_size,
        seed=run.seed,
        class_prior=prior,
        classes=classes,
        client_lr=build_lr_schedule(run.lr_schedule, run.lr, run.num_server_rounds,
                                    run.warmup_rounds),
        sampling_secret=NoiseKey() if run.dp == "central" else None,
    )


def _with_dp(strategy: CheckedFedAvg, run: RunConfig) -> Strategy:
    """``strategy`` wrapped in Flower's central-DP wrapper, the Flower way."""
    if run.dp_adaptive_clip:
        # Flower's adaptive-clipping wrapper: the clip starts at dp-clip-norm and follows the
        # quantile of the update norms on a noised count; it raises the update noise so both
        # are accounted at dp-noise-multiplier, as FedCyBGD's adaptive clip does
        return DifferentialPrivacyServerSideAdaptiveClipping(
            strategy, run.dp_noise_multiplier, run.clients_per_round,
            initial_clipping_norm=run.dp_clip_norm, target_clipped_quantile=run.dp_clip_quantile,
            clip_norm_lr=run.dp_clip_lr, clipped_count_stddev=run.clip_count_stddev)
    # Flower's own central-DP wrapper: each update clipped to dp-clip-norm around the
    # global model, Gaussian noise of multiplier x clip / n on the average
    return DifferentialPrivacyServerSideFixedClipping(
        strategy, run.dp_noise_multiplier, run.dp_clip_norm, run.clients_per_round)


def _finish(run: RunConfig, out: Path, server: BaselineModel, writer: MetricsWriter,
            verdict: Verdict, rounds: int, privacy: FedAvgPrivacy | None,
            initial: dict[str, torch.Tensor], last_samples: list[dict[str, str]],
            stop: UncheckpointedStop) -> tuple[dict[str, Any], str | None]:
    """The verdict, the final model and the summary; returns the summary and the failure, if
    the run failed."""
    totals = run_totals(writer.records)
    failure = verdict.at_end(rounds, totals["dropped"])
    if failure is not None:
        failure = failure.replace("no block was installed", "no update was averaged", 1)
        remove_final(out / "final")  # the untouched base model is not a run's result
    else:
        # The server's model holds the last round's arrays (always evaluated).
        save_final(server, run, out / "final")
    summary = {
        **stop.head,
        **totals,
        **(privacy.summary(rounds) if privacy is not None else {}),
        "wall_s": time.perf_counter() - stop.started,
        "exchanged_params": sum(v.numel() for v in initial.values()),
        "final_samples": last_samples,  # a generative task's answers, else []
        "output_dir": str(out),
        **run_status(failure, writer.records),
    }
    write_summary(out, summary)
    stop.finished = True
    if failure is None:
        write_model_card(out / "final", summary)
    return summary, failure
