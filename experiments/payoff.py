"""The payoff report: which method gives the best model at equal client-rounds, bytes on the
wire, client peak memory and client compute time, with the seed spread shown.

Reads the results of a profile run by ``run_experiments.py`` (several seeds per method, one or
more tasks and partitions, centralized bounds on one node) and writes ``payoff.md`` and one
Pareto figure per task and partition, ``pareto_<task>_<partition>.png``.

    python experiments/payoff.py experiments/results/payoff/results.json

Quality is the task's eval accuracy (exact match for a generative task). A method's quality at
a budget is, per seed, that of its last evaluation reached within the budget (round 0, the
untrained model, is always within it); the budget ladder of each axis is every method's own
total at its costliest seed (so all its seeds finish within its own rung), and each row
answers "with as much as method X spends, who is best?". Memory is a threshold, not a running
sum: at a budget of M MB, the methods whose client peak (the largest over seeds) is at most M
compete with their final quality. The untrained model (round 0) competes at every budget: it
costs nothing, and a method that has not beaten it has not paid off. A winner is *clear* when
its worst seed beats the runner-up's best seed; otherwise the difference is inside the seed
spread.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

MB = 2**20
CENTRAL = "central"
UNTRAINED = "the untrained model"


@dataclass(frozen=True)
class Point:
    """One evaluation of a run, with what the run had spent by then."""

    round: int
    accuracy: float
    loss: float
    mb: float  # payloads both ways, cumulative
    client_s: float  # the round's slowest client training time, cumulative


@dataclass(frozen=True)
class Run:
    """One run's curve and its constant client peak."""

    method: str
    seed: int
    points: tuple[Point, ...]
    peak_mb: float
    client_rounds: int

    @property
    def final(self) -> Point:
        return self.points[-1]


def curve(result: dict[str, Any]) -> Run:
    """A run of ``results.json`` as a :class:`Run`."""
    sent = seconds = 0.0
    points = []
    for rec in result["records"]:
        sent += (rec.get("bytes_down", 0) + rec.get("bytes_up", 0)) / MB
        seconds += rec.get("client_train_s", 0.0)
        if rec.get("eval_accuracy") is not None:
            points.append(Point(int(rec["round"]), float(rec["eval_accuracy"]),
                                float(rec["eval_loss"]), sent, seconds))
    if not points:
        raise ValueError(f"run {result['id']} has no evaluation")
    return Run(result["method"], int(result["seed"]), tuple(points),
               float(result["client_process_peak_mb"]), int(result["client_rounds"]))


def groups(results: dict[str, dict[str, Any]]) -> dict[tuple[str, str], dict[str, list[Run]]]:
    """(task, partition) -> method -> its runs (one per seed). Bounds sit under partition
    ``central`` of their task."""
    out: dict[tuple[str, str], dict[str, list[Run]]] = {}
    for result in results.values():
        key = (result.get("task", ""), result["partition"])
        out.setdefault(key, {}).setdefault(result["method"], []).append(curve(result))
    return out


@dataclass(frozen=True)
class Score:
    """A method's quality over its seeds: accuracy, and eval loss to break a tie."""

    method: str
    points: tuple[Point, ...]

    @property
    def values(self) -> tuple[float, ...]:
        return tuple(p.accuracy for p in self.points)

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
        lo, hi = min(self.values), max(self.values)
        return f"{self.mean:.3f} [{lo:.3f}-{hi:.3f}], loss {self.loss:.3f}"


def within(run: Run, cost: Callable[[Point], float], budget: float) -> Point:
    """The run's last evaluation whose cost is within ``budget`` (round 0 always is)."""
    reached = [p for p in run.points if cost(p) <= budget * (1 + 1e-9)]
    return reached[-1] if reached else run.points[0]


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
    if min(len(best.values), len(second.values)) < 2:
        spread = "one seed: no spread to judge by"
    elif min(best.values) > max(second.values):
        spread = "clear"
    elif margin == 0 and min(best.values) == max(best.values) == min(second.values):
        spread = "a tie (the loss decides the order)"
    else:
        spread = "inside the spread"
    return (f"{best.method} {best.cell()} | {second.method} {second.cell()} | "
            f"{margin * 100:+.1f} points | {spread} |")


def untrained(methods: dict[str, list[Run]]) -> Score:
    """The untrained model's evaluation per seed (round 0; every method of a task and
    partition evaluates the same weights on the same rows, so any method's will do)."""
    runs = next(iter(methods.values()))
    return Score(UNTRAINED, tuple(r.points[0] for r in runs))


