"""Privacy against utility: user-level DP at several epsilons on a simulated federation.

The real ServerApp and ClientApp on an in-process loopback federation of ``--nodes`` nodes
(``clients-per-round`` of them a round), ``dp = "central"``: each privacy level's noise
multiplier is the smallest whose accounted epsilon after ``--rounds`` rounds at that sampling
rate is at most the level (``dp-delta`` 1e-5), with ``dp-target-epsilon`` set to the level.
Beside them the same runs without DP. Methods (``--methods``, the registry ``METHODS``):
FedCyBGD ``fo`` (every node of the round on the round's block, the server noises the merged
block) and the FedAvg baselines over the whole model and over LoRA adapters under Flower's own
``DifferentialPrivacyServerSideFixedClipping`` (noise on the whole averaged update), accounted
with the same RDP accountant at the same sampling rate, so each level is the same guarantee for
every method. Each method has its own learning rate and clip norm (about its median honest
update norm, measured without DP). Per seed the final eval loss and accuracy; the table gives
mean [min-max] over seeds and each level's share of the same method's no-DP loss drop; the
plot the loss against epsilon per method.

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
from fedcybgd.server.app import RUNNERS

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
# Each method's own settings on top of BASE, and its learning rates: ``lr`` for the runs
# without DP, the lowest final eval loss without DP among 1e-3, 3e-3 and 1e-2 (seed 0,
# `--tune 1e-3,3e-3,1e-2`: results/privacy/tuning.md). The DP runs take the rate with the
# lowest final eval loss at epsilon 4 among 1e-3 and 1e-2 (seed 0, `--tune-dp 1e-3,1e-2`:
# tuning_dp.md; :func:`dp_lr` reads it): under noise a smaller rate may win, as the noise's
# step is proportional to the clip and the clip to the rate.
METHODS: dict[str, dict[str, Any]] = {
    "fedcybgd-fo": {"settings": {}, "lr": 1e-2},
    "fedavg-full": {"settings": {"strategy": "fedavg", "fedavg-params": "full"}, "lr": 1e-2},
    "fedavg-lora": {"settings": {"strategy": "fedavg", "fedavg-params": "lora"}, "lr": 1e-2},
}
# The clip at each rate: the median honest update norm, measured without DP on this federation
# (20 nodes, 2-4 rounds; min-max in brackets): FedCyBGD's one-layer block delta, FedAvg-full's
# whole-model delta, LoRA's adapters (rank 8, q/v).
CLIPS: dict[str, dict[float, float]] = {
    "fedcybgd-fo": {1e-3: 0.3, 1e-2: 2.8},  # 0.311 (0.296-0.322); 2.80 (2.27-3.05)
    "fedavg-full": {1e-3: 3.16, 1e-2: 29.0},  # 3.16 (3.02-3.37); 29.0 (26.4-29.8)
    "fedavg-lora": {1e-3: 0.123, 1e-2: 1.16},  # 0.123 (0.099-0.147); 1.16 (0.97-1.40)
}

def dp_lr(method: str, out: Path = OUT) -> float:
    """The method's rate under DP: its best at epsilon 4 in ``tuning_dp.json``."""
    path = out / "tuning_dp.json"
    tried = [r for r in (json.loads(path.read_text()) if path.exists() else [])
             if r["method"] == method]
    if not tried:
        raise SystemExit(f"{method}: no rate tuned under DP yet; run --tune-dp 1e-3,1e-2 first")
    return float(min(tried, key=lambda r: r["eval_loss"])["lr"])


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


