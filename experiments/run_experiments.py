"""Every method on equal terms: FedCyBGD (fo, zerolock, lezo, the paper's dropping) against
Flower's FedAvg (full model, LoRA) and whole-stack MeZO with seed-log uploads.

    python experiments/run_experiments.py                     # the quick profile (~1 h, 2 CPUs)
    python experiments/run_experiments.py --profile full      # experiments/configs/full.toml
    python experiments/run_experiments.py --only fedcybgd-fo  # some methods (all partitions)
    python experiments/run_experiments.py --profile payoff --seeds 0  # some of its seeds
    python experiments/run_experiments.py --profile payoff    # 3 seeds, bounds: payoff.md

A profile (``experiments/configs/<name>.toml``) names the methods, the run config they share and
the partitions to run them on. A method may take its setting from a sweep's results instead of
naming it: ``tuned-in = { sweep = "sweep-payoff-lm", methods = ["fo-l1", "fo-l3"] }`` runs the
setting (layout and rate) with the lowest final validation loss among those sweep methods, once
their grids have run, and refuses a run that differs from the sweep's in length, batch or
schedule (``sweep.SHAPE_KEYS``): the rule that picks, not a number copied by hand.

Each run is a real federated run: the ServerApp logic in this
process (our FedCyBGD loop, or Flower's own ``FedAvg.start``), the ClientApp in one child
process that plays every node (:class:`fedcybgd.harness.procgrid.ProcessGrid`), messages crossing as
Flower protobuf bytes. So the traffic is the serialised messages and the client memory is the
child's own peak RSS. The inference floor is the peak RSS of a fresh process running forward
passes on the same batches with the ClientApp's imports and model object.

Writes ``experiments/results/<profile>/``: ``results.json`` (every run's summary, per-round
records and measurements), ``table.md`` (the table and the targets, pass or miss) and the plots
``accuracy_vs_round.png``, ``accuracy_vs_bytes.png`` and ``client_memory.png``. Results are
saved after every run; ``--resume`` keeps the runs already saved with the same config (after an
interruption), ``--report-only`` rewrites the table and plots from ``results.json``.
A profile with several seeds or tasks (``payoff``) also gets ``payoff.md`` and its Pareto plots
(``payoff.py``: the best method at equal client-rounds, bytes, client memory and client time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLIENT_APP = "fedcybgd.client.app:app"
MB = 2**20


def load_profile(name: str, results_root: Path = HERE / "results") -> dict[str, Any]:
    """The profile's TOML, checked for the keys the runner needs, with every ``tuned-in``
    method's setting taken from its sweep's results under ``results_root``
    (:func:`tuned_settings`)."""
    path = Path(name) if name.endswith(".toml") else HERE / "configs" / f"{name}.toml"
    profile = tomllib.loads(path.read_text())
    for key in ("profile", "base", "methods"):
        if key not in profile:
            raise SystemExit(f"{path}: missing [{key}]")
    settings = profile["profile"]
    for partition, methods in settings["partitions"].items():
        unknown = [m for m in methods if m not in profile["methods"]]
        if unknown:
            raise SystemExit(f"{path}: partition {partition} names unknown methods {unknown}")
    unknown = [m for m in settings.get("bounds", []) if m not in profile["methods"]]
    if unknown:
        raise SystemExit(f"{path}: bounds names unknown methods {unknown}")
    for method, keys in profile["methods"].items():
        extra = set(keys.get("harness", {})) - HARNESS_KEYS
        if extra:
            raise SystemExit(f"{path}: method {method}: unknown harness keys {sorted(extra)} "
                             f"(known: {sorted(HARNESS_KEYS)})")
    checks = settings.get("seed-check", [])
    for check in [checks] if isinstance(checks, dict) else checks:
        if check["method"] not in profile["methods"]:
            raise SystemExit(f"{path}: seed-check names unknown method {check['method']!r}")
        if int(profile["base"]["seed"]) in [int(x) for x in check["seeds"]]:
            raise SystemExit(f"{path}: seed-check seeds must differ from the base seed")
    if "seeds" in settings and int(profile["base"]["seed"]) not in settings["seeds"]:
        raise SystemExit(f"{path}: [profile] seeds must include the base seed")
    profile["name"] = path.stem
    profile["tuned"] = tuned_settings(profile, results_root)
    planned_runs(profile, None)  # a tuned setting that does not carry stops here, named
    return profile


def tuned_settings(profile: dict[str, Any],
                   results_root: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Method -> partition -> its sweep's choice (``sweep.tuned``), for every method with a
    ``tuned-in = { sweep = NAME, methods = [...], partition = P }`` table: the best setting
    among those sweep methods (a layout and its rate, say) on partition ``P`` (default: each
    partition the profile runs the method on; a bound needs one). The method's own keys apply
    over the chosen ones."""
    chosen: dict[str, dict[str, dict[str, Any]]] = {}
    settings = profile["profile"]
    for method, keys in profile["methods"].items():
        spec = keys.get("tuned-in")
        if spec is None:
            continue
        if set(spec) - {"sweep", "methods", "partition"} or not {"sweep", "methods"} <= set(spec):
            raise SystemExit(f"method {method}: tuned-in takes sweep, methods and optionally "
                             f"partition, not {sorted(spec)}")
        from sweep import tuned  # experiments/ is on the path when run as a script

        used = [p for p, methods in settings["partitions"].items() if method in methods]
        if method in settings.get("bounds", []):
            used.append(CENTRAL)
        chosen[method] = {}
        for partition in used:
            swept = spec.get("partition", partition)
            if swept == CENTRAL:
                raise SystemExit(f"method {method}: a bound's tuned-in needs the sweep's "
                                 "partition (partition = ...)")
            chosen[method][partition] = tuned(spec["sweep"], list(spec["methods"]), swept,
                                              results_root)
    return chosen


