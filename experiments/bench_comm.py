"""Bytes per client-round and over a run: FedAvg vs FedCyBGD, uncompressed, paper's, ours.

Every FedCyBGD variant is a real run of the ServerApp logic and the ClientApp (in one process,
over the loopback Grid: the payloads are exactly those a Flower runtime would carry) on the same
partition, seeds and number of rounds; bytes are the encoded payload sizes. FedAvg full-model
fp32 is not run (one client-round moves the whole model down and up, 2 x 538 MB for SmolLM2;
training the full model on this CPU would take hours): its bytes are counted exactly from the
model's size, and its accuracy is not reported.

    python experiments/bench_comm.py                 # SmolLM2, 30 rounds, 8 clients, 4 per round
    python experiments/bench_comm.py --quick         # tiny random model, a smoke test
    python experiments/bench_comm.py --profile defaults --quick   # the app's defaults
    python experiments/bench_comm.py --profile demo --quick       # ... and the demo's settings

``--profile paper`` (the default) is the one-layer-block, one-step setting of the paper's
comparison. ``defaults`` is the app's own run config (``[tool.flwr.app.config]``: 4-layer
blocks, all of a round's nodes on one block, 5 local steps, int8 codecs; with ``--quick`` the
4-layer tiny model gets 1-layer blocks so that a cycle has 4 blocks), ``defaults-c1`` the same
with one node per block, ``demo`` the defaults plus ``make demo``'s settings
(``fedcybgd.cli.demo.DEMO_RUN_CONFIG``). Those profiles run two full cycles and compare the traffic
traffic features (``self-sync``, ``error-feedback``, ``install-codec``, ``max-staleness``)
off ("before") and on, against uncompressed fp32 FedCyBGD and both FedAvg baselines (run, not
counted, on the tiny model).

Bytes are what crosses the wire: the serialised messages (``wire_bytes_down``/``_up`` of the
rows, :mod:`fedcybgd.protocol.message_size`), metadata included; the payload share is kept beside
them.

Results: printed; JSON and a PNG plot under ``experiments/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"

VARIANTS: dict[str, dict[str, Any]] = {
    "fedcybgd-fp32": {"upload-codec": "fp32", "download-codec": "fp32"},
    "paper-drop-0.5": {"upload-codec": "fp16", "download-codec": "fp16",
                       "download-fraction": 0.5},
    "ours-int8": {"upload-codec": "delta+int8+zstd", "download-codec": "delta+int8+zstd"},
    "ours-topk-int8": {"upload-codec": "delta+topk+int8+zstd",
                       "download-codec": "delta+int8+zstd"},
    "ours-topk-int4": {"upload-codec": "delta+topk+int8+zstd",
                       "download-codec": "delta+int4+zstd"},
}


# The traffic features' variants (profiles other than "paper"): "before" is the traffic as it was.
# Two bits a value both ways: int2 uploads with the node's error feedback, int2 installs with
# the server's, so a node holding the previous version gets each change exactly (the defaults).
INT2: dict[str, Any] = {"upload-codec": "delta+int2+zstd", "download-codec": "delta+int2+zstd",
                        "self-sync": True, "error-feedback": True, "install-codec": "auto"}
FEATURES: dict[str, dict[str, Any]] = {
    "fp32-uncompressed": {"upload-codec": "fp32", "download-codec": "fp32",
                          "self-sync": False, "error-feedback": False, "install-codec": "none"},
    "before": {"self-sync": False, "error-feedback": False, "install-codec": "none"},
    "self-sync": {"self-sync": True, "error-feedback": False, "install-codec": "none"},
    "error-feedback": {"self-sync": False, "error-feedback": True, "install-codec": "none"},
    "after": {"self-sync": True, "error-feedback": True, "install-codec": "none"},
    # the server installs each block rounded to one int8 delta, which every node gets exactly
    "quantized-install": {"self-sync": True, "error-feedback": True,
                          "install-codec": "delta+int8+zstd"},
    # ... and frozen copies up to one install behind are not refreshed
    "quantized-stale-1": {"self-sync": True, "error-feedback": True,
                          "install-codec": "delta+int8+zstd", "max-staleness": 1},
    # sparse both ways: top-k uploads with the node's error feedback, and the server installs
    # each block rounded to a top-k delta (its residual kept for the block's next install), so
    # every node holding the previous version gets the change as that sparse delta, exactly
    "sparse": {"upload-codec": "delta+topk+int8+zstd", "download-codec": "delta+topk+int8+zstd",
               "self-sync": True, "error-feedback": True, "install-codec": "auto"},
    "int2": INT2,
    # ... and frozen copies up to one install behind are not refreshed
    "int2-stale-1": {**INT2, "max-staleness": 1},
    "paper-drop-0.5": {"upload-codec": "fp16", "download-codec": "fp16",
                       "download-fraction": 0.5, "self-sync": False, "error-feedback": False,
                       "install-codec": "none"},
    "fedavg-full": {"strategy": "fedavg", "fedavg-params": "full"},
    "fedavg-lora": {"strategy": "fedavg", "fedavg-params": "lora"},
    # zeroth-order rules with step logs both ways (seed-log downloads), and
    # the same with weight downloads; "all" layers per block: whole-stack MeZO
    "lezo-seedlog": {"update-rule": "lezo", "upload-codec": "seedlog", "lr": 1e-6},
    "lezo-seedlog-both": {"update-rule": "lezo", "upload-codec": "seedlog",
                          "download-codec": "seedlog", "lr": 1e-6},
    "mezo-seedlog": {"update-rule": "mezo", "upload-codec": "seedlog", "lr": 1e-6,
                     "layers-per-block": "all"},
    "mezo-seedlog-both": {"update-rule": "mezo", "upload-codec": "seedlog",
                          "download-codec": "seedlog", "lr": 1e-6, "layers-per-block": "all"},
    # LoRA at the learning rate of the issue-12 probe (2e-4: 0.42 eval loss in 8 client-rounds)
    "fedavg-lora-2e-4": {"strategy": "fedavg", "fedavg-params": "lora", "lr": 2e-4},
}


def feature_config(name: str) -> dict[str, Any]:
    """A FEATURES entry, or ``[quantized-]budget-<kB>k``: the features on with
    ``traffic-budget-mb`` of that many kB (and ``install-codec`` int8 when quantized)."""
    if name in FEATURES:
        return FEATURES[name]
    stem = name.removeprefix("quantized-")
    if not (stem.startswith("budget-") and stem.endswith("k")):
        raise SystemExit(f"unknown variant {name!r}: one of {list(FEATURES)} or "
                         "[quantized-]budget-<kB>k")
    config = {"self-sync": True, "error-feedback": True, "install-codec": "none",
              "traffic-budget-mb": float(stem[len("budget-"):-1]) / 1024}
    if stem != name:
        config["install-codec"] = "delta+int8+zstd"
    return config


def run_variant(name: str, base: dict[str, Any], out: Path, nodes: int,
                variants: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One run (FedCyBGD, or a FedAvg baseline); returns its per-round records and summary."""
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import RUNNERS

    # a rerun replaces the variant's outputs; the client cache lives beside them
    config = dict(base, **(feature_config(name) if variants is FEATURES else
                           (variants or VARIANTS)[name]),
                  **{"output-dir": str(out / name), "overwrite": True})
    if config.get("layers-per-block") == "all":
        from fedcybgd.model.loading import load_model

        config["layers-per-block"] = load_model(config["model"]).config.num_hidden_layers
    cache = out / f"{name}-client-cache"
    shutil.rmtree(cache, ignore_errors=True)  # a node's cache is of one run
    grid = LoopbackGrid(client_app, nodes, config, keep_sent=0,
                        node_config=lambda i: {"cache-dir": str(cache)})
    started = time.perf_counter()
    run = RunConfig.from_run_config(config)
    summary = RUNNERS[run.strategy](grid, run)
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {"name": name, "config": config, "summary": summary, "records": records,
            "wall_s": time.perf_counter() - started}


