"""Pipeline mode on real SuperNodes: SmolLM2 over 2 and 4 stages, both kinds of schedule.

Each run is a loopback deployment (``fedcybgd deploy-local``'s library: a SuperLink and
``stages`` SuperNodes on 127.0.0.1, each message a fresh ClientApp process that loads the
model and its stage's state from the node's disk) of ``strategy = "pipeline"``:

    python experiments/pipeline_deploy.py                      # K = 2, 4 x zerolock, gpipe
    python experiments/pipeline_deploy.py --stages 2 --schedules zerolock --rounds 1

Writes ``experiments/results/pipeline/deploy.json`` and ``deploy.md``: per run its status, wall
time, the evaluation before and after, the bytes through the SuperLink and the seconds per
message, from the run's own ``summary.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fedcybgd.deploy.commands import format_config  # noqa: E402
from fedcybgd.deploy.local import run_deployment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--schedules", default="zerolock,gpipe")
    parser.add_argument("--rounds", type=int, default=2, help="optimizer steps (server rounds)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--eval-examples", type=int, default=100)
    parser.add_argument("--work", type=Path, default=HERE.parent / "outputs" / "pipeline-deploy")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pipeline" / "deploy.json")
    args = parser.parse_args()

    rows = []
    for k in (int(x) for x in args.stages.split(",")):
        for schedule in args.schedules.split(","):
            out = args.work / f"k{k}-{schedule}"
            config = {"model": args.model, "strategy": "pipeline", "pipeline-stages": k,
                      "pipeline-schedule": schedule, "micro-batches": args.micro_batches,
                      "num-server-rounds": args.rounds, "batch-size": 4, "max-seq-len": 64,
                      "eval-examples": args.eval_examples, "partitioner": "iid",
                      "overwrite": True, "output-dir": str(out)}
            started = time.perf_counter()
            result = run_deployment(k, format_config(config), out, timeout=3600.0)
            wall = time.perf_counter() - started
            summary = json.loads((out / "summary.json").read_text())
            metrics = [json.loads(line) for line in
                       (out / "metrics.jsonl").read_text().splitlines() if line]
            steps = [m for m in metrics if m.get("round", 0) > 0]
            row = {"stages": k, "schedule": schedule, "status": result.status,
                   "reason": result.reason, "wall_s": wall,
                   "initial_eval_loss": summary.get("initial_eval_loss"),
                   "final_eval_loss": summary.get("final_eval_loss"),
                   "final_eval_accuracy": summary.get("final_eval_accuracy"),
                   "bytes_down": summary.get("bytes_down"), "bytes_up": summary.get("bytes_up"),
                   "stage_s": [m.get("stage_s") for m in steps],
                   "train_loss": [m.get("train_loss") for m in steps]}
            rows.append(row)
            print(f"K={k} {schedule}: {result.status} in {wall:.0f} s; eval loss "
                  f"{row['initial_eval_loss']} -> {row['final_eval_loss']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python experiments/pipeline_deploy.py", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Pipeline mode on real SuperNodes\n",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; finished {meta['finished']}.  ",
        f"{args.model}, {args.rounds} steps of {args.micro_batches} micro-batches of 4 x 64 "
        f"tokens; a SuperLink and K SuperNodes on 127.0.0.1; evaluated on "
        f"{args.eval_examples} test examples.\n",
        "| K | schedule | status | wall s | eval loss before -> after | MB through the "
        "SuperLink (down / up) | seconds per step, per stage |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_stage = " / ".join(
            f"{sum(s[i] for s in r['stage_s'] if s) / max(len(r['stage_s']), 1):.0f}"
            for i in range(r["stages"]))
        after = (f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None
                 else "-")
        lines.append(
            f"| {r['stages']} | {r['schedule']} | {r['status']} | {r['wall_s']:.0f} | "
            f"{r['initial_eval_loss']:.4f} -> {after} | {(r['bytes_down'] or 0) / 1e6:.1f} / "
            f"{(r['bytes_up'] or 0) / 1e6:.1f} | {per_stage} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["status"] == "finished:completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
