"""The payoff report: which method gives the best model at equal client-rounds, bytes on the
wire, client peak memory and client compute time, with the seed spread shown.

Reads the results of a profile run by ``run_experiments.py`` (several seeds per method, one or
more tasks and partitions, centralized bounds on one node) and writes ``payoff.md`` and one
Pareto figure per task and partition, ``pareto_<task>_<partition>.png``.

    python experiments/payoff.py experiments/results/payoff/results.json

Quality is the task's eval accuracy (exact match for a generative task); for a language-modelling
task (``task = "lm"``) it is the held-out loss per token, lower is better, and a lead is clear
only when the leader's worst seed beats the runner-up's best by at least 0.05 nats/token
(:data:`LOSS`); the reference text's loss before and after (the forgetting) is shown beside
each method. A method's quality at
a budget is, per seed, that of its last evaluation reached within the budget (round 0, the
untrained model, is always within it); the budget ladder of each axis is every method's own
total at its costliest seed (so all its seeds finish within its own rung; totals within 1% of
each other are one rung, at the largest), and each row answers "with as much as method X
spends, who is best?". Memory is a threshold, not a running sum: at a budget of M MB, the
methods whose client peak (the largest over seeds) is at most M compete with their final
quality. The untrained model (round 0) competes at every budget: it costs nothing, and a method
that has not beaten it has not paid off. A winner is *clear* when its worst seed beats the
runner-up's best seed; otherwise the difference is inside the seed spread.

With evaluations along the way (``eval-every``), the report adds each task's learning curve: per
evaluation point (training examples seen, and the client-rounds they are), every method's
accuracy over seeds, who is ahead and by how much against the seed spread; then the best
full-parameter method against the best LoRA one at each point (by mean, among the methods run
at the most seeds there, so one lucky seed cannot stand for a family), and the crossing point: the
first evaluation from which one of the two stays ahead to the end (and from which it is clear).

Client compute is what the runs recorded (each round's slowest client, summed) unless
``client_compute.json`` lies beside ``results.json``: ``client_compute.py`` measures every
method's client seconds a round side by side in one piece, and a run's compute after round
``r`` is then ``r`` times its method's. A profile run in pieces on different days needs it: the
machine's speed drifts between pieces, and recorded seconds compare only within one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from provenance import commands_line

MB = 2**20
CENTRAL = "central"
UNTRAINED = "the untrained model"
COMPUTE = "client_compute.json"  # client_compute.py's side-by-side measurement


@dataclass(frozen=True)
class Point:
    """One evaluation of a run, with what the run had spent by then."""

    round: int
    accuracy: float
    loss: float
    mb: float  # payloads both ways, cumulative
    client_s: float  # the round's slowest client training time, cumulative
    examples: int | None = None  # training examples seen in all (None: no config saved)
    reference: float | None = None  # the reference text's loss (language modelling)


@dataclass(frozen=True)
class Metric:
    """What a task's quality is: the figure shown, whether lower is better, and the lead a
    winner's worst seed must have over the runner-up's best to be clear."""

    name: str
    lower_is_better: bool
    clear_by: float  # in the figure's own units
    unit: str  # of a margin: "points" (accuracy x 100) or "nats"

    def shown(self, p: Point) -> float:
        """The figure itself."""
        return p.loss if self.lower_is_better else p.accuracy

    def score(self, p: Point) -> float:
        """Higher is better."""
        return -p.loss if self.lower_is_better else p.accuracy

    def margin(self, lead: float) -> str:
        """A lead in ``score`` units, as the report writes it."""
        if self.lower_is_better:
            return f"{-lead:+.3f} {self.unit}"
        return f"{lead * 100:+.1f} {self.unit}"


ACCURACY = Metric("accuracy", False, 0.0, "points")
# language modelling: held-out loss per token; a clear win is 0.05 nats/token beyond the seeds
LOSS = Metric("held-out loss (nats/token)", True, 0.05, "nats")


def metric_of(config: dict[str, Any]) -> Metric:
    """The quality figure of a run config's task."""
    return LOSS if config.get("task") == "lm" else ACCURACY


