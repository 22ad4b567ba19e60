"""The demo's payoff across seeds and partitions: is the gain over zero-shot beyond the noise?

    python experiments/demo_seeds.py                      # seeds 0 1 2, iid and dirichlet
    python experiments/demo_seeds.py --seeds 0 --partitioners dirichlet

Each run is ``make demo`` itself (``python -m fedcybgd.cli.demo``: ``flwr run . local`` on Flower's
Simulation Engine with the app's default run config) with only ``seed`` and ``partitioner``
changed, so the figures are what a user gets. Reads each run's ``summary.json`` and writes
``experiments/results/demo_seeds.json`` and ``demo_seeds.md``: per run the eval accuracy and
loss before and after, the wall time (from the command to its end, as measured here) and the
bytes, then per partition the mean gain and the
spread (min, max) across seeds. A gain counts when even the smallest one is above zero and the
mean gain is above the spread of the final accuracies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_demo(seed: int, partitioner: str, out: Path, extra: str,
             report_only: bool = False) -> dict[str, Any] | None:
    """One ``make demo`` run; its summary plus the wall time measured here (``report_only``:
    the summary a previous run left, ``None`` if there is none)."""
    wall = None
    if report_only:
        if not (out / "summary.json").is_file():
            return None
    else:
        overrides = f"seed={seed} partitioner='{partitioner}' {extra}".strip()
        command = [sys.executable, "-m", "fedcybgd.cli.demo", "--output-dir", str(out),
                   "--run-config", overrides]
        print("$", " ".join(command), flush=True)
        started = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, check=False).returncode
        wall = time.perf_counter() - started
        if code != 0:
            raise SystemExit(f"demo run seed={seed} partitioner={partitioner} failed ({code})")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "seed": seed, "partitioner": partitioner, "wall_s": wall,
        "server_wall_s": summary["wall_s"],
        "initial_accuracy": summary["initial_eval_accuracy"],
        "final_accuracy": summary["final_eval_accuracy"],
        "initial_loss": summary["initial_eval_loss"],
        "final_loss": summary["final_eval_loss"],
        "bytes_down": summary["bytes_down"], "bytes_up": summary["bytes_up"],
        "client_peak_mem_mb": summary["client_peak_mem_mb"],
        "run_config": summary["run_config"],
    }


def report(runs: list[dict[str, Any]]) -> str:
    """The table of runs and the per-partition verdict."""
    lines = ["| partitioner | seed | accuracy before -> after | loss before -> after | "
             "wall s | MB moved |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['partitioner']} | {r['seed']} | {r['initial_accuracy']:.3f} -> "
                     f"{r['final_accuracy']:.3f} | {r['initial_loss']:.3f} -> "
                     f"{r['final_loss']:.3f} | "
                     f"{'-' if r['wall_s'] is None else format(r['wall_s'], '.0f')} | "
                     f"{(r['bytes_down'] + r['bytes_up']) / 2**20:,.0f} |")
    lines.append("")
    for part in sorted({r["partitioner"] for r in runs}):
        rs = [r for r in runs if r["partitioner"] == part]
        gains = [r["final_accuracy"] - r["initial_accuracy"] for r in rs]
        finals = [r["final_accuracy"] for r in rs]
        spread = max(finals) - min(finals)
        mean = statistics.fmean(gains)
        beyond = min(gains) > 0 and mean > spread
        lines.append(f"- {part}: gain {mean * 100:+.1f} points (min {min(gains) * 100:+.1f}, "
                     f"max {max(gains) * 100:+.1f}) over {len(rs)} seeds; final accuracy "
                     f"spread {spread * 100:.1f} points: "
                     f"{'beyond' if beyond else 'NOT beyond'} the seed spread; loss "
                     f"{statistics.fmean(r['initial_loss'] for r in rs):.3f} -> "
                     f"{statistics.fmean(r['final_loss'] for r in rs):.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the demo per seed and partitioner, save and print the report."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--partitioners", nargs="+", default=["iid", "dirichlet"])
    parser.add_argument("--run-config", default="", help="extra overrides for every run")
    parser.add_argument("--work", default=str(ROOT / "outputs" / "demo-seeds"))
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--report-only", action="store_true",
                        help="report the runs already in --work (wall time unknown: '-')")
    args = parser.parse_args()
    runs = []
    for part in args.partitioners:
        for seed in args.seeds:
            run = run_demo(seed, part, Path(args.work) / f"{part}-seed{seed}", args.run_config,
                           args.report_only)
            if run is not None:
                runs.append(run)
    text = report(runs)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "demo_seeds.json").write_text(json.dumps(runs, indent=1))
    (results / "demo_seeds.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