def comparisons(methods: dict[str, list[Run]]) -> list[str]:
    """The four comparisons for one task and partition, as Markdown table rows."""
    rows = ["| budget | winner: accuracy, mean [min-max over seeds] | runner-up | margin | "
            "against the seeds |", "|---|---|---|---|---|"]
    finals = [Score(m, tuple(r.final for r in runs)) for m, runs in methods.items()]
    start = untrained(methods)
    rounds = sorted({r.client_rounds for runs in methods.values() for r in runs})
    rows.append(f"| (a) equal client-rounds ({', '.join(map(str, rounds))}) | "
                f"{verdict(finals, start)}")
    axes: list[tuple[str, str, Callable[[Point], float], Callable[[Run], float]]] = [
        ("(b) bytes", "MB", lambda p: p.mb, lambda r: r.final.mb),
        ("(d) client compute", "s", lambda p: p.client_s, lambda r: r.final.client_s),
    ]
    for label, unit, cost, total in axes:
        ladder = sorted((max(total(r) for r in runs), m) for m, runs in methods.items())
        for budget, owner in ladder:
            scores = [Score(m, tuple(within(r, cost, budget) for r in runs))
                      for m, runs in methods.items()]
            rows.append(f"| {label} <= {budget:,.2f} {unit} ({owner}'s costliest seed) | "
                        f"{verdict(scores, start)}")
    for budget, owner in sorted((max(r.peak_mb for r in runs), m) for m, runs in methods.items()):
        fits = [Score(m, tuple(r.final for r in runs)) for m, runs in methods.items()
                if max(r.peak_mb for r in runs) <= budget * (1 + 1e-9)]
        rows.append(f"| (c) client peak <= {budget:,.0f} MB ({owner}'s largest) | "
                    f"{verdict(fits, start)}")
    # keep the table's order (a), (b), (c), (d)
    head, body = rows[:2], rows[2:]
    return head + sorted(body, key=lambda row: row.split(")")[0])


def method_table(methods: dict[str, list[Run]], bounds: dict[str, list[Run]]) -> list[str]:
    """Each method's (and bound's) totals and final quality over seeds."""
    rows = ["| method | seeds | start acc | final acc mean [min-max], mean loss | "
            "MB on the wire | client peak MB | client compute s |", "|" + "---|" * 7]
    for label, table in (("", methods), ("bound: ", bounds)):
        for m, runs in table.items():
            acc = Score(m, tuple(r.final for r in runs))
            rows.append(
                f"| {label}{m} | {len(runs)} | {mean(r.points[0].accuracy for r in runs):.3f} | "
                f"{acc.cell()} | "
                f"{mean(r.final.mb for r in runs):,.2f} | "
                f"{mean(r.peak_mb for r in runs):,.0f} | "
                f"{mean(r.final.client_s for r in runs):,.1f} |")
    return rows


def report(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """``payoff.md``: per task and partition, the methods and the four comparisons."""
    grouped = groups(results)
    lines = [f"# The payoff: profile `{meta.get('profile', '?')}`", "",
             f"Command: `{meta.get('command', '?')}`  ",
             f"Machine: {meta.get('machine', '?')}; finished {meta.get('time', '?')}.  ",
             f"Runs: {len(results)}, {sum(r['wall_s'] for r in results.values()) / 60:.1f} min "
             "of wall time together.", "",
             "Accuracy: the task's eval accuracy (exact match for a generative task). MB: "
             "payloads both ways, all client-rounds. Client peak: RSS of the client process. "
             "Client compute: per round the slowest client's training time, summed. A bound "
             "is centralized training on one node holding the whole training set, the same "
             "examples in total; it does not compete.", ""]
    tasks = sorted({t for t, _ in grouped})
    for task in tasks:
        bounds = grouped.get((task, CENTRAL), {})
        for (t, part), methods in sorted(grouped.items()):
            if t != task or part == CENTRAL:
                continue
            lines += [f"## {task or 'task'} / {part}", "", *method_table(methods, bounds), "",
                      *comparisons(methods), ""]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """Per task and partition: accuracy vs cumulative MB, vs client peak MB and vs cumulative
    client compute seconds; a curve per method (mean over seeds, the band their range),
    bounds as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = groups(results)
    names = sorted({m for table in grouped.values() for m in table})
    colour = {m: f"C{i % 10}" for i, m in enumerate(names)}
    saved = []
    for (task, part), methods in sorted(grouped.items()):
        if part == CENTRAL:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(17, 5))
        for m, runs in methods.items():
            count = min(len(r.points) for r in runs)
            for ax, cost in ((axes[0], lambda p: p.mb), (axes[2], lambda p: p.client_s)):
                xs = [mean(cost(r.points[i]) for r in runs) for i in range(count)]
                ys = [[r.points[i].accuracy for r in runs] for i in range(count)]
                ax.plot(xs, [mean(y) for y in ys], "o-", color=colour[m], label=m)
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys],
                                color=colour[m], alpha=0.15)
            finals = [r.final.accuracy for r in runs]
            peak = mean(r.peak_mb for r in runs)
            axes[1].errorbar([peak], [mean(finals)], color=colour[m], fmt="o", capsize=4,
                             yerr=[[mean(finals) - min(finals)], [max(finals) - mean(finals)]],
                             label=m)
        for m, runs in grouped.get((task, CENTRAL), {}).items():
            for ax in axes:
                ax.axhline(mean(r.final.accuracy for r in runs), color=colour[m],
                           linestyle="--", label=f"bound: {m}")
        for ax, xlabel in zip(axes, ("cumulative MB on the wire (payloads, down + up)",
                                     "client peak RSS (MB)",
                                     "cumulative client compute (s, slowest client a round)"),
                              strict=True):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("eval accuracy")
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


def main() -> None:
    """Write payoff.md and the Pareto plots beside a profile's results.json."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    saved = json.loads(args.results.read_text())
    text = report(saved["runs"], saved.get("meta", {}))
    (args.results.parent / "payoff.md").write_text(text)
    plot(saved["runs"], args.results.parent)
    print(text)


if __name__ == "__main__":
    main()