@dataclass(frozen=True)
class Run:
    """One run's curve and its constant client peak."""

    method: str
    seed: int
    points: tuple[Point, ...]
    peak_mb: float
    client_rounds: int
    lora: bool = False  # trains LoRA adapters, not the model's own weights
    recorded_s: float = 0.0  # client seconds a round as the run recorded them
    metric: Metric = ACCURACY

    @property
    def final(self) -> Point:
        return self.points[-1]


def examples_per_round(config: dict[str, Any]) -> int | None:
    """Training examples a round of this run config sees (None where the config is not
    saved): clients a round x local steps x batch."""
    keys = ("clients-per-round", "local-steps", "batch-size")
    if not all(k in config for k in keys):
        return None
    return int(config["clients-per-round"]) * int(config["local-steps"]) * int(
        config["batch-size"])


def curve(result: dict[str, Any], seconds_a_round: float | None = None) -> Run:
    """A run of ``results.json`` as a :class:`Run`. Its client compute is the seconds it
    recorded, summed, or, given ``seconds_a_round`` (measured side by side), the rounds run
    times that."""
    config = result.get("config", {})
    per_round = examples_per_round(config)
    sent = seconds = 0.0
    points = []
    trained = [float(r.get("client_train_s", 0.0)) for r in result["records"] if r["round"] > 0]
    for rec in result["records"]:
        sent += (rec.get("bytes_down", 0) + rec.get("bytes_up", 0)) / MB
        seconds += rec.get("client_train_s", 0.0)
        if rec.get("eval_accuracy") is not None:
            spent = seconds if seconds_a_round is None else int(rec["round"]) * seconds_a_round
            reference = rec.get("eval_reference_loss")
            points.append(Point(int(rec["round"]), float(rec["eval_accuracy"]),
                                float(rec["eval_loss"]), sent, spent,
                                None if per_round is None else int(rec["round"]) * per_round,
                                None if reference is None else float(reference)))
    if not points:
        raise ValueError(f"run {result['id']} has no evaluation")
    return Run(result["method"], int(result["seed"]), tuple(points),
               float(result["client_process_peak_mb"]), int(result["client_rounds"]),
               config.get("fedavg-params") == "lora",
               mean(trained) if trained else 0.0, metric_of(config))


def load_compute(folder: Path) -> dict[str, Any] | None:
    """``client_compute.py``'s measurement beside a profile's results, or None."""
    path = folder / COMPUTE
    return json.loads(path.read_text()) if path.exists() else None


def compute_key(result: dict[str, Any]) -> str:
    """A run's key in the side-by-side measurement: its id without the seed."""
    task = [result["task"]] if result.get("task") else []
    return "@".join([result["method"], *task, result["partition"]])


def groups(results: dict[str, dict[str, Any]], compute: dict[str, Any] | None = None,
           ) -> dict[tuple[str, str], dict[str, list[Run]]]:
    """(task, partition) -> method -> its runs (one per seed). Bounds sit under partition
    ``central`` of their task. With ``compute`` (:func:`load_compute`) every run's client
    compute comes from it."""
    out: dict[tuple[str, str], dict[str, list[Run]]] = {}
    for result in results.values():
        unit = None
        if compute is not None:
            entry = compute["units"].get(compute_key(result))
            if entry is None:
                raise SystemExit(
                    f"{COMPUTE} has no measurement of {compute_key(result)}: run "
                    f"`python experiments/client_compute.py --profile "
                    f"{compute['meta'].get('profile', '?')} --only {result['method']}`")
            unit = float(entry["seconds_per_round"])
        key = (result.get("task", ""), result["partition"])
        out.setdefault(key, {}).setdefault(result["method"], []).append(curve(result, unit))
    return out


@dataclass(frozen=True)
class Score:
    """A method's quality over its seeds (``values``: higher is better, see :class:`Metric`),
    and eval loss to break a tie."""

    method: str
    points: tuple[Point, ...]
    metric: Metric = ACCURACY

    @property
    def values(self) -> tuple[float, ...]:
        return tuple(self.metric.score(p) for p in self.points)

    @property
    def mean(self) -> float:
        return mean(self.values)

    @property
    def loss(self) -> float:
        return mean(p.loss for p in self.points)

    @property
    def untrained(self) -> bool:
        """No seed has an evaluation after round 0: this is the untrained model."""
        return all(p.round == 0 for p in self.points)

    def cell(self) -> str:
        if self.metric.lower_is_better:
            shown = [self.metric.shown(p) for p in self.points]
            return f"loss {mean(shown):.3f} [{min(shown):.3f}-{max(shown):.3f}]"
        lo, hi = min(self.values), max(self.values)
        return f"{self.mean:.3f} [{lo:.3f}-{hi:.3f}], loss {self.loss:.3f}"

    def short(self) -> str:
        """The mean and range of the figure alone."""
        shown = [self.metric.shown(p) for p in self.points]
        return f"{mean(shown):.3f} [{min(shown):.3f}-{max(shown):.3f}]"