def one_run(method: str, level: float | None, seed: int, nodes: int, per_round: int,
            rounds: int, lr: float | None = None) -> dict[str, Any]:
    rate = per_round / nodes
    spec = METHODS[method]
    lr = lr if lr is not None else spec["lr"] if level is None else dp_lr(method)
    settings = {**spec["settings"], "lr": lr}
    clip: float | None = None
    dp: dict[str, Any] = {"dp": "off"}
    if level is not None:
        if lr not in CLIPS[method]:
            raise SystemExit(f"{method} at lr {lr:g}: no honest update norm measured (CLIPS)")
        clip = CLIPS[method][lr]
        dp = {"dp": "central", "dp-clip-norm": clip, "dp-delta": DELTA,
              "dp-noise-multiplier": noise_for(level, rate, rounds),
              "dp-target-epsilon": level}
    with tempfile.TemporaryDirectory() as tmp:
        config = {**BASE, **settings, "num-server-rounds": rounds,
                  "clients-per-round": per_round, "seed": seed, "output-dir": f"{tmp}/out", **dp}
        grid = LoopbackGrid(client_app, nodes, config,
                            node_config=lambda i: {"cache-dir": f"{tmp}/node-{i}"})
        began = time.perf_counter()
        run = RunConfig.from_run_config(config)
        summary = RUNNERS[run.strategy](grid, run)
    return {"method": method, "lr": run.lr, "epsilon_level": level, "seed": seed,
            "nodes": nodes, "per_round": per_round,
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


def method_of(r: dict[str, Any]) -> str:
    """A result's method."""
    return str(r["method"])


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| method | privacy | lr | noise multiplier | clip | epsilon spent | final eval loss "
             "| loss drop vs its no DP | eval accuracy | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method in [m for m in METHODS if any(method_of(r) == m for r in results)]:
        groups: dict[float | None, list[dict[str, Any]]] = {}
        for r in results:
            if method_of(r) == method:
                groups.setdefault(r["epsilon_level"], []).append(r)
        base = groups.get(None, [])
        drop0 = (statistics.fmean(r["eval_loss_before"] - r["eval_loss"] for r in base)
                 if base else 0)
        for level in sorted(groups, key=lambda x: math.inf if x is None else x):
            runs = groups[level]
            drop = statistics.fmean(r["eval_loss_before"] - r["eval_loss"] for r in runs)
            name = "no DP" if level is None else f"epsilon <= {level:g}"
            noise = "-" if level is None else f"{runs[0]['noise_multiplier']:.3f}"
            clip = "-" if level is None else f"{runs[0]['clip']:g}"
            spent = "-" if level is None else spread([r["epsilon_spent"] for r in runs])
            share = f"{drop / drop0:.0%}" if drop0 else ""
            lines.append(f"| {method} | {name} | {runs[0]['lr']:g} | {noise} | {clip} | {spent} "
                         f"| {spread([r['eval_loss'] for r in runs])} | {share} "
                         f"| {spread([r['eval_accuracy'] for r in runs])} | {len(runs)} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    levels = sorted({r["epsilon_level"] for r in results if r["epsilon_level"] is not None})
    methods = [m for m in METHODS if any(method_of(r) == m for r in results)]
    for k, method in enumerate(methods):
        mine = [r for r in results if method_of(r) == method]
        xs, ys, lo, hi = [], [], [], []
        for level in levels:
            losses = [r["eval_loss"] for r in mine if r["epsilon_level"] == level]
            if losses:
                xs.append(level * (1 + 0.06 * (k - (len(methods) - 1) / 2)))  # side by side
                ys.append(statistics.fmean(losses))
                lo.append(ys[-1] - min(losses))
                hi.append(max(losses) - ys[-1])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", color=f"C{k}", label=f"{method} (DP)")
        base = [r["eval_loss"] for r in mine if r["epsilon_level"] is None]
        if base:
            ax.axhspan(min(base), max(base), color=f"C{k}", alpha=0.2,
                       label=f"{method}, no DP (seed range)")
    before = [r["eval_loss_before"] for r in results]
    ax.axhline(statistics.fmean(before), color="grey", linestyle="--", label="untrained")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (delta 1e-5), user level")
    ax.set_ylabel("final eval loss")
    ax.set_title("Central user-level DP: loss against privacy, seed range")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tune(methods: list[str], lrs: list[float], seed: int, args: argparse.Namespace,
         level: float | None) -> None:
    """Each method at each learning rate, without DP (``level`` None) or at ``level``: its
    final eval loss (resumable)."""
    name = "tuning" if level is None else "tuning_dp"
    path = args.out / f"{name}.json"
    runs: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    for method in methods:
        for lr in lrs:
            if any(r["method"] == method and r["lr"] == lr and r["seed"] == seed and
                   r["rounds"] == args.rounds and r["nodes"] == args.nodes for r in runs):
                continue
            r = one_run(method, level, seed, args.nodes, args.per_round, args.rounds, lr=lr)
            runs.append(r)
            path.write_text(json.dumps(runs, indent=1) + "\n")
            print(f"tune {method} lr {lr:g}: loss {r['eval_loss_before']:.4f} -> "
                  f"{r['eval_loss']:.4f}, acc {r['eval_accuracy']:.3f}, {r['wall_s']} s",
                  flush=True)
    what = "no DP" if level is None else f"epsilon {level:g}"
    lines = [f"| method | lr | clip | final eval loss ({what}, seed {seed}) | eval accuracy |",
             "|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (list(METHODS).index(r["method"]), r["lr"])):
        clip = "-" if r["clip"] is None else f"{r['clip']:g}"
        lines.append(f"| {r['method']} | {r['lr']:g} | {clip} | {r['eval_loss']:.4f} "
                     f"| {r['eval_accuracy']:.3f} |")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--tune", default="",
                        help="comma-separated learning rates: run each method without DP "
                             "(first seed) at each, into tuning.json / tuning.md, and stop")
    parser.add_argument("--tune-dp", default="",
                        help="the same at epsilon 4 (rates with a clip in CLIPS), into "
                             "tuning_dp.json / tuning_dp.md")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results: list[dict[str, Any]] = (json.loads(path.read_text())
                                     if args.resume and path.exists() else [])
    done = {(method_of(r), r["epsilon_level"], r["seed"], r["nodes"], r["per_round"],
             r["rounds"]) for r in results}
    levels: list[float | None] = [None, *(float(e) for e in args.epsilons.split(","))]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    if args.tune or args.tune_dp:
        tune(methods, [float(x) for x in (args.tune or args.tune_dp).split(",")],
             int(args.seeds.split(",")[0]), args, 4.0 if args.tune_dp else None)
        return
    for seed in (int(s) for s in args.seeds.split(",")):  # each seed across every method
        for method in methods:
            for level in levels:
                if (method, level, seed, args.nodes, args.per_round, args.rounds) in done:
                    continue
                r = one_run(method, level, seed, args.nodes, args.per_round, args.rounds)
                results.append(r)
                path.write_text(json.dumps(results, indent=1) + "\n")
                print(f"{method}, epsilon {level}, seed {seed}: noise {r['noise_multiplier']}, "
                      f"spent {r['epsilon_spent']}, loss {r['eval_loss_before']:.4f} -> "
                      f"{r['eval_loss']:.4f}, acc {r['eval_accuracy']:.3f}, {r['wall_s']} s",
                      flush=True)
    text = table(results)
    (args.out / "table.md").write_text(text)
    plot(results, args.out / "privacy_utility.png")
    print(text)


if __name__ == "__main__":
    main()