# Per-method keys for the harness, not the run config: `nodes` (the simulated clients; a
# centralized bound is one node holding the whole training set).
HARNESS_KEYS = {"nodes"}
# The partition name of a bound's runs (one node, iid: all the data); payoff.py has it too. Not
# imported from there: the inference probe imports this module as experiments.run_experiments,
# where payoff.py is not on the path.
CENTRAL = "central"


def planned_runs(profile: dict[str, Any], only: set[str] | None) -> list[dict[str, Any]]:
    """(run id, method, task, partition, seed, nodes, run config) for every run of the profile.

    A profile with ``[profile.tasks]`` runs every method on each task (the task's keys over
    ``[base]``; run ids ``method@task@partition``); with ``[profile] seeds`` on each seed (ids end
    ``@seedN`` but for the base seed); ``[profile] bounds`` are run once per task and seed on
    one node that holds the whole training set (partition ``central``)."""
    base = dict(profile["base"])
    settings = profile["profile"]
    tasks: dict[str, dict[str, Any]] = settings.get("tasks", {"": {}})
    seeds = [int(x) for x in settings.get("seeds", [base["seed"]])]
    runs = []

    def add(method: str, task: str, partition: str, seed: int) -> None:
        if only and method not in only:
            return
        keys = dict(profile["methods"][method])
        harness = keys.pop("harness", {})
        tuning = keys.pop("tuned-in", None)
        choice = profile["tuned"][method][partition] if tuning else None
        bound = partition == CENTRAL
        config = {**base, **tasks[task], **(choice["keys"] if choice else {}), **keys,
                  "partitioner": "iid" if bound else partition, "seed": seed}
        if choice:
            from sweep import shape_differences

            differ = shape_differences(config, choice["config"])
            if differ:
                raise SystemExit(f"method {method}: the setting tuned in its sweep does not "
                                 "carry to this run: " + "; ".join(differ))
        run_id = "@".join([method, *([task] if task else []), partition])
        run_id += f"@seed{seed}" if seed != base["seed"] else ""
        runs.append({"id": run_id, "method": method, "task": task, "partition": partition,
                     "seed": seed, "nodes": int(harness.get("nodes", settings["nodes"])),
                     "config": config})

    for seed in seeds:
        for task in tasks:
            for partition, methods in settings["partitions"].items():
                for method in methods:
                    add(method, task, partition, seed)
            for method in settings.get("bounds", []):
                add(method, task, CENTRAL, seed)
    checks = settings.get("seed-check", [])
    for check in [checks] if isinstance(checks, dict) else checks:
        for seed in check["seeds"]:
            for task in tasks:
                add(check["method"], task, check["partition"], int(seed))
    return runs


