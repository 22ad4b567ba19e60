"""Eval loss against cumulative wire bytes for every scheme of several ``bench_comm`` runs.

    python experiments/plot_comm.py experiments/results/bench_comm_defaults.json \\
        experiments/results/bench_comm_defaults_lora.json --out experiments/results/comm_all

``bench_comm.py`` writes one JSON per run; runs of one profile share the model, partitions,
seeds and rounds, so their curves belong on one plot. Prints each scheme's points and, for every
pair, the loss each had reached when the cheaper one's run ended (at equal cumulative bytes:
each curve's last evaluation at or below those bytes), then saves ``<out>.png`` and
``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def loss_at(curve: list[list[float]], at_bytes: float) -> float | None:
    """The curve's loss at its last evaluation at or below ``at_bytes`` (``None``: none)."""
    seen = [loss for spent, loss in curve if spent <= at_bytes]
    return seen[-1] if seen else None


def main() -> None:
    """Merge the curves, compare them at equal bytes, plot."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="bench_comm JSON files of one profile")
    parser.add_argument("--out", required=True, help="output stem (.png and .json)")
    args = parser.parse_args()
    curves: dict[str, list[list[float]]] = {}
    sources: dict[str, str] = {}
    for path in args.results:
        data = json.loads(Path(path).read_text())
        for name, curve in data["loss_vs_bytes"].items():
            # a scheme run again in another file (another tag or seed) keeps both curves
            key = name if name not in curves else f"{name} [{Path(path).stem}]"
            curves[key] = [[float(b), float(x)] for b, x in curve]
            sources[key] = str(path)
    print(f"{'scheme':<24}{'MB at each evaluation -> eval loss'}")
    for name, curve in curves.items():
        points = ", ".join(f"{b / 1e6:.0f}: {x:.4f}" for b, x in curve)
        print(f"{name:<24}{points}")
    pairs: list[dict[str, Any]] = []
    names = list(curves)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            budget = min(curves[a][-1][0], curves[b][-1][0])
            pairs.append({"a": a, "b": b, "bytes": budget, "loss_a": loss_at(curves[a], budget),
                          "loss_b": loss_at(curves[b], budget)})
    print("\nat equal cumulative bytes (the cheaper run's total):")
    for p in pairs:
        print(f"  {p['bytes'] / 1e6:8.0f} MB  {p['a']}: {p['loss_a']}  {p['b']}: {p['loss_b']}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        spent = [(b, x) for b, x in curve if b > 0]  # the log axis has no zero
        ax.plot([b / 1e6 for b, _ in spent], [x for _, x in spent], marker="o", label=name)
    starts = {x for b, x in (c[0] for c in curves.values()) if b == 0}
    for start in starts:
        ax.axhline(start, color="grey", linestyle=":", linewidth=1)  # before training
    ax.set_xscale("log")
    ax.set_xlabel("cumulative wire MB (down + up, all nodes)")
    ax.set_ylabel("eval loss")
    ax.set_title("eval loss vs bytes on the wire")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(args.out)
    fig.savefig(out.with_suffix(".png"), dpi=120)
    out.with_suffix(".json").write_text(json.dumps(
        {"sources": sources, "curves": curves, "equal_bytes": pairs}, indent=1))
    print(f"saved {out.with_suffix('.png')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
