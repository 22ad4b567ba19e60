"""Byzantine soak: how far colluding nodes set back learning and drift the model, per aggregator.

Four nodes (``--nodes``) share each block every round (one block a round); 0, 1 or 2 of them
are colluders (:class:`fedcybgd.harness.byzantine.Colluders`): ``push`` is the
adaptive attacker (one fixed-sign direction, just under every bound of the server's screen,
which it reads), ``flip`` sends its honest update reversed and scaled. Every aggregator runs
the same rounds on the same seeds; the table gives the final eval loss and accuracy (mean and
[min-max] over seeds) beside the honest run's, the eval loss after each round, and the drift:
how far the trained blocks moved from the pretrained model (RMS of the difference over every
block of the cycle), after each round, as a multiple of the honest run's with the same
aggregate and seed (the worst round's ratio: a first visit counts as much as the last).

    python experiments/byzantine.py                     # tiny-llama, 3 seeds (~30 min, 2 cores)
    python experiments/byzantine.py --resume            # skips the runs already in results.json
    python experiments/byzantine.py --nodes 5 --scenarios none:0,push:2,flip:2 \
        --out experiments/results/byzantine-5     # a colluding minority of five
    python experiments/byzantine.py --model smollm2-135m --rounds 4 --seeds 0 \\
        --aggregates median --scenarios none:0,push:1,push:2 --set lr=3e-5 \\
        --set local-steps=5 --set batch-size=8 --set layers-per-block=10 \\
        --set eval-examples=200 --out experiments/results/byzantine-smollm2

Results: ``experiments/results/byzantine/results.json`` (one entry per run) and ``table.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from fedcybgd.harness.byzantine import ATTACKS, Colluders, Federation
from fedcybgd.strategies import aggregator_names
from fedcybgd.strategies.aggregate import AUTO

OUT = Path(__file__).parent / "results" / "byzantine"
# (attack, colluders of 4): the honest run, then each attack
SCENARIOS: tuple[tuple[str, int], ...] = (("none", 0), ("push", 1), ("push", 2), ("flip", 1))


# The run config of every run; --set KEY=VALUE overrides (e.g. for SmolLM2: lr, local-steps)
BASE: dict[str, Any] = {
    "partitioner": "iid", "clients-per-round": 4, "clients-per-block": 4,
    "block-schedule": "ascending", "layers-per-block": 1, "train-embeddings": False,
    "train-head": False, "update-rule": "fo", "local-steps": 2, "batch-size": 4,
    "max-seq-len": 48, "lr": 1e-3, "eval-examples": 128, "eval-batch-size": 32,
}


def config(model: str, aggregate: str, seed: int, rounds: int, out: Path,
           overrides: dict[str, Any], nodes: int = 4) -> dict[str, Any]:
    return {**BASE, "clients-per-round": nodes, "clients-per-block": nodes, "model": model,
            "num-server-rounds": rounds, "aggregate": aggregate,
            "seed": seed, "output-dir": str(out), **overrides}


def one_run(model: str, aggregate: str, attack: str, colluders: int, seed: int,
            rounds: int, overrides: dict[str, Any], nodes: int = 4) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        fed = Federation(config(model, aggregate, seed, rounds, Path(tmp) / "out", overrides,
                                nodes), Path(tmp), nodes=nodes)
        ids = fed.node_ids()
        forger = (Colluders(set(ids[:colluders]), kind=attack, seed=seed)
                  if colluders else None)
        first = fed.evaluate()
        losses, drops, drifts = [float(first.loss)], {}, []
        began = time.perf_counter()
        for server_round in range(1, rounds + 1):
            entry = fed.play(server_round, forger)
            for reason, count in (entry.dropped or {}).items():
                drops[reason] = drops.get(reason, 0) + count
            losses.append(float(fed.evaluate().loss))
            drifts.append(fed.drift())
        last = fed.evaluate()
    return {"model": model, "aggregate": aggregate, "attack": attack, "colluders": colluders,
            "nodes": nodes, "seed": seed, "rounds": rounds, "overrides": overrides,
            "eval_loss": losses, "drift": drifts,
            "eval_accuracy": float(last.accuracy), "eval_accuracy_before": float(first.accuracy),
            "dropped": drops, "forged": forger.forged if forger else 0,
            "wall_s": round(time.perf_counter() - began, 1)}


def key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["model"], r["aggregate"], r["attack"], r["colluders"], r["seed"], r["rounds"],
            r.get("nodes", 4))


def drift_ratio(run: dict[str, Any], honest: dict[str, Any]) -> float:
    """The worst round's drift as a multiple of the honest run's in the same round."""
    return max(a / h for a, h in zip(run["drift"], honest["drift"], strict=True) if h > 0)


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} [{min(values):.3f}-{max(values):.3f}]" if len(values) > 1 else f"{mean:.3f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| aggregate | colluders of n | attack | final eval loss | loss drop vs honest | "
             "drift vs honest (worst round) | eval accuracy | runs |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["model"], r["aggregate"], r["attack"], r["colluders"],
                           r.get("nodes", 4)), []).append(r)
    order = aggregator_names()
    for (model, aggregate, attack, colluders, nodes), runs in sorted(
            groups.items(), key=lambda g: (g[0][0], g[0][4], order.index(g[0][1])
                                           if g[0][1] in order else 99, g[0][3], g[0][2])):
        honest = groups.get((model, aggregate, "none", 0, nodes), [])
        loss = [r["eval_loss"][-1] for r in runs]
        drop = [r["eval_loss"][0] - r["eval_loss"][-1] for r in runs]
        share = ""
        if honest:
            base = statistics.fmean(h["eval_loss"][0] - h["eval_loss"][-1] for h in honest)
            share = f"{statistics.fmean(drop) / base:.0%}" if base else ""
        by_seed = {h["seed"]: h for h in honest if "drift" in h}
        ratios = [drift_ratio(r, by_seed[r["seed"]]) for r in runs
                  if "drift" in r and r["seed"] in by_seed]
        drifted = (f"{statistics.fmean(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
                   if ratios else "")
        lines.append(f"| {aggregate} | {colluders} of {nodes} | {attack} | {spread(loss)} | "
                     f"{share} | {drifted} | {spread([r['eval_accuracy'] for r in runs])} | "
                     f"{len(runs)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=4, help="nodes, all on each round's block")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--aggregates", default=",".join(a for a in aggregator_names()
                                                         if a != AUTO))
    parser.add_argument("--scenarios", default="",
                        help="e.g. none:0,push:1,push:2 (default: every scenario)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-config override (TOML value), e.g. --set lr=1e-5")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    assert all(a in ATTACKS for a, c in SCENARIOS if c)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results: list[dict[str, Any]] = json.loads(path.read_text()) if args.resume and path.exists() \
        else []
    done = {key(r) for r in results}
    overrides = {k: tomllib.loads(f"v = {v}")["v"]
                 for k, _, v in (item.partition("=") for item in args.set)}
    scenarios = ([(a, int(c)) for a, _, c in (x.partition(":") for x in
                                             args.scenarios.split(","))]
                 if args.scenarios else list(SCENARIOS))
    for seed in (int(s) for s in args.seeds.split(",")):
        for aggregate in args.aggregates.split(","):
            for attack, colluders in scenarios:
                if (args.model, aggregate, attack, colluders, seed, args.rounds,
                        args.nodes) in done:
                    continue
                r = one_run(args.model, aggregate, attack, colluders, seed, args.rounds,
                            overrides, args.nodes)
                results.append(r)
                path.write_text(json.dumps(results, indent=1) + "\n")
                print(f"{aggregate:>16} {attack:>5} x{colluders} seed {seed}: eval loss "
                      f"{r['eval_loss'][0]:.4f} -> {r['eval_loss'][-1]:.4f}, acc "
                      f"{r['eval_accuracy']:.3f}, dropped {r['dropped']}, {r['wall_s']} s",
                      flush=True)
    text = table(results)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