def only_seeds(plan: list[dict[str, Any]], profile: dict[str, Any],
               text: str) -> list[dict[str, Any]]:
    """The planned runs of the seeds named in ``text`` (comma-separated; empty: every seed).

    A seed the profile does not run is an error naming the profile's seeds."""
    try:
        wanted = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise SystemExit(f"--seeds {text}: expected comma-separated integers") from None
    if not wanted:
        return plan
    known = {item["seed"] for item in planned_runs(profile, None)}
    if wanted - known:
        raise SystemExit(f"--seeds {text}: profile {profile['name']} runs seeds "
                         f"{sorted(known)}, not {sorted(wanted - known)}")
    return [item for item in plan if item["seed"] in wanted]


def run_one(plan: dict[str, Any], work: Path, nodes: int, threads: int) -> dict[str, Any]:
    """One federated run over a ProcessGrid; returns its summary, records and measurements."""
    import torch

    from fedcybgd.config import RunConfig
    from fedcybgd.harness.procgrid import ProcessGrid
    from fedcybgd.server.app import RUNNERS  # the ServerApp's own table: strategy -> runner

    torch.set_num_threads(threads)
    out = work / plan["id"]
    shutil.rmtree(out, ignore_errors=True)
    config = {**plan["config"], "output-dir": str(out)}
    run = RunConfig.from_run_config(config)
    started = time.perf_counter()
    with ProcessGrid(CLIENT_APP, nodes, config, threads=threads,
                     node_config=lambda i: {"cache-dir": str(out / "client-cache")}) as grid:
        summary = RUNNERS[run.strategy](grid, run)
        exchanges = grid.exchanges
    wall = time.perf_counter() - started
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["round"] > 0]
    result = {
        **{k: plan[k] for k in ("id", "method", "partition", "seed", "config")},
        "task": plan.get("task", ""), "nodes": nodes,
        "summary": {k: v for k, v in summary.items() if k not in ("cycle", "block_versions")},
        "records": records,
        "wire_bytes_down": sum(e.bytes_down for e in exchanges),
        "wire_bytes_up": sum(e.bytes_up for e in exchanges),
        # every exchange crossed the wire; a client-round is a train message (not a key query)
        "client_rounds": sum(e.message_type == "train" for e in exchanges),
        "client_process_peak_mb": max(e.peak_rss_mb for e in exchanges),
        # ru_maxrss: inherits the server's RSS at spawn on Linux, an upper bound only
        "client_process_max_rss_mb": max(e.max_rss_mb for e in exchanges),
        # A round's time without the server's evaluation (same for every method).
        "round_s": sum(r["round_s"] - r.get("eval_s", 0.0) for r in trained) / len(trained),
        "wall_s": wall,
    }
    shutil.rmtree(out, ignore_errors=True)  # weights, caches, checkpoints: GBs, not results
    return result


def probe_inference(model: str, batch_size: int, max_seq_len: int, threads: int,
                    steps: int) -> float:
    """Peak RSS (MB) of a fresh client-like process running forward passes (the floor)."""
    code = (
        "import json; from experiments.run_experiments import _inference_peak; "
        f"print(json.dumps(_inference_peak({model!r}, {batch_size}, {max_seq_len}, "
        f"{threads}, {steps}))); "
        # printed and flushed: skip the interpreter's teardown (about a second with torch)
        "import os, sys; sys.stdout.flush(); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def _inference_peak(model: str, batch_size: int, max_seq_len: int, threads: int,
                    steps: int) -> float:
    # The same imports and model object as a client process (the ClientApp module, its
    # ClientModel), so the floor differs from a training client only by the training.
    import torch

    from fedcybgd.client.app import app  # noqa: F401  (a client process imports it)
    from fedcybgd.client.runtime import client_model
    from fedcybgd.core.measure import PeakMemory
    from fedcybgd.model.loading import load_tokenizer
    from fedcybgd.tasks import shares

    torch.set_num_threads(threads)
    cm = client_model(model, 1)
    examples = shares.client_examples("rotten-tomatoes", "dirichlet", 0, 8, 0.5, 0)
    batches = shares.batches(examples, load_tokenizer(model), batch_size, max_seq_len, seed=0,
                           shuffle=True)
    with PeakMemory() as mem, torch.no_grad():
        for _ in range(steps):
            batch = next(batches)
            cm.stack.forward_logits(batch.input_ids, batch.attention_mask, batch.last_index)
    return mem.peak_mb