def profile_base(profile: str, quick: bool, eval_every: int = 0) -> tuple[dict[str, Any], int]:
    """The run config of ``profile`` (see the module docstring) and its rounds: two cycles
    (``defaults-c1``: four, a cycle there is one round or two)."""
    import math

    from fedcybgd.cli.demo import DEMO_RUN_CONFIG
    from fedcybgd.config import RunConfig
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.loading import load_model

    base: dict[str, Any] = {"model": "tiny-llama" if quick else "smollm2-135m"}
    if quick:
        base["layers-per-block"] = 1  # 4 layers: a cycle of 4 blocks, not 1
    if profile == "defaults-c1":
        base["clients-per-block"] = 1
    if profile == "demo":
        for item in DEMO_RUN_CONFIG.split():
            key, _, value = item.partition("=")
            text = value.strip("'")
            try:
                base[key] = int(text)
            except ValueError:
                try:
                    base[key] = float(text)
                except ValueError:
                    base[key] = text
    run = RunConfig.from_run_config(base)
    cycle = BlockMap(load_model(run.model), run.layers_per_block).cycle(run.train_embeddings,
                                                                          run.train_head)
    per_round = run.clients_per_round // run.per_block
    rounds = (4 if profile == "defaults-c1" else 2) * math.ceil(len(cycle) / per_round)
    base["num-server-rounds"] = rounds
    # before and after only by default: the same evaluation for every variant
    base["eval-every"] = eval_every
    if quick:
        base["eval-examples"] = 64
    return base, rounds