def within(run: Run, cost: Callable[[Point], float], budget: float) -> Point:
    """The run's last evaluation whose cost is within ``budget`` (round 0 always is)."""
    reached = [p for p in run.points if cost(p) <= budget * (1 + 1e-9)]
    return reached[-1] if reached else run.points[0]


# Budgets within 1% of each other are one rung of the ladder.
RUNG_MERGE = 0.01
ONE_SEED, CLEAR, INSIDE = "one seed: no spread to judge by", "clear", "inside the spread"


def standing(best: Score, second: Score) -> str:
    """Whether ``best``'s lead over ``second`` exceeds the seed spread: its worst seed beats
    the other's best (by the metric's ``clear_by`` at least)."""
    if min(len(best.values), len(second.values)) < 2:
        return ONE_SEED
    clear_by = best.metric.clear_by
    if clear_by:
        return CLEAR if min(best.values) >= max(second.values) + clear_by else INSIDE
    return CLEAR if min(best.values) > max(second.values) else INSIDE


def verdict(scores: list[Score], start: Score) -> str:
    """The winner (highest mean accuracy, then lowest mean loss), its margin over the
    runner-up and whether it exceeds the seed spread. ``start`` (the untrained model, which
    costs nothing) competes at every budget; a method with no evaluation after round 0
    within the budget is that same model, so it is left out."""
    ranked = sorted([s for s in scores if not s.untrained] + [start],
                    key=lambda s: (-s.mean, s.loss))
    if len(ranked) == 1:
        return (f"none: no method has an evaluation after round 0 within this budget | "
                f"{start.method} {start.cell()} | | |")
    best, second = ranked[0], ranked[1]
    margin = best.mean - second.mean
    spread = standing(best, second)
    if spread == INSIDE and margin == 0 and min(best.values) == max(best.values) == min(
            second.values):
        spread = "a tie (the loss decides the order)"
    return (f"{best.method} {best.cell()} | {second.method} {second.cell()} | "
            f"{best.metric.margin(margin)} | {spread} |")


def untrained(methods: dict[str, list[Run]]) -> Score:
    """The untrained model's evaluation per seed (round 0; every method of a task and
    partition evaluates the same weights on the same rows, so any method's will do), over
    every seed any method ran."""
    per_seed = {r.seed: r.points[0] for runs in methods.values() for r in runs}
    metric = next(r.metric for runs in methods.values() for r in runs)
    return Score(UNTRAINED, tuple(per_seed[seed] for seed in sorted(per_seed)), metric)


def rungs(totals: list[tuple[float, str]]) -> list[tuple[float, list[str]]]:
    """The budget ladder from each method's costliest total: totals within ``RUNG_MERGE`` of
    the rung below join it, and the rung moves up to the largest of them, so a method a hair
    costlier than another is not cut back a whole evaluation at the other's rung."""
    merged: list[tuple[float, list[str]]] = []
    for total, owner in sorted(totals):
        if merged and total <= merged[-1][0] * (1 + RUNG_MERGE):
            merged[-1] = (total, [*merged[-1][1], owner])
        else:
            merged.append((total, [owner]))
    return merged


def owners_of(owners: list[str], one: str, many: str) -> str:
    """Whose rung it is: ``a's costliest seed``, or ``a and b's costliest seeds, within 1%``."""
    if len(owners) == 1:
        return f"{owners[0]}'s {one}"
    return f"{' and '.join(owners)}'s {many}, within {RUNG_MERGE:.0%}"


