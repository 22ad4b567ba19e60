"""The learning sweep: each method's settings on the validation split, each at its
own best, with the same client-rounds; the app's defaults are set from what it finds.

    python experiments/sweep.py                         # experiments/configs/sweep.toml
    python experiments/sweep.py --only fo,fedavg-lora   # some methods
    python experiments/sweep.py --resume                # keep the runs already saved
    python experiments/sweep.py --report-only           # rewrite table and plot

A sweep file names the run config every run shares (``[base]``), the partitions and seeds, and
per method its own keys and a grid: every combination of the grid's values is one setting (a
method may run on fewer ``partitions`` or other ``seeds`` than the sweep's). A
grid value that is a table is a bundle of keys set together (e.g. how the nodes share blocks:
``clients-per-block`` with its ``parallel-damping``). Each run is a whole federated run in this
process (:func:`fedcybgd.harness.loopback.run_in_process`: the ServerApp's runner and the real
ClientApp, no Ray): the sweep compares learning; what crosses the wire and client memory are
measured by ``run_experiments.py`` and ``bench_comm.py``.

A method's best setting on a partition is the one with the lowest final eval loss there,
averaged over seeds (on a few hundred examples the loss separates settings more finely than the
accuracy, which one shift of the class bias can swing by 20 points).

Writes ``experiments/results/<sweep>/``: ``results.json`` (every run's config, per-round records
and summary; saved after each run), ``table.md`` (every setting, the best per method marked;
where runs are evaluated along the way, every setting at each evaluation, the best per method and
point marked) and ``curves.png`` (eval loss and accuracy against client-rounds, each method's best).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from provenance import commands_line, with_command

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load_sweep(name: str) -> dict[str, Any]:
    """The sweep file (a path, or a name under ``experiments/configs/``), checked."""
    path = Path(name) if name.endswith(".toml") else HERE / "configs" / f"{name}.toml"
    sweep = tomllib.loads(path.read_text())
    for key in ("sweep", "base", "methods"):
        if key not in sweep:
            raise SystemExit(f"{path}: missing [{key}]")
    for key in ("nodes", "partitions", "seeds"):
        if key not in sweep["sweep"]:
            raise SystemExit(f"{path}: [sweep] lacks {key!r}")
    sweep["name"] = path.stem
    return sweep


def label(value: Any) -> str:
    """A grid value as it appears in a setting's name."""
    if isinstance(value, dict):
        return ",".join(f"{k}={label(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# Keys of a method's table that are the sweep's, not run config.
PLAN_KEYS = ("grid", "partitions", "seeds")


def settings(method: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, run-config keys)`` of every combination of ``method``'s grid."""
    fixed = {k: v for k, v in method.items() if k not in PLAN_KEYS}
    grid: dict[str, list[Any]] = method.get("grid", {})
    out = []
    for values in itertools.product(*grid.values()):
        keys = dict(fixed)
        parts = []
        for axis, value in zip(grid, values, strict=True):
            if isinstance(value, dict):
                keys.update(value)
                parts.append(label(value))
            else:
                keys[axis] = value
                parts.append(f"{axis}={label(value)}")
        out.append((" ".join(parts) or "default", keys))
    return out


def planned_runs(sweep: dict[str, Any], only: set[str] | None) -> list[dict[str, Any]]:
    """Every run of the sweep in the file's order: id, method, setting, partition, seed and
    full run config."""
    runs = []
    for method, spec in sweep["methods"].items():
        if only and method not in only:
            continue
        for setting, keys in settings(spec):
            for partition in spec.get("partitions", sweep["sweep"]["partitions"]):
                for seed in spec.get("seeds", sweep["sweep"]["seeds"]):
                    config = {**sweep["base"], **keys, "partitioner": partition, "seed": seed}
                    runs.append({"id": f"{method} | {setting} | {partition} | seed {seed}",
                                 "method": method, "setting": setting, "partition": partition,
                                 "seed": seed, "config": config})
    return runs


def middle_first(grid: dict[str, list[Any]]) -> list[int]:
    """Positions in :func:`settings`' order, the grid's middle first and its corners last (by
    the summed distance of each axis's value from that axis's middle)."""
    positions = list(itertools.product(*(range(len(values)) for values in grid.values())))
    centre = [(len(values) - 1) / 2 for values in grid.values()]
    return sorted(range(len(positions)),
                  key=lambda i: sum(abs(p - c) for p, c in zip(positions[i], centre,
                                                               strict=True)))


def run_order(sweep: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The order to run ``runs`` in: the methods take turns, each over its settings middle
    first (:func:`middle_first`), so a sweep cut into pieces learns the most from its earliest
    runs, every method's grid fills evenly, and a best at an edge shows once the edges are in."""
    queues: dict[str, list[dict[str, Any]]] = {}
    for method, spec in sweep["methods"].items():
        names = [name for name, _ in settings(spec)]
        rank = {names[p]: i for i, p in enumerate(middle_first(spec.get("grid", {})))}
        mine = [run for run in runs if run["method"] == method]
        queues[method] = sorted(mine, key=lambda run: rank[run["setting"]])  # stable: seeds
    return [run for turn in itertools.zip_longest(*queues.values()) for run in turn
            if run is not None]


def run_one(plan: dict[str, Any], work: Path, nodes: int) -> dict[str, Any]:
    """One federated run in this process; its summary, records and wall time."""
    from fedcybgd.harness.loopback import run_in_process

    started = time.perf_counter()
    summary, records = run_in_process(plan["config"], nodes, work / "run")
    keep = ("initial_eval_loss", "initial_eval_accuracy", "final_eval_loss",
            "final_eval_accuracy", "bytes_down", "bytes_up", "client_peak_mem_mb",
            "run_config")
    return {**plan, "summary": {k: summary[k] for k in keep if k in summary},
            "records": records, "wall_s": time.perf_counter() - started}


def client_rounds(records: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """``(client-rounds so far, row)`` for every evaluated row."""
    done, out = 0, []
    for row in records:
        done += len(row.get("clients") or [])
        if row.get("eval_loss") is not None:
            out.append((done, row))
    return out


def scores(results: dict[str, dict[str, Any]]) -> dict[tuple[str, str], dict[Any, Any]]:
    """Per (method, setting): final eval ``(loss, accuracy)`` per ``(partition, seed)``."""
    table: dict[tuple[str, str], dict[Any, Any]] = {}
    for r in results.values():
        table.setdefault((r["method"], r["setting"]), {})[(r["partition"], r["seed"])] = (
            r["summary"]["final_eval_loss"], r["summary"]["final_eval_accuracy"])
    return table


def mean_on(runs: dict[Any, Any], partition: str) -> tuple[float, float] | None:
    """Mean final ``(loss, accuracy)`` over the seeds of ``partition``; ``None``: not run."""
    values = [v for (p, _), v in runs.items() if p == partition]
    if not values:
        return None
    return statistics.fmean(v[0] for v in values), statistics.fmean(v[1] for v in values)


def best_settings(results: dict[str, dict[str, Any]], partition: str) -> dict[str, str]:
    """Method -> its setting with the lowest mean final eval loss on ``partition`` (ties:
    higher accuracy)."""
    best: dict[str, tuple[float, float, str]] = {}
    for (method, setting), runs in scores(results).items():
        mean = mean_on(runs, partition)
        if mean is None:
            continue
        key = (mean[0], -mean[1], setting)
        if method not in best or key < best[method]:
            best[method] = key
    return {method: key[2] for method, key in best.items()}


# Keys of a sweep's [base] that shape what a rate is tuned for: a profile that takes a sweep's
# best setting must share them (a rate tuned at one length or batch does not carry to another).
SHAPE_KEYS = ("model", "task", "dataset", "num-server-rounds", "clients-per-round",
              "clients-per-block", "local-steps", "batch-size", "max-seq-len", "lr-schedule",
              "layers-per-block")


def tuned(name: str, methods: list[str], partition: str, results_root: Path) -> dict[str, Any]:
    """The best setting of sweep ``name`` among ``methods`` on ``partition``: the lowest final
    validation loss, mean over the sweep's seeds (:func:`best_settings`' rule), once every
    setting of those methods has run there.

    Returns ``method``, ``setting``, ``keys`` (the method's run-config keys with that setting),
    ``config`` (the sweep's run config of that setting, to check a user's against with
    :func:`shape_differences`), ``loss`` and ``edge`` (the setting sits at an edge of a grid axis
    of three or more values: the best may lie beyond it). Anything missing is a ``SystemExit``
    that names it."""
    sweep = load_sweep(name)
    unknown = sorted(set(methods) - set(sweep["methods"]))
    if unknown:
        raise SystemExit(f"sweep {sweep['name']} has no methods {unknown} "
                         f"(it has {sorted(sweep['methods'])})")
    planned = [p for p in planned_runs(sweep, set(methods)) if p["partition"] == partition]
    if not planned:
        raise SystemExit(f"sweep {sweep['name']} runs {methods} on no partition {partition!r}")
    path = results_root / sweep["name"] / "results.json"
    saved = json.loads(path.read_text())["runs"] if path.exists() else {}
    done = {p["id"]: saved[p["id"]] for p in planned
            if p["id"] in saved and saved[p["id"]]["config"] == p["config"]}
    missing = [p["id"] for p in planned if p["id"] not in done]
    if missing:
        raise SystemExit(f"sweep {sweep['name']} has not run {missing} yet: python "
                         f"experiments/sweep.py --sweep {sweep['name']} --resume --only "
                         + ",".join(methods))
    best = min(((mean[0], -mean[1], method, setting)
                for (method, setting), runs in scores(done).items()
                if (mean := mean_on(runs, partition)) is not None))
    loss, _, method, setting = best
    spec = sweep["methods"][method]
    names = [n for n, _ in settings(spec)]
    grid = spec.get("grid", {})
    position = list(itertools.product(*(range(len(v)) for v in grid.values())))[
        names.index(setting)] if grid else ()
    edge = any(len(values) > 2 and i in (0, len(values) - 1)
               for i, values in zip(position, grid.values(), strict=True))
    config = next(p["config"] for p in planned
                  if p["method"] == method and p["setting"] == setting)
    return {"method": method, "setting": setting, "keys": dict(settings(spec))[setting],
            "config": config, "loss": loss, "edge": edge}


def shape_differences(config: dict[str, Any], swept: dict[str, Any]) -> list[str]:
    """The :data:`SHAPE_KEYS` on which run config ``config`` differs from ``swept``, the
    config a setting was tuned in, each as ``key = value (tuned at value)``."""
    return [f"{k} = {config.get(k)!r} (tuned at {swept.get(k)!r})"
            for k in SHAPE_KEYS if config.get(k) != swept.get(k)]


def seed_spread(results: dict[str, dict[str, Any]]) -> list[str]:
    """For every setting run with several seeds on a partition: the accuracy gain over the
    model before training, per seed and on average, the spread of the final accuracies, and
    whether the gain is beyond that spread (every seed gains and the mean gain exceeds the
    spread), and the same for the eval loss."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results.values():
        groups.setdefault((r["method"], r["setting"], r["partition"]), []).append(r)
    lines = []
    for (method, setting, partition), runs in groups.items():
        if len(runs) < 2:
            continue
        runs = sorted(runs, key=lambda r: r["seed"])
        finals = [r["summary"]["final_eval_accuracy"] for r in runs]
        gains = [r["summary"]["final_eval_accuracy"] - r["summary"]["initial_eval_accuracy"]
                 for r in runs]
        losses = [r["summary"]["final_eval_loss"] for r in runs]
        spread = max(finals) - min(finals)
        mean = statistics.fmean(gains)
        beyond = min(gains) > 0 and mean > spread
        lines.append(
            f"- {method} ({setting}) on {partition}, seeds {[r['seed'] for r in runs]}: "
            f"accuracy {', '.join(f'{a:.3f}' for a in finals)}, gain over zero-shot "
            f"{mean * 100:+.1f} points (min {min(gains) * 100:+.1f}), final spread "
            f"{spread * 100:.1f} points: {'beyond' if beyond else 'NOT beyond'} the seed "
            f"spread; eval loss {', '.join(f'{x:.3f}' for x in losses)} (from "
            f"{runs[0]['summary']['initial_eval_loss']:.3f})")
    return lines


HALF = -1  # along_the_way's key for the mean over the curve's second half


def along_the_way(results: dict[str, dict[str, Any]], partition: str) -> list[str]:
    """Where the runs were evaluated along the way: one row per setting on ``partition``, a
    column per evaluation (client-rounds so far), the mean eval ``loss / accuracy`` over seeds;
    each method's lowest loss at a point marked; a last column with the mean over the curve's
    second half (the evaluations after half the last one's client-rounds). Empty where no run
    has an evaluation between its first and last round."""
    curves: dict[tuple[str, str], dict[int, list[tuple[float, float]]]] = {}
    for r in results.values():
        if r["partition"] != partition:
            continue
        for done, row in client_rounds(r["records"]):
            curves.setdefault((r["method"], r["setting"]), {}).setdefault(done, []).append(
                (float(row["eval_loss"]), float(row["eval_accuracy"])))
    points = sorted({done for curve in curves.values() for done in curve if done > 0})
    if len(points) < 2:
        return []
    mean = {key: {done: (statistics.fmean(v[0] for v in values),
                         statistics.fmean(v[1] for v in values))
                  for done, values in curve.items()} for key, curve in curves.items()}
    # the curve's second half: one evaluation is noisy, its neighbours smooth it
    late = [done for done in points if done > points[-1] / 2]
    for curve in mean.values():
        if all(done in curve for done in late):
            curve[HALF] = (statistics.fmean(curve[d][0] for d in late),
                           statistics.fmean(curve[d][1] for d in late))
    best: dict[tuple[str, int], float] = {}
    for (method, _), curve in mean.items():
        for done, (loss, _) in curve.items():
            best[method, done] = min(loss, best.get((method, done), loss))
    rows = ["| method | setting | " + " | ".join(f"{d} client-rounds" for d in points) +
            f" | second half ({', '.join(map(str, late))}) |", "|" + "---|" * (len(points) + 3)]
    for (method, setting), curve in mean.items():
        cells = []
        for done in [*points, HALF]:
            if done not in curve:
                cells.append("-")
                continue
            loss, accuracy = curve[done]
            mark = " **best**" if loss == best[method, done] else ""
            cells.append(f"{loss:.3f} / {accuracy:.3f}{mark}")
        rows.append(f"| {method} | {setting} | " + " | ".join(cells) + " |")
    return [f"## {partition}: along the way", "",
            "Mean eval loss / accuracy at each evaluation; each method's lowest loss there "
            "marked (with a constant rate, the best setting for a run of that length; a "
            "decaying one was decayed over the whole run). The last column averages the "
            "evaluations of the curve's second half: on one seed and a few hundred examples "
            "a single evaluation is noisy, so where the last point and the second half "
            "disagree, the second half is the steadier choice.", "", *rows, ""]


def report(sweep: dict[str, Any], results: dict[str, dict[str, Any]],
           meta: dict[str, Any]) -> str:
    """The Markdown table: one row per setting, a column per partition and seed, the mean per
    partition; each method's best per partition marked."""
    partitions = sweep["sweep"]["partitions"]
    seeds = sorted({r["seed"] for r in results.values()})
    columns = [(p, s) for p in partitions for s in seeds]
    best = {p: best_settings(results, p) for p in partitions}
    first = next(iter(results.values()))["summary"]
    head = ["method", "setting", *[f"{p} s{s}" for p, s in columns],
            *[f"{p} mean" for p in partitions]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (method, setting), runs in scores(results).items():
        cells = ["-" if runs.get(c) is None else f"{runs[c][0]:.3f} / {runs[c][1]:.3f}"
                 for c in columns]
        for p in partitions:
            mean = mean_on(runs, p)
            mark = " **best**" if best[p].get(method) == setting else ""
            cells.append("-" if mean is None else f"{mean[0]:.3f} / {mean[1]:.3f}{mark}")
        rows.append(f"| {method} | {setting} | " + " | ".join(cells) + " |")
    # the whole run config of a run (every key, defaults included) for the shared sizes
    base = first.get("run_config", sweep["base"])
    per_round = int(base["clients-per-round"]) * int(base["num-server-rounds"])
    return "\n".join([
        f"# Sweep `{sweep['name']}`",
        "",
        f"{commands_line(meta)}  ",
        f"Machine: {meta['machine']}; finished {meta['time']}.  ",
        f"Every run: {per_round} client-rounds ({base['num-server-rounds']} rounds x "
        f"{base['clients-per-round']} nodes of {sweep['sweep']['nodes']}), "
        f"{base['local-steps']} local steps of batch {base['batch-size']} x "
        f"{base['max-seq-len']} tokens, evaluated on {base['eval-examples']} "
        f"{base['eval-split']} examples.  ",
        f"Before training: eval loss {first['initial_eval_loss']:.3f}, accuracy "
        f"{first['initial_eval_accuracy']:.3f}.  ",
        f"Runs: {len(results)}, {sum(r['wall_s'] for r in results.values()) / 60:.0f} min "
        "together.",
        "",
        "Final eval loss / accuracy. Each method's best setting on a partition has the lowest "
        "mean loss there.",
        "",
        *rows,
        "",
        *[line for p in partitions for line in along_the_way(results, p)],
        *(["## Seed spread", "", *spread_lines, ""] if (spread_lines := seed_spread(results))
          else []),
    ])


def plot(results: dict[str, dict[str, Any]], out: Path) -> None:
    """Eval loss and accuracy against client-rounds for each method's best setting, a
    panel per partition (seeds as separate lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    partitions = list(dict.fromkeys(r["partition"] for r in results.values()))
    best = {p: best_settings(results, p) for p in partitions}
    fig, axes = plt.subplots(2, len(partitions), figsize=(6 * len(partitions), 8),
                             squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in results.values()))
    for r in results.values():
        if best[r["partition"]].get(r["method"]) != r["setting"]:
            continue
        col = partitions.index(r["partition"])
        points = client_rounds(r["records"])
        colour = f"C{methods.index(r['method']) % 10}"
        for row, key in enumerate(("eval_loss", "eval_accuracy")):
            axes[row][col].plot([x for x, _ in points], [p[key] for _, p in points], "o-",
                                color=colour, alpha=0.8,
                                label=f"{r['method']} ({r['setting']}) seed {r['seed']}")
    for col, partition in enumerate(partitions):
        for row, name in enumerate(("eval loss", "eval accuracy")):
            ax = axes[row][col]
            ax.set_title(f"{partition}: {name}, each method's best")
            ax.set_xlabel("client-rounds")
            ax.legend(fontsize=6)
        axes[0][col].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def write_report(sweep: dict[str, Any], results: dict[str, dict[str, Any]],
                 meta: dict[str, Any], out: Path) -> dict[str, dict[str, Any]]:
    """Write ``table.md`` and ``curves.png`` from the runs the sweep file now defines (same id
    and config; returned, in the file's order); nothing when there are none."""
    current = {item["id"]: results[item["id"]] for item in planned_runs(sweep, None)
               if item["id"] in results and results[item["id"]]["config"] == item["config"]}
    if current:
        (out / "table.md").write_text(report(sweep, current, meta))
        plot(current, out)
    return current


def main() -> None:
    """Run the sweep (skipping finished runs with --resume), then write table and plot."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="sweep", help="a file in experiments/configs/ "
                        "(without .toml) or a path")
    parser.add_argument("--only", default="", help="comma-separated methods")
    parser.add_argument("--resume", action="store_true",
                        help="keep runs already saved with the same config")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--work", default=str(ROOT / "outputs" / "sweep"))
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: the sweep file's [sweep] threads, or 2)")
    args = parser.parse_args()

    import torch

    sweep = load_sweep(args.sweep)
    torch.set_num_threads(args.threads or int(sweep["sweep"].get("threads", 2)))
    out = Path(args.results) / sweep["name"]
    out.mkdir(parents=True, exist_ok=True)
    saved_path = out / "results.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    results: dict[str, dict[str, Any]] = saved.get("runs", {})
    only = {m.strip() for m in args.only.split(",") if m.strip()} or None
    earlier = saved.get("meta", {})
    meta = earlier if args.report_only else {
        "sweep": sweep["name"],
        "commands": with_command(earlier, " ".join(["python", *sys.argv])),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}, torch {torch.__version__}",
        "time": ""}
    began = time.perf_counter()
    for item in [] if args.report_only else run_order(sweep, planned_runs(sweep, only)):
        done = results.get(item["id"])
        if args.resume and done and done["config"] == item["config"]:
            print(f"--- {item['id']}: done before, kept", flush=True)
            continue
        print(f"--- {item['id']} ({time.perf_counter() - began:.0f} s in)", flush=True)
        results[item["id"]] = run_one(item, Path(args.work) / sweep["name"],
                                      int(sweep["sweep"]["nodes"]))
        s = results[item["id"]]["summary"]
        print(f"    final eval loss {s['final_eval_loss']:.4f}, accuracy "
              f"{s['final_eval_accuracy']:.3f}", flush=True)
        meta["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
        saved_path.write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
        write_report(sweep, results, meta, out)  # a piece cut short leaves a current table
    current = write_report(sweep, results, meta, out)
    if not current:
        raise SystemExit("no finished runs to report")
    saved_path.write_text(json.dumps({"meta": meta, "runs": current}, indent=1))
    print((out / "table.md").read_text())
    for partition in sweep["sweep"]["partitions"]:
        print(f"best on {partition}: {json.dumps(best_settings(current, partition))}")
    print(f"saved {out} ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
