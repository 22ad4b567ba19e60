"""Privacy against utility at the example level: the table and plot of the ``privacy-example``
profile's runs (``dp = "example"``: DP-SGD on ``fo``'s block, its zeroth-order analogue for
``lezo``).

Reads the profile's ``results.json`` (written by ``run_experiments.py --profile
privacy-example``) and gives, per rule and privacy level, mean [min-max] over seeds of the
epsilon the largest node spent, exact match and response loss on the test questions, the
client's training peak and compute seconds; the plot shows exact match and loss against epsilon,
each rule's no-DP seed range as a band.

    python experiments/privacy_example_report.py   # after the profile; rewrites the two files

Results: ``experiments/results/privacy-example/privacy_utility.md`` and ``privacy_utility.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "privacy-example"


def spread(values: list[float], digits: int = 3) -> str:
    """``mean [min-max]`` (the value alone for one seed)."""
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run: its rule, level (``None``: no DP), seed and figures."""
    out = []
    for run in results["runs"].values():
        s, c = run["summary"], run["config"]
        out.append({
            "rule": c["update-rule"],
            "level": c.get("dp-target-epsilon") if c.get("dp") == "example" else None,
            "seed": run["seed"],
            "lr": c["lr"],
            "noise": c.get("dp-noise-multiplier"),
            "spent": s.get("dp_epsilon"),
            "exact": s["final_eval_accuracy"],
            "loss": s["final_eval_loss"],
            "before": s["initial_eval_loss"],
            "peak": s["client_peak_mem_mb"],
        })
    return out


Key = tuple[str, float | None, float]  # rule, level (None: no DP), learning rate


def groups(runs: list[dict[str, Any]]) -> dict[Key, list[dict[str, Any]]]:
    """Runs by (rule, level, learning rate), rules in first-seen order, no DP first, then looser to
    tighter. A row never mixes rates: while a rerun at a new rate is half done, the old and the
    new rate are separate rows, each with its own seed count."""
    keyed: dict[Key, list[dict[str, Any]]] = {}
    rules = list(dict.fromkeys(r["rule"] for r in runs))
    for r in sorted(runs, key=lambda r: (rules.index(r["rule"]),
                                         -math.inf if r["level"] is None else -r["level"],
                                         r["lr"])):
        keyed.setdefault((r["rule"], r["level"], r["lr"]), []).append(r)
    return keyed


def table(results: dict[str, Any]) -> str:
    runs = rows(results)
    before = statistics.fmean(r["before"] for r in runs)
    meta = results.get("meta", {})
    lines = [
        "# Example-level DP against utility (profile `privacy-example`)",
        "",
        f"Runs: `{meta.get('command', '')}`; machine: {meta.get('machine', '?')}; "
        f"report: `python experiments/privacy_example_report.py`.",
        f"Untrained: exact match 0.000, response loss {before:.3f}. Values: mean [min-max] over "
        "seeds. Epsilon: what the largest node spent (delta 1e-5).",
        "",
        "| rule | privacy | lr | noise multiplier | epsilon spent | exact match | response loss "
        "| client training peak MB | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (rule, level, lr), mine in groups(runs).items():
        name = "no DP" if level is None else f"epsilon <= {level:g}"
        noise = "-" if level is None else f"{mine[0]['noise']:g}"
        spent = "-" if level is None else spread([r["spent"] for r in mine], 2)
        lines.append(
            f"| {rule} | {name} | {lr:g} | {noise} | {spent} "
            f"| {spread([r['exact'] for r in mine])} | {spread([r['loss'] for r in mine])} "
            f"| {spread([r['peak'] for r in mine], 0)} | {len(mine)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rows(results)
    keyed = groups(runs)
    # one curve per rule and DP learning rate, one band per rule and no-DP rate; the rate joins
    # the label only where a rule has more than one
    curves = list(dict.fromkeys((rule, lr) for rule, level, lr in keyed if level is not None))
    bands = list(dict.fromkeys((rule, lr) for rule, level, lr in keyed if level is None))
    rules = list(dict.fromkeys(rule for rule, _, _ in keyed))

    def label(rule: str, lr: float, pairs: list[tuple[str, float]], what: str) -> str:
        several = sum(r == rule for r, _ in pairs) > 1
        return f"{rule}, {what}" + (f", lr {lr:g}" if several else "")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "exact", "exact match (test)"),
                          (axes[1], "loss", "response loss (test)")):
        for k, (rule, lr) in enumerate(curves):
            levels = sorted(level for r, level, rate in keyed
                            if r == rule and rate == lr and level is not None)
            xs, ys, lo, hi = [], [], [], []
            for level in levels:
                values = [r[key] for r in keyed[(rule, level, lr)]]
                xs.append(level * (1 + 0.05 * (k - (len(curves) - 1) / 2)))  # side by side
                ys.append(statistics.fmean(values))
                lo.append(ys[-1] - min(values))
                hi.append(max(values) - ys[-1])
            first = [r for r, _ in curves].index(rule) == k  # a rule's other rates dashed
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", color=f"C{rules.index(rule)}",
                        label=label(rule, lr, curves, "DP"), linestyle="-" if first else "--")
        for rule, lr in bands:
            base = [r[key] for r in keyed[(rule, None, lr)]]
            ax.axhspan(min(base), max(base), color=f"C{rules.index(rule)}", alpha=0.2,
                       label=label(rule, lr, bands, "no DP (seed range)"))
        if key == "loss":
            ax.axhline(statistics.fmean(r["before"] for r in runs), color="grey",
                       linestyle="--", label="untrained")
        ax.set_xscale("log")
        ticks = sorted({level for _, level, _ in keyed if level is not None})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("epsilon target (delta 1e-5), example level")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M on ToMi, 8 nodes: example-level DP, seed range")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = json.loads((args.results / "results.json").read_text())
    text = table(results)
    (args.results / "privacy_utility.md").write_text(text)
    plot(results, args.results / "privacy_utility.png")
    print(text)


if __name__ == "__main__":
    main()