def total_bytes(result: dict[str, Any]) -> int:
    """Serialised messages both ways over the whole run."""
    return int(result["wire_bytes_down"] + result["wire_bytes_up"])


def evals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's evaluated rounds."""
    return [r for r in result["records"] if r.get("eval_accuracy") is not None]


def gain(result: dict[str, Any]) -> float:
    """Final minus initial eval accuracy."""
    s = result["summary"]
    return float(s["final_eval_accuracy"] - s["initial_eval_accuracy"])


def best_trained(result: dict[str, Any]) -> float:
    """Best eval accuracy after training began (round 0 is the same model for every method)."""
    return max(e["eval_accuracy"] for e in evals(result) if e["round"] > 0)


def targets(results: dict[str, dict[str, Any]], inference_mb: float) -> list[str]:
    """The issue's targets, each PASS or MISS with the numbers behind it."""
    lines = []
    partitions = sorted({r["partition"] for r in results.values()})
    for part in partitions:
        full = results.get(f"fedavg-full@{part}")
        fo = results.get(f"fedcybgd-fo@{part}")
        lora = results.get(f"fedavg-lora@{part}")
        lezo = results.get(f"fedcybgd-lezo@{part}")
        if full and fo:
            acc_gap = fo["summary"]["final_eval_accuracy"] - full["summary"]["final_eval_accuracy"]
            traffic = total_bytes(full) / total_bytes(fo)
            memory = full["client_process_peak_mb"] / fo["client_process_peak_mb"]
            lines += [
                f"- [{part}] FedCyBGD-fo within 1 point of FedAvg-full's final accuracy: "
                f"{'PASS' if acc_gap >= -0.01 - 1e-9 else 'MISS'} ({acc_gap * 100:+.1f} points; "
                f"change from round 0: fo {gain(fo) * 100:+.1f}, FedAvg-full "
                f"{gain(full) * 100:+.1f} points)",
                f"- [{part}] FedCyBGD-fo >= 50x less total traffic than FedAvg-full: "
                f"{'PASS' if traffic >= 50 else 'MISS'} ({traffic:.1f}x)",
                f"- [{part}] FedCyBGD-fo >= 2x less peak client memory than FedAvg-full: "
                f"{'PASS' if memory >= 2 else 'MISS'} ({memory:.2f}x)",
            ]
        if lora and fo:
            better = fo["summary"]["final_eval_accuracy"] > lora["summary"]["final_eval_accuracy"]
            cheaper = total_bytes(fo) <= total_bytes(lora)
            lines.append(
                f"- [{part}] FedCyBGD-fo beats FedAvg-LoRA's accuracy at equal or lower traffic: "
                f"{'PASS' if better and cheaper else 'MISS'} (accuracy "
                f"{fo['summary']['final_eval_accuracy']:.3f} vs "
                f"{lora['summary']['final_eval_accuracy']:.3f}, traffic "
                f"{total_bytes(fo) / MB:,.1f} vs {total_bytes(lora) / MB:,.1f} MB)"
            )
        if lezo:
            ratio = lezo["client_process_peak_mb"] / inference_mb
            lines.append(
                f"- [{part}] FedCyBGD-lezo within 1.1x of inference memory: "
                f"{'PASS' if ratio <= 1.1 else 'MISS'} ({ratio:.3f}x: "
                f"{lezo['client_process_peak_mb']:,.0f} vs {inference_mb:,.0f} MB)"
            )
    return lines


