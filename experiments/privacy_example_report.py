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


def groups(runs: list[dict[str, Any]]) -> dict[tuple[str, float | None], list[dict[str, Any]]]:
    """Runs by (rule, level), rules in first-seen order, no DP first, then looser to tighter."""
    keyed: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    rules = list(dict.fromkeys(r["rule"] for r in runs))
    for r in sorted(runs, key=lambda r: (rules.index(r["rule"]),
                                         -math.inf if r["level"] is None else -r["level"])):
        keyed.setdefault((r["rule"], r["level"]), []).append(r)
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
    for (rule, level), mine in groups(runs).items():
        name = "no DP" if level is None else f"epsilon <= {level:g}"
        noise = "-" if level is None else f"{mine[0]['noise']:g}"
        spent = "-" if level is None else spread([r["spent"] for r in mine], 2)
        lines.append(
            f"| {rule} | {name} | {mine[0]['lr']:g} | {noise} | {spent} "
            f"| {spread([r['exact'] for r in mine])} | {spread([r['loss'] for r in mine])} "
            f"| {spread([r['peak'] for r in mine], 0)} | {len(mine)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rows(results)
    keyed = groups(runs)
    rules = list(dict.fromkeys(rule for rule, _ in keyed))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "exact", "exact match (test)"),
                           (axes[1], "loss", "response loss (test)")):
        for k, rule in enumerate(rules):
            levels = sorted(level for r, level in keyed if r == rule and level is not None)
            xs, ys, lo, hi = [], [], [], []
            for level in levels:
                values = [r[key] for r in keyed[(rule, level)]]
                xs.append(level * (1 + 0.05 * (k - (len(rules) - 1) / 2)))  # side by side
                ys.append(statistics.fmean(values))
                lo.append(ys[-1] - min(values))
                hi.append(max(values) - ys[-1])
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", color=f"C{k}", label=f"{rule}, DP")
            base = [r[key] for r in keyed.get((rule, None), [])]
            if base:
                ax.axhspan(min(base), max(base), color=f"C{k}", alpha=0.2,
                           label=f"{rule}, no DP (seed range)")
        if key == "loss":
            ax.axhline(statistics.fmean(r["before"] for r in runs), color="grey",
                       linestyle="--", label="untrained")
        ax.set_xscale("log")
        ticks = sorted({level for _, level in keyed if level is not None})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("epsilon target (delta 1e-5), example level")
        ax.set_ylabel(label)
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