def comparisons(methods: dict[str, list[Run]]) -> list[str]:
    """The four comparisons for one task and partition, as Markdown table rows."""
    metric = next(r.metric for runs in methods.values() for r in runs)
    rows = [f"| budget | winner: {metric.name}, mean [min-max over seeds] | runner-up | margin | "
            "against the seeds |", "|---|---|---|---|---|"]
    finals = [Score(m, tuple(r.final for r in runs), metric) for m, runs in methods.items()]
    start = untrained(methods)
    rounds = sorted({r.client_rounds for runs in methods.values() for r in runs})
    rows.append(f"| (a) equal client-rounds ({', '.join(map(str, rounds))}) | "
                f"{verdict(finals, start)}")
    axes: list[tuple[str, str, Callable[[Point], float], Callable[[Run], float]]] = [
        ("(b) bytes", "MB", lambda p: p.mb, lambda r: r.final.mb),
        ("(d) client compute", "s", lambda p: p.client_s, lambda r: r.final.client_s),
    ]
    for label, unit, cost, total in axes:
        ladder = rungs([(max(total(r) for r in runs), m) for m, runs in methods.items()])
        for budget, owners in ladder:
            scores = [Score(m, tuple(within(r, cost, budget) for r in runs), metric)
                      for m, runs in methods.items()]
            rows.append(f"| {label} <= {budget:,.2f} {unit} "
                        f"({owners_of(owners, 'costliest seed', 'costliest seeds')}) | "
                        f"{verdict(scores, start)}")
    for budget, owners in rungs([(max(r.peak_mb for r in runs), m)
                                 for m, runs in methods.items()]):
        fits = [Score(m, tuple(r.final for r in runs), metric) for m, runs in methods.items()
                if max(r.peak_mb for r in runs) <= budget * (1 + 1e-9)]
        whose = owners_of(owners, "largest", "largest")
        rows.append(f"| (c) client peak <= {budget:,.0f} MB ({whose}) | {verdict(fits, start)}")
    # keep the table's order (a), (b), (c), (d)
    head, body = rows[:2], rows[2:]
    return head + sorted(body, key=lambda row: row.split(")")[0])


def method_table(methods: dict[str, list[Run]], bounds: dict[str, list[Run]],
                 side_by_side: bool = False) -> list[str]:
    """Each method's (and bound's) totals and final quality over seeds; with ``side_by_side``
    compute, the seconds a round the runs recorded too (their range shows the machine's drift
    between pieces)."""
    metric = next(r.metric for table in (methods, bounds) for runs in table.values()
                  for r in runs)
    lm = metric.lower_is_better
    extra = " client s a round as recorded [min-max] |" if side_by_side else ""
    quality = ("start loss | final loss mean [min-max] | reference loss start -> final "
               "(forgetting) |" if lm else "start acc | final acc mean [min-max], mean loss |")
    rows = [f"| method | seeds | {quality} "
            f"MB on the wire | client peak MB (mean) | client compute s |{extra}",
            "|" + "---|" * (7 + lm + side_by_side)]
    for label, table in (("", methods), ("bound: ", bounds)):
        for m, runs in table.items():
            final = Score(m, tuple(r.final for r in runs), metric)
            recorded = [r.recorded_s for r in runs]
            start = mean(metric.shown(r.points[0]) for r in runs)
            cells = f"{start:.3f} | {final.short() if lm else final.cell()} |"
            if lm:
                cells += f" {forgetting(runs)} |"
            rows.append(
                f"| {label}{m} | {len(runs)} | {cells} "
                f"{mean(r.final.mb for r in runs):,.2f} | "
                f"{mean(r.peak_mb for r in runs):,.0f} | "
                f"{mean(r.final.client_s for r in runs):,.1f} |"
                + (f" {min(recorded):.1f}-{max(recorded):.1f} |" if side_by_side else ""))
    return rows


def forgetting(runs: list[Run]) -> str:
    """The reference text's loss before training and after, mean over seeds ("-" where the
    runs did not score one)."""
    before = [r.points[0].reference for r in runs]
    after = [r.final.reference for r in runs]
    if any(v is None for v in before + after):
        return "-"
    first, last = mean(v for v in before if v is not None), mean(v for v in after if v is not None)
    return f"{first:.3f} -> {last:.3f} ({last - first:+.3f})"


def _at(runs: list[Run], examples: int) -> Score | None:
    """A method's evaluation at ``examples`` seen, over its seeds (None where a seed has none
    there)."""
    points = [next((p for p in r.points if p.examples == examples), None) for r in runs]
    if any(p is None for p in points):
        return None
    return Score(runs[0].method, tuple(p for p in points if p is not None), runs[0].metric)


