"""Federated runs with each update rule on equal terms: eval accuracy and loss per round.

Every variant is a real run of the ServerApp logic and the ClientApp over the in-process
loopback Grid, on the same partition, seeds, blocks and number of rounds; only the clients'
update rule (and its options) differ.

    python experiments/compare_rules.py                       # fo vs zerolock (both heads)
    python experiments/compare_rules.py --variants fo,lezo --rounds 6

Results: printed; JSON and a PNG plot under ``experiments/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS: dict[str, dict[str, Any]] = {
    "fo": {"update-rule": "fo"},
    "zerolock-frozen-lm": {"update-rule": "zerolock", "zerolock-head": "frozen-lm"},
    "zerolock-tuned": {"update-rule": "zerolock", "zerolock-head": "tuned"},
    "zerolock-calibrated": {"update-rule": "zerolock", "zerolock-head": "calibrated"},
    "zerolock-aux4": {"update-rule": "zerolock", "zerolock-aux-layers": 4},
    "zerolock-calibrated-aux4": {"update-rule": "zerolock", "zerolock-head": "calibrated",
                                 "zerolock-aux-layers": 4},
    "zerolock-calibrated-aux8": {"update-rule": "zerolock", "zerolock-head": "calibrated",
                                 "zerolock-aux-layers": 8},
    "lezo": {"update-rule": "lezo", "upload-codec": "seedlog"},
}


def main() -> None:
    """Run the variants and tabulate accuracy and loss per round."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="fo,zerolock-frozen-lm,zerolock-tuned")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--clients-per-round", type=int, default=4)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra run-config key for every variant (TOML value), repeatable")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="compare_rules",
                        help="result files <name>.json / .png, so a run never overwrites another")
    args = parser.parse_args()

    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    base = {
        "model": "smollm2-135m", "partitioner": "dirichlet", "dirichlet-alpha": 0.5,
        "num-server-rounds": args.rounds, "clients-per-round": args.clients_per_round,
        "layers-per-block": 1,
        "block-schedule": "ascending", "local-steps": args.local_steps, "batch-size": 8,
        "max-seq-len": 48, "lr": args.lr, "eval-every": args.eval_every,
        "eval-examples": args.eval_examples, "seed": 0, "clients-per-block": 1,
        "logit-adjust": False,
    }
    import tomllib

    for item in args.set:
        key, _, value = item.partition("=")
        base[key] = tomllib.loads(f"v = {value}")["v"]
    work = Path(args.out) / "rules"
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in args.variants.split(","):
        print(f"--- {name}", flush=True)
        # a rerun replaces the variant's outputs; the client cache lives beside them
        config = dict(base, **VARIANTS[name],
                      **{"output-dir": str(work / name), "overwrite": True})
        grid = LoopbackGrid(client_app, args.nodes, config, keep_sent=0,
                            node_config=lambda i, n=name: {"cache-dir": str(work / f"{n}-cache")})
        run_server(grid, RunConfig.from_run_config(config))
        runs[name] = [json.loads(x)
                      for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in runs[name] if r.get("eval_loss") is not None]
        print(f"{name}: eval loss {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.3f}, "
              f"mean round {sum(r['round_s'] for r in runs[name][1:]) / args.rounds:.1f} s",
              flush=True)

    print(f"\n{'variant':<22}" + "".join(f"{'round ' + str(r):>16}" for r in
                                         [0, *range(args.eval_every, args.rounds + 1,
                                                    args.eval_every)]))
    for name, records in runs.items():
        cells = [f"{r['eval_accuracy']:.3f}/{r['eval_loss']:.3f}"
                 for r in records if r.get("eval_accuracy") is not None]
        print(f"{name:<22}" + "".join(f"{c:>16}" for c in cells))
    if "fo" in runs:  # each rule's eval-loss drop as a share of fo's, at the last evaluation
        def drop(records: list[dict[str, Any]]) -> float:
            evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
            return float(evals[0] - evals[-1])

        for name, records in runs.items():
            print(f"{name:<26} eval-loss drop {drop(records):.3f} = "
                  f"{drop(records) / drop(runs['fo']):.0%} of fo's")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "base_config": base}
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name, records in runs.items():
        evals = [r for r in records if r.get("eval_accuracy") is not None]
        acc_ax.plot([r["round"] for r in evals], [r["eval_accuracy"] for r in evals], "o-",
                    label=name)
        loss_ax.plot([r["round"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                     label=name)
    acc_ax.set_xlabel("round")
    acc_ax.set_ylabel("eval accuracy")
    loss_ax.set_xlabel("round")
    loss_ax.set_ylabel("eval loss (label token)")
    acc_ax.legend()
    fig.suptitle("SmolLM2-135M, Rotten Tomatoes, 8 clients (4 per round), one-layer blocks")
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)
    print(f"saved {out / (args.name + '.json')} and {out / (args.name + '.png')}")


if __name__ == "__main__":
    main()
