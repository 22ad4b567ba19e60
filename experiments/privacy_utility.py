"""Privacy against utility: user-level DP at several epsilons on a simulated federation.

The real ServerApp and ClientApp on an in-process loopback federation of ``--nodes`` nodes
(``clients-per-round`` of them a round, all on the round's block), ``dp = "central"``: each
privacy level's noise multiplier is the smallest whose accounted epsilon after ``--rounds``
rounds at that sampling rate is at most the level (``dp-delta`` 1e-5), with ``dp-target-epsilon``
set to the level. Beside them the same runs without DP. Per seed the final eval loss and
accuracy; the table gives mean [min-max] over seeds and each level's share of the no-DP run's
loss drop; the plot the loss against epsilon.

    python experiments/privacy_utility.py                 # tiny-llama, 100 nodes, 3 seeds
    python experiments/privacy_utility.py --resume        # skips runs already in results.json

Results: ``experiments/results/privacy/results.json``, ``table.md``, ``privacy_utility.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedcybgd.client.app import app as client_app
from fedcybgd.config import RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.protocol.dp import epsilon
from fedcybgd.server.app import run_server

OUT = Path(__file__).parent / "results" / "privacy"
DELTA = 1e-5
# A 4-layer random Llama, one layer a block, first-order at the rate the Byzantine soak learns
# with; every node of the round on the round's block.
BASE: dict[str, Any] = {
    "model": "tiny-llama", "partitioner": "iid", "clients-per-block": 0,
    "block-schedule": "ascending", "layers-per-block": 1, "update-rule": "fo",
    "local-steps": 2, "batch-size": 4, "max-seq-len": 48, "lr": 1e-3, "eval-every": 0,
    "eval-examples": 128, "eval-batch-size": 32,
}


def noise_for(target: float, rate: float, rounds: int) -> float:
    """The smallest noise multiplier whose epsilon after ``rounds`` at ``rate`` is at most
    ``target`` (bisection on the accountant, which falls as the multiplier grows)."""
    low, high = 0.05, 100.0
    if epsilon([(rate, rounds)], high, DELTA) > target:
        raise ValueError(f"epsilon {target} is out of reach at rate {rate}, {rounds} rounds")
    for _ in range(40):
        mid = math.sqrt(low * high)
        if epsilon([(rate, rounds)], mid, DELTA) > target:
            low = mid
        else:
            high = mid
    return high


def one_run(level: float | None, seed: int, nodes: int, per_round: int, rounds: int,
            clip: float) -> dict[str, Any]:
    rate = per_round / nodes
    dp: dict[str, Any] = {"dp": "off"}
    if level is not None:
        dp = {"dp": "central", "dp-clip-norm": clip, "dp-delta": DELTA,
              "dp-noise-multiplier": noise_for(level, rate, rounds),
              "dp-target-epsilon": level}
    with tempfile.TemporaryDirectory() as tmp:
        config = {**BASE, "num-server-rounds": rounds, "clients-per-round": per_round,
                  "seed": seed, "output-dir": f"{tmp}/out", **dp}
        grid = LoopbackGrid(client_app, nodes, config,
                            node_config=lambda i: {"cache-dir": f"{tmp}/node-{i}"})
        began = time.perf_counter()
        summary = run_server(grid, RunConfig.from_run_config(config), node_wait_s=5)
    return {"epsilon_level": level, "seed": seed, "nodes": nodes, "per_round": per_round,
            "rounds": rounds, "clip": clip if level is not None else None,
            "noise_multiplier": dp.get("dp-noise-multiplier"),
            "epsilon_spent": summary.get("dp_epsilon"), "dp_stop": summary.get("dp_stop"),
            "eval_loss_before": summary["initial_eval_loss"],
            "eval_loss": summary["final_eval_loss"],
            "eval_accuracy": summary["final_eval_accuracy"],
            "wall_s": round(time.perf_counter() - began, 1)}


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} [{min(values):.3f}-{max(values):.3f}]" if len(values) > 1 else f"{mean:.3f}"


def table(results: list[dict[str, Any]]) -> str:
    groups: dict[float | None, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(r["epsilon_level"], []).append(r)
    base = groups.get(None, [])
    drop0 = statistics.fmean(r["eval_loss_before"] - r["eval_loss"] for r in base) if base else 0
    lines = ["| privacy | noise multiplier | epsilon spent | final eval loss | loss drop vs no DP "
             "| eval accuracy | seeds |", "|---|---|---|---|---|---|---|"]
    for level in sorted(groups, key=lambda x: math.inf if x is None else x):
        runs = groups[level]
        drop = statistics.fmean(r["eval_loss_before"] - r["eval_loss"] for r in runs)
        name = "no DP" if level is None else f"epsilon <= {level:g}"
        noise = "-" if level is None else f"{runs[0]['noise_multiplier']:.3f}"
        spent = "-" if level is None else spread([r["epsilon_spent"] for r in runs])
        share = f"{drop / drop0:.0%}" if drop0 else ""
        lines.append(f"| {name} | {noise} | {spent} | {spread([r['eval_loss'] for r in runs])} "
                     f"| {share} | {spread([r['eval_accuracy'] for r in runs])} | {len(runs)} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    levels = sorted({r["epsilon_level"] for r in results if r["epsilon_level"] is not None})
    for level in levels:
        losses = [r["eval_loss"] for r in results if r["epsilon_level"] == level]
        ax.errorbar([level], [statistics.fmean(losses)], fmt="o", color="C0",
                    yerr=[[statistics.fmean(losses) - min(losses)],
                          [max(losses) - statistics.fmean(losses)]])
    base = [r["eval_loss"] for r in results if r["epsilon_level"] is None]
    if base:
        ax.axhspan(min(base), max(base), color="C1", alpha=0.3, label="no DP (seed range)")
    before = [r["eval_loss_before"] for r in results]
    ax.axhline(statistics.fmean(before), color="grey", linestyle="--", label="untrained")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (delta 1e-5), user level")
    ax.set_ylabel("final eval loss")
    ax.set_title("Central DP on FedCyBGD: loss against privacy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--clip", type=float, default=0.3,
                        help="dp-clip-norm (the tiny model's honest deltas: ~0.24-0.32)")
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results: list[dict[str, Any]] = (json.loads(path.read_text())
                                     if args.resume and path.exists() else [])
    done = {(r["epsilon_level"], r["seed"], r["nodes"], r["per_round"], r["rounds"])
            for r in results}
    levels: list[float | None] = [None, *(float(e) for e in args.epsilons.split(","))]
    for seed in (int(s) for s in args.seeds.split(",")):
        for level in levels:
            if (level, seed, args.nodes, args.per_round, args.rounds) in done:
                continue
            r = one_run(level, seed, args.nodes, args.per_round, args.rounds, args.clip)
            results.append(r)
            path.write_text(json.dumps(results, indent=1) + "\n")
            print(f"epsilon {level}, seed {seed}: noise {r['noise_multiplier']}, spent "
                  f"{r['epsilon_spent']}, loss {r['eval_loss_before']:.4f} -> "
                  f"{r['eval_loss']:.4f}, acc {r['eval_accuracy']:.3f}, {r['wall_s']} s",
                  flush=True)
    text = table(results)
    (args.out / "table.md").write_text(text)
    plot(results, args.out / "privacy_utility.png")
    print(text)


if __name__ == "__main__":
    main()