def learning_curve(methods: dict[str, list[Run]], bounds: dict[str, list[Run]]) -> list[str]:
    """Accuracy at each evaluation point, who is ahead, and full-parameter against LoRA with
    the crossing point. Empty where the runs have one evaluation after round 0, or no saved
    config to count their examples."""
    runs = [r for table in (methods, bounds) for rs in table.values() for r in rs]
    if any(p.examples is None for r in runs for p in r.points):
        return []
    seen = sorted({p.examples for rs in methods.values() for r in rs for p in r.points
                   if p.examples})
    if len(seen) < 2:
        return []
    fed = next(r for rs in methods.values() for r in rs)
    per_client_round = (fed.points[-1].examples or 0) // max(1, fed.client_rounds)
    names = list(methods) + [f"bound: {m}" for m in bounds]
    lines = ["### Learning curve", "",
             f"{fed.metric.name.capitalize()}: mean [min-max over seeds] after each number of "
             "training examples (and "
             "the client-rounds they are); the leader among the federated methods, its margin "
             "over the runner-up and whether its worst seed beats the runner-up's best.", "",
             f"| client-rounds (examples) | {' | '.join(names)} | ahead | margin | "
             "against the seeds |", "|" + "---|" * (len(names) + 4)]
    full_vs_lora: list[tuple[int, Score, Score]] = []
    for examples in seen:
        scores = {m: _at(rs, examples) for m, rs in methods.items()}
        scores.update({f"bound: {m}": _at(rs, examples) for m, rs in bounds.items()})
        cells = [s.short() if s else "-" for s in scores.values()]
        ranked = sorted((s for m, s in scores.items() if s and not m.startswith("bound: ")),
                        key=lambda s: (-s.mean, s.loss))
        lead = (f"{ranked[0].method} | {fed.metric.margin(ranked[0].mean - ranked[1].mean)} | "
                f"{standing(ranked[0], ranked[1])}" if len(ranked) > 1 else " | | ")
        rounds = examples / per_client_round if per_client_round else 0
        lines.append(f"| {rounds:g} ({examples:,}) | {' | '.join(cells)} | {lead} |")
        # each family's best among the methods run at the most seeds here, so a method
        # with one lucky seed does not stand in for a family measured on three
        most = max((len(s.values) for s in ranked), default=0)
        full = [s for s in ranked if not methods[s.method][0].lora and len(s.values) == most]
        lora = [s for s in ranked if methods[s.method][0].lora and len(s.values) == most]
        if full and lora:
            full_vs_lora.append((examples, full[0], lora[0]))
    if full_vs_lora:
        lines += ["", "The best full-parameter method against the best LoRA one (by mean, "
                  "among the methods run at the most seeds):", "",
                  *crossing(full_vs_lora, per_client_round)]
    return lines


def crossing(pairs: list[tuple[int, Score, Score]], per_client_round: int) -> list[str]:
    """The best full-parameter method against the best LoRA one at each evaluation, and the
    point from which one of them stays ahead (and clear) to the last evaluation."""
    def rounds(examples: int) -> str:
        return f"{examples / per_client_round:g}" if per_client_round else f"{examples:,} ex."

    lines = ["| client-rounds | best full-parameter | best LoRA | full - LoRA | "
             "against the seeds |", "|---|---|---|---|---|"]
    for examples, full, lora in pairs:
        lead, other = (full, lora) if full.mean >= lora.mean else (lora, full)
        metric = full.metric
        lines.append(f"| {rounds(examples)} | {full.method} "
                     f"{mean(metric.shown(p) for p in full.points):.3f} | {lora.method} "
                     f"{mean(metric.shown(p) for p in lora.points):.3f} | "
                     f"{metric.margin(full.mean - lora.mean)} | {standing(lead, other)} |")
    ahead = ["full" if f.mean > lo.mean else "lora" if lo.mean > f.mean else "tie"
             for _, f, lo in pairs]
    last = ahead[-1]
    start = len(ahead)
    while start > 0 and ahead[start - 1] == last:
        start -= 1
    who = {"full": "full-parameter training", "lora": "LoRA", "tie": "neither"}[last]
    if last == "tie":
        text = "At the last evaluation the two are tied."
    elif start == 0:
        text = f"{who[0].upper()}{who[1:]} is ahead at every evaluation: no crossing."
    else:
        text = (f"Crossing: {who} is ahead from {rounds(pairs[start][0])} client-rounds on, "
                f"to the last evaluation.")
    clear = [(standing(f, lo) == CLEAR and f.mean > lo.mean) if last == "full" else
             (standing(lo, f) == CLEAR and lo.mean > f.mean) for _, f, lo in pairs]
    first_clear = len(clear)
    while first_clear > 0 and clear[first_clear - 1]:
        first_clear -= 1
    if any(standing(f, lo) == ONE_SEED for _, f, lo in pairs[start:]):
        text += " One seed: no spread to judge by."
    elif last != "tie":
        text += (f" Clear of the seed spread from {rounds(pairs[first_clear][0])} "
                 "client-rounds on." if first_clear < len(clear) else
                 " Not clear of the seed spread at the last evaluation.")
    return [*lines, "", text]