def profile_main(args: argparse.Namespace) -> None:
    """The traffic features' comparison on one profile: the traffic features off and on, fp32, the
    paper's scheme and both FedAvg baselines, same seeds; bytes are serialised messages."""
    base, rounds = profile_base(args.profile, args.quick, args.eval_every)
    for item in args.set:  # e.g. layers-per-block=1 num-server-rounds=16
        key, _, value = item.partition("=")
        base[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") \
            else value
    rounds = int(base["num-server-rounds"])
    names = args.variants.split(",") if args.variants else list(FEATURES)
    # results: bench_comm_<profile>[_tiny].json/.png; each run's outputs under comm-* (ignored)
    stem = (f"bench_comm_{args.profile}" + (f"_{args.tag}" if args.tag else "")
            + ("_tiny" if args.quick else ""))
    work = Path(args.out) / f"comm-{args.profile}" / ("tiny" if args.quick else "smollm2")
    runs = []
    for name in names:
        print(f"--- {name}", flush=True)
        runs.append(run_variant(name, base, work, args.nodes, FEATURES))
    table = []
    curves: dict[str, list[tuple[float, float | None]]] = {}
    for run in runs:
        trained = [r for r in run["records"] if r["round"] > 0]
        client_rounds = sum(len(r["clients"]) for r in trained)
        wire_down = sum(r["wire_bytes_down"] for r in trained)
        wire_up = sum(r["wire_bytes_up"] for r in trained)
        evals = [(0.0, r["eval_loss"]) for r in run["records"] if r["round"] == 0]
        acc = 0
        for r in trained:
            acc += r["wire_bytes_down"] + r["wire_bytes_up"]
            if r.get("eval_loss") is not None:
                evals.append((acc, r["eval_loss"]))
        curves[run["name"]] = evals
        table.append({
            "variant": run["name"],
            "client_rounds": client_rounds,
            "wire_down_per_client_round": wire_down / max(client_rounds, 1),
            "wire_up_per_client_round": wire_up / max(client_rounds, 1),
            "wire_per_client_round": (wire_down + wire_up) / max(client_rounds, 1),
            "payload_down_per_client_round": sum(r["bytes_down"] for r in trained)
            / max(client_rounds, 1),
            "payload_up_per_client_round": sum(r["bytes_up"] for r in trained)
            / max(client_rounds, 1),
            "dropped": run["summary"]["dropped"],
            # under traffic-budget-mb: how often each level was chosen, and how often none fit
            "traffic_levels": dict(Counter(v for r in trained
                                           for v in (r.get("traffic") or {}).values())),
            "over_budget": sum(r.get("traffic_over_budget") or 0 for r in trained),
            "initial_eval_loss": run["summary"]["initial_eval_loss"],
            "final_eval_loss": run["summary"]["final_eval_loss"],
            "final_eval_accuracy": run["summary"]["final_eval_accuracy"],
            "wall_s": run["wall_s"],
        })
    by_name = {row["variant"]: row for row in table}
    print(f"\n{base['model']}, profile {args.profile}: {rounds} rounds, {args.nodes} nodes")
    print(f"{'variant':<20}{'kB down/cr':>12}{'kB up/cr':>10}{'x fedavg':>10}"
          f"{'final loss':>12}{'acc':>7}")
    full = by_name.get("fedavg-full", {}).get("wire_per_client_round")
    for row in table:
        ratio = full / row["wire_per_client_round"] if full else float("nan")
        row["fedavg_full_over_this"] = ratio
        print(f"{row['variant']:<20}{row['wire_down_per_client_round'] / 1e3:>12.1f}"
              f"{row['wire_up_per_client_round'] / 1e3:>10.1f}{ratio:>10.1f}"
              f"{row['final_eval_loss']:>12.4f}{row['final_eval_accuracy']:>7.3f}"
              + (f"  levels {row['traffic_levels']}, over {row['over_budget']}"
                 if row["traffic_levels"] else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "base_config": base, "rounds": rounds,
            "nodes": args.nodes,
            "bytes": "wire_*: serialised messages (fedcybgd.protocol.message_size), "
                     "per client-round (an instruction and its reply); payload_*: the "
                     "encoded blocks alone"}
    (out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "table": table, "loss_vs_bytes": curves,
         "rounds": {r["name"]: r["records"] for r in runs}}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        xs = [max(b, 1.0) / 2**20 for b, _ in points]
        ax.plot(xs, [loss for _, loss in points], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative MB on the wire (down + up)")
    ax.set_ylabel("eval loss")
    ax.set_title(f"{base['model']}, {args.profile}: {rounds} rounds, {args.nodes} nodes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"saved {out / (stem + '.json')} and {out / (stem + '.png')}")


def main() -> None:
    """Run the variants and compare their traffic."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 rounds")
    parser.add_argument("--profile", default="paper",
                        choices=["paper", "defaults", "defaults-c1", "demo"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--clients-per-round", type=int, default=4)
    parser.add_argument("--variants", default="",
                        help="comma-separated (paper: fedcybgd-fp32,paper-drop-0.5,ours-int8,"
                             "ours-topk-int8; other profiles: all of FEATURES)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--eval-every", type=int, default=0,
                        help="profiles: evaluate every N rounds too (0: before and after only)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="profiles: run-config keys over the profile's, for every variant")
    parser.add_argument("--tag", default="",
                        help="profiles: results as bench_comm_<profile>_<tag>[_tiny].json")
    args = parser.parse_args()
    if args.profile != "paper":
        profile_main(args)
        return
    args.variants = args.variants or "fedcybgd-fp32,paper-drop-0.5,ours-int8,ours-topk-int8"

    from fedcybgd.model.loading import load_model

    model_name = "tiny-llama" if args.quick else "smollm2-135m"
    rounds = 6 if args.quick else args.rounds
    base = {
        "model": model_name, "partitioner": "dirichlet", "dirichlet-alpha": 0.5,
        "num-server-rounds": rounds, "clients-per-round": args.clients_per_round,
        "layers-per-block": 1, "block-schedule": "ascending", "update-rule": "fo",
        "local-steps": 1, "batch-size": 8, "max-seq-len": 48, "lr": 2e-6,
        "clients-per-block": 1, "logit-adjust": False,
        "eval-every": max(rounds // 3, 1), "eval-examples": 64 if args.quick else 200,
        "seed": 0,
    }
    work = Path(args.out) / ("comm-quick" if args.quick else "comm")
    model_bytes = sum(p.numel() for p in load_model(model_name).parameters()) * 4

    runs = []
    for name in args.variants.split(","):
        print(f"--- {name}", flush=True)
        runs.append(run_variant(name, base, work, args.nodes))

    client_rounds = rounds * args.clients_per_round
    table = [{
        "variant": "fedavg-full-fp32 (counted, not run)",
        "bytes_per_client_round": 2 * model_bytes,
        "total_bytes": 2 * model_bytes * client_rounds,
        "final_accuracy": None,
    }]
    curves: dict[str, list[int]] = {
        "fedavg-full-fp32": [2 * model_bytes * args.clients_per_round * r
                             for r in range(1, rounds + 1)]
    }
    for run in runs:
        trained = [r for r in run["records"] if r["round"] > 0]
        total = sum(r["bytes_down"] + r["bytes_up"] for r in trained)
        done = sum(len(r["blocks"]) for r in trained)  # client-rounds that trained a block
        cumulative, acc = [], 0
        for r in trained:
            acc += r["bytes_down"] + r["bytes_up"]
            cumulative.append(acc)
        curves[run["name"]] = cumulative
        table.append({
            "variant": run["name"],
            "bytes_per_client_round": total / max(done, 1),
            "bytes_down": sum(r["bytes_down"] for r in trained),
            "bytes_up": sum(r["bytes_up"] for r in trained),
            "total_bytes": total,
            "client_rounds": done,
            "final_accuracy": run["summary"]["final_eval_accuracy"],
            "initial_accuracy": run["summary"]["initial_eval_accuracy"],
            "final_loss": run["summary"]["final_eval_loss"],
            "wall_s": run["wall_s"],
        })

    fedavg = table[0]["bytes_per_client_round"]
    by_name = {row["variant"]: row for row in table}
    print(f"\n{'variant':<38}{'MB/client-round':>16}{'x less than FedAvg':>20}{'final acc':>11}")
    for row in table:
        ratio = fedavg / row["bytes_per_client_round"]
        row["fedavg_over_this"] = ratio
        accuracy = "-" if row["final_accuracy"] is None else f"{row['final_accuracy']:.3f}"
        print(f"{row['variant']:<38}{row['bytes_per_client_round'] / 2**20:>16.2f}"
              f"{ratio:>20.1f}{accuracy:>11}")
    ratios = {}
    for ours in ("ours-int8", "ours-topk-int8", "ours-topk-int4"):
        if ours in by_name and "paper-drop-0.5" in by_name and "fedcybgd-fp32" in by_name:
            ratios[ours] = {
                "vs_fedavg": fedavg / by_name[ours]["bytes_per_client_round"],
                "vs_paper": by_name["paper-drop-0.5"]["bytes_per_client_round"]
                / by_name[ours]["bytes_per_client_round"],
                "accuracy_drop_vs_uncompressed": by_name["fedcybgd-fp32"]["final_accuracy"]
                - by_name[ours]["final_accuracy"],
            }
            print(f"{ours}: {ratios[ours]}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench_comm_quick" if args.quick else "bench_comm"
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "base_config": base,
            "fedavg": "counted from the model size: full model fp32 down + up per client-round"}
    (out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "table": table, "ratios": ratios, "cumulative_bytes": curves,
         "rounds": {r["name"]: r["records"] for r in runs}}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), [b / 2**20 for b in curve], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative MB moved (down + up)")
    ax.set_title(f"{model_name}: {args.nodes} clients, {args.clients_per_round} per round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"saved {out / (stem + '.json')} and {out / (stem + '.png')}")


if __name__ == "__main__":
    main()