def table(results: dict[str, dict[str, Any]], inference_mb: float, meta: dict[str, Any]) -> str:
    """The Markdown report of a profile's results."""
    from provenance import commands_line  # beside this script (not on the probe's path)

    head = ("| run | final acc | best acc (after round 0) | final loss | MB down | MB up | "
            "MB total | client peak MB | training peak MB | s/round |")
    rows = [head, "|" + "---|" * 10]
    for rid, r in results.items():
        s = r["summary"]
        rows.append(
            f"| {rid} | {s['final_eval_accuracy']:.3f} | {best_trained(r):.3f} | "
            f"{s['final_eval_loss']:.3f} | {r['wire_bytes_down'] / MB:,.1f} | "
            f"{r['wire_bytes_up'] / MB:,.2f} | {total_bytes(r) / MB:,.1f} | "
            f"{r['client_process_peak_mb']:,.0f} | {s['client_peak_mem_mb']:,.0f} | "
            f"{r['round_s']:.1f} |"
        )
    initial = next(iter(results.values()))["summary"]
    seed_lines = seed_spread(results)
    return "\n".join([
        f"# Results: profile `{meta['profile']}`",
        "",
        f"{commands_line(meta)}  ",
        f"Machine: {meta['machine']}; finished {meta['time']}.  ",
        f"Before training: accuracy {initial['initial_eval_accuracy']:.3f}, "
        f"loss {initial['initial_eval_loss']:.3f} "
        f"({initial['run_config']['eval-examples']} test examples).  ",
        f"Runs: {len(results)}, {sum(r['wall_s'] for r in results.values()) / 60:.1f} min of "
        "wall time together (each run from its start to its summary).  ",
        f"Inference floor (a fresh process with the ClientApp's imports and model, forward "
        f"passes of the same batches): {inference_mb:,.0f} MB.",
        "",
        "MB down/up: serialised Flower messages, all client-rounds. Client peak: RSS of the "
        "client process while handling a message (decoding downloads and encoding the upload "
        "included); training peak: the same process's RSS during local training only. "
        "s/round: without the server's evaluation.",
        "",
        *rows,
        "",
        "## Targets",
        "",
        *targets(results, inference_mb),
        "",
        "## Seed check",
        "",
        *seed_lines,
        "",
    ])