def compute_source(compute: dict[str, Any] | None) -> str:
    """The report's sentence on where the client compute comes from."""
    if compute is None:
        return "Client compute: per round the slowest client's training time, summed."
    meta = compute.get("meta", {})
    pieces = len(meta.get("commands", []))
    how = f"side by side, in {pieces} pieces," if pieces > 1 else "side by side in one piece"
    return ("Client compute: the rounds run times the method's client seconds a round (the "
            f"slowest client of each round), measured {how} by "
            f"`client_compute.py` ({meta.get('rounds', '?')} rounds a method, "
            f"{meta.get('bound_rounds', '?')} a bound; {commands_line(meta)}; finished "
            f"{meta.get('time', '?')}), not the seconds the runs recorded: those come from "
            "pieces run at different machine speeds (their range is the last column).")


def report(results: dict[str, dict[str, Any]], meta: dict[str, Any],
           compute: dict[str, Any] | None = None) -> str:
    """``payoff.md``: per task and partition, the methods and the four comparisons; with
    ``compute`` (:func:`load_compute`) the compute budget is the side-by-side measurement's."""
    grouped = groups(results, compute)
    lines = [f"# The payoff: profile `{meta.get('profile', '?')}`", "",
             f"{commands_line(meta)}  ",
             f"Machine: {meta.get('machine', '?')}; finished {meta.get('time', '?')}.  ",
             f"Runs: {len(results)}, {sum(r['wall_s'] for r in results.values()) / 60:.1f} min "
             "of wall time together.", "",
             "Accuracy: the task's eval accuracy (exact match for a generative task); for "
             "language modelling the quality is the held-out loss per token (lower is better; "
             f"clear: the worst seed beats the runner-up's best by {LOSS.clear_by} nats or "
             "more) and the reference text's loss shows the forgetting. MB: "
             "payloads both ways, all client-rounds. Client peak: RSS of the client process. "
             f"{compute_source(compute)} A bound "
             "is centralized training on one node holding the whole training set, the same "
             "examples in total; it does not compete.", ""]
    tasks = sorted({t for t, _ in grouped})
    for task in tasks:
        bounds = grouped.get((task, CENTRAL), {})
        for (t, part), methods in sorted(grouped.items()):
            if t != task or part == CENTRAL:
                continue
            lines += [f"## {task or 'task'} / {part}", "",
                      *method_table(methods, bounds, compute is not None), "",
                      *comparisons(methods), ""]
            curve_lines = learning_curve(methods, bounds)
            lines += [*curve_lines, ""] if curve_lines else []
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], out: Path,
         compute: dict[str, Any] | None = None) -> list[Path]:
    """Per task and partition: quality (accuracy, or an lm task's held-out loss) vs cumulative
    MB, vs client peak MB, vs cumulative client compute seconds and (where the runs saved their
    config) vs training examples seen;
    a curve per method (mean over seeds, the band their range), bounds as dashed lines (or,
    against examples, their own curves). Where every run measured the reference text (an lm
    task), one more panel sets each method's final held-out loss against its final reference
    loss, the forgetting (mean over seeds, bars their range; the untrained model's reference
    loss a dotted line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = groups(results, compute)
    names = sorted({m for table in grouped.values() for m in table})
    colour = {m: f"C{i % 10}" for i, m in enumerate(names)}
    saved = []
    for (task, part), methods in sorted(grouped.items()):
        if part == CENTRAL:
            continue
        bounds = grouped.get((task, CENTRAL), {})
        metric = next(r.metric for runs in methods.values() for r in runs)
        by_examples = all(p.examples is not None for table in (methods, bounds)
                          for runs in table.values() for r in runs for p in r.points)
        everyone = [r for table in (methods, bounds) for runs in table.values() for r in runs]
        by_reference = all(p.reference is not None for r in everyone for p in r.points)
        panels = 3 + by_examples + by_reference
        fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 5))
        curves: list[tuple[Any, Callable[[Point], float]]] = [
            (axes[0], lambda p: p.mb), (axes[2], lambda p: p.client_s)]
        if by_examples:
            curves.append((axes[3], lambda p: float(p.examples or 0)))
        for m, runs in methods.items():
            count = min(len(r.points) for r in runs)
            for ax, cost in curves:
                xs = [mean(cost(r.points[i]) for r in runs) for i in range(count)]
                ys = [[metric.shown(r.points[i]) for r in runs] for i in range(count)]
                ax.plot(xs, [mean(y) for y in ys], "o-", color=colour[m], label=m)
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys],
                                color=colour[m], alpha=0.15)
            finals = [metric.shown(r.final) for r in runs]
            peak = mean(r.peak_mb for r in runs)
            axes[1].errorbar([peak], [mean(finals)], color=colour[m], fmt="o", capsize=4,
                             yerr=[[mean(finals) - min(finals)], [max(finals) - mean(finals)]],
                             label=m)
        for m, runs in bounds.items():
            for ax in axes[:3]:
                ax.axhline(mean(metric.shown(r.final) for r in runs), color=colour[m],
                           linestyle="--", label=f"bound: {m}")
            if by_examples:
                count = min(len(r.points) for r in runs)
                axes[3].plot([float(runs[0].points[i].examples or 0) for i in range(count)],
                             [mean(metric.shown(r.points[i]) for r in runs)
                              for i in range(count)],
                             "s--", color=colour[m], label=f"bound: {m}")
        xlabels = ["cumulative MB on the wire (payloads, down + up)", "client peak RSS (MB)",
                   "cumulative client compute (s, slowest client a round"
                   + (", measured side by side)" if compute else ")")]
        xlabels += ["training examples seen (all nodes)"] if by_examples else []
        if by_reference:
            forgetting_panel(axes[-1], {**methods, **bounds}, colour, metric)
            xlabels.append("reference text's loss after training (the forgetting; nats/token)")
        for ax, xlabel in zip(axes, xlabels, strict=True):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"eval {metric.name}")
            ax.grid(alpha=0.3)
        axes[0].set_xscale("symlog", linthresh=0.01)
        axes[0].set_xlim(left=0)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{task or 'task'} / partition {part}: mean over seeds, band = range")
        fig.tight_layout()
        path = out / f"pareto_{task or 'task'}_{part}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        saved.append(path)
    return saved


def forgetting_panel(ax: Any, methods: dict[str, list[Run]], colour: dict[str, str],
                     metric: Metric) -> None:
    """Each method's final held-out quality against its final reference loss: mean over seeds,
    bars the range both ways; the untrained model's reference loss a dotted line."""
    for m, runs in methods.items():
        ys = [metric.shown(r.final) for r in runs]
        xs = [float(r.final.reference or 0.0) for r in runs]
        ax.errorbar([mean(xs)], [mean(ys)], fmt="o", color=colour[m], capsize=4, label=m,
                    xerr=[[mean(xs) - min(xs)], [max(xs) - mean(xs)]],
                    yerr=[[mean(ys) - min(ys)], [max(ys) - mean(ys)]])
    start = [float(r.points[0].reference or 0.0) for runs in methods.values() for r in runs]
    ax.axvline(mean(start), color="grey", linestyle=":", label="untrained")
    ax.legend(fontsize=7)


def main() -> None:
    """Write payoff.md and the Pareto plots beside a profile's results.json."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    saved = json.loads(args.results.read_text())
    compute = load_compute(args.results.parent)
    text = report(saved["runs"], saved.get("meta", {}), compute)
    (args.results.parent / "payoff.md").write_text(text)
    plot(saved["runs"], args.results.parent, compute)
    print(text)


if __name__ == "__main__":
    main()