def seed_spread(results: dict[str, dict[str, Any]]) -> list[str]:
    """Final accuracy and loss of runs that differ only by seed."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results.values():
        key = "@".join([r["method"], *([r["task"]] if r.get("task") else []), r["partition"]])
        groups.setdefault(key, []).append(r)
    lines = []
    for key, runs in groups.items():
        if len(runs) < 2:
            continue
        accs = [x["summary"]["final_eval_accuracy"] for x in runs]
        losses = [x["summary"]["final_eval_loss"] for x in runs]
        lines.append(
            f"- {key}, seeds {[x['seed'] for x in runs]}: final accuracy "
            f"{', '.join(f'{a:.3f}' for a in accs)} (spread {(max(accs) - min(accs)) * 100:.1f} "
            f"points), final loss {', '.join(f'{x:.3f}' for x in losses)}"
        )
    return lines or ["- no method was run with more than one seed"]


def plot(results: dict[str, dict[str, Any]], out: Path, inference_mb: float) -> None:
    """Accuracy vs round, accuracy vs cumulative bytes, client peak memory per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    partitions = sorted({r["partition"] for r in results.values()})
    # one colour per run label, the same in every panel
    labels = list(dict.fromkeys(
        rid.split("@", 1)[0] + (f" seed {r['seed']}" if "@seed" in rid else "")
        for rid, r in results.items()))
    colour = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for name, xkey in (("accuracy_vs_round", "round"), ("accuracy_vs_bytes", "bytes")):
        # Row 1: accuracy; row 2: the label-token loss, which separates short runs better.
        fig, axes = plt.subplots(2, len(partitions), figsize=(6 * len(partitions), 8),
                                 squeeze=False)
        for col, part in enumerate(partitions):
            for rid, r in results.items():
                if r["partition"] != part:
                    continue
                # cumulative payload bytes per round (the serialised messages add ~0.1%)
                sent, cumulative = 0.0, {}
                for rec in r["records"]:
                    sent += rec.get("bytes_down", 0) + rec.get("bytes_up", 0)
                    cumulative[rec["round"]] = sent / MB
                xs = [e["round"] if xkey == "round" else cumulative[e["round"]] for e in evals(r)]
                label = rid.split("@", 1)[0] + (f" seed {r['seed']}" if "@seed" in rid else "")
                for row, key in enumerate(("eval_accuracy", "eval_loss")):
                    axes[row][col].plot(xs, [e[key] for e in evals(r)], "o-", label=label,
                                        color=colour[label])
            for row, key in enumerate(("eval accuracy", "eval loss (label token)")):
                ax = axes[row][col]
                ax.set_title(f"partition: {part}")
                ax.set_xlabel("round" if xkey == "round"
                              else "cumulative MB of payloads (down + up)")
                if xkey == "bytes":
                    ax.set_xscale("symlog", linthresh=1.0)
                ax.set_ylabel(key)
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = list(results)
    ax.barh(names, [results[n]["client_process_peak_mb"] for n in names])
    ax.axvline(inference_mb, color="k", linestyle="--", label="inference floor")
    ax.set_xlabel("client peak RSS (MB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "client_memory.png", dpi=110)
    plt.close(fig)


def main() -> None:
    """Run the profile's runs (skipping finished ones), then write the table and plots."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--only", default="", help="comma-separated methods")
    parser.add_argument("--seeds", default="",
                        help="comma-separated seeds of the profile (default: all of them)")
    parser.add_argument("--resume", action="store_true",
                        help="keep runs already saved with the same config")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite table.md and the plots from results.json")
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--work", default=str(ROOT / "outputs" / "experiments"))
    args = parser.parse_args()
    from provenance import with_command

    profile = load_profile(args.profile, Path(args.results))
    settings = profile["profile"]
    threads = int(settings["threads"])
    out = Path(args.results) / profile["name"]
    out.mkdir(parents=True, exist_ok=True)
    saved_path = out / "results.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    # Runs of earlier invocations stay (e.g. after --only); a planned run is redone unless
    # --resume finds it saved with the same config.
    results: dict[str, dict[str, Any]] = saved.get("runs", {})
    only = {m.strip() for m in args.only.split(",") if m.strip()} or None
    plan = only_seeds(planned_runs(profile, only), profile, args.seeds)
    earlier = saved.get("meta", {})
    meta = earlier if args.report_only else {
        "profile": profile["name"],
        "commands": with_command(earlier, "make experiments" if profile["name"] == "quick"
                                 and not only else " ".join(["python", *sys.argv])),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "time": "",
        "tuned": {f"{method} on {partition}": f"{c['method']} {c['setting']} (validation loss "
                  f"{c['loss']:.4f}{', at an edge of its grid' if c['edge'] else ''})"
                  for method, parts in profile["tuned"].items()
                  for partition, c in parts.items()},
    }
    for method, choice in meta.get("tuned", {}).items():
        print(f"tuned in the sweep: {method}: {choice}", flush=True)
    base = profile["base"]
    # Measured afresh unless only the report is rewritten.
    inference_mb = saved.get("inference_mb") if args.report_only else None
    if inference_mb is None:
        inference_mb = probe_inference(base["model"], base["batch-size"], base["max-seq-len"],
                                       threads, base["local-steps"])
        print(f"inference floor: {inference_mb:,.0f} MB", flush=True)
    began = time.perf_counter()
    for item in [] if args.report_only else plan:
        done = results.get(item["id"])
        if args.resume and done and done["config"] == item["config"]:
            print(f"--- {item['id']}: done before, kept", flush=True)
            continue
        print(f"--- {item['id']} ({time.perf_counter() - began:.0f} s in)", flush=True)
        results[item["id"]] = run_one(item, Path(args.work) / profile["name"], item["nodes"],
                                      threads)
        meta["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
        saved_path.write_text(json.dumps({"meta": meta, "inference_mb": inference_mb,
                                          "runs": results}, indent=1))
    if not args.report_only:
        meta["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    # The report holds the profile's runs as it now defines them (same id and config).
    ordered = {item["id"]: results[item["id"]] for item in planned_runs(profile, None)
               if item["id"] in results and results[item["id"]]["config"] == item["config"]}
    saved_path.write_text(json.dumps({"meta": meta, "inference_mb": inference_mb,
                                      "runs": ordered}, indent=1))
    report = table(ordered, inference_mb, meta)
    (out / "table.md").write_text(report)
    if "tasks" in settings or "seeds" in settings:  # several seeds per method: the payoff
        import payoff

        compute = payoff.load_compute(out)  # client_compute.py's, where it was run
        report = payoff.report(ordered, meta, compute)
        (out / "payoff.md").write_text(report)
        payoff.plot(ordered, out, compute)
    else:
        plot(ordered, out, inference_mb)
    print(report)
    print(f"saved {out} (this invocation: {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
