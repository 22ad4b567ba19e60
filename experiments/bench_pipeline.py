"""A model split over K pipeline stages: backprop pipelines (GPipe, 1F1B) against ZeroLock.

Each stage is its own process with its own copy of the model and one torch thread
(``fedcybgd.harness.pipeline``); stage 0 reads Rotten Tomatoes' train split and feeds
micro-batches; activations (and, for backprop, their gradients) travel between neighbours as
safetensors messages. Same chunks, same micro-batches, same AdamW, one step per mini-batch of
``--micro-batches`` on every schedule. Per run it records:

* per-stage memory: resident memory after loading, and the peak while training above it
  (activations kept for backward, gradients, AdamW state; the model's own copy is the load);
* measured wall time of training on THIS machine (the K stages share its cores: with K > cores
  this is not what K devices take) and the micro-batches a second it gives;
* a projection for K devices with their own core: each operation's measured CPU seconds
  replayed by the schedule simulator (``fedcybgd.server.pipeline.schedules.simulate``), every
  message taking its measured size over a 1 Gbit/s and a 100 Mbit/s link;
* activation traffic per micro-batch (up; and down for backprop);
* the evaluation loss and accuracy of the trained model on the validation split after the same
  number of examples, beside the untrained model's.

    python experiments/bench_pipeline.py                       # SmolLM2, K = 2 and 4
    python experiments/bench_pipeline.py --stages 2 --schedules zerolock,gpipe --steps 2

Writes ``experiments/results/pipeline/bench.json`` (every run) and ``bench.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fedcybgd.harness.pipeline import (  # noqa: E402
    PipelineSpec,
    evaluate_chunks,
    project,
    run_pipeline,
)

LINKS_MBIT = (1000.0, 100.0)


def row(result, untrained: float) -> dict:
    spec = result.spec
    count = result.micro_batches
    stages = result.stages
    up = sum(s.bytes_up for s in stages) / count
    down = sum(s.bytes_down for s in stages) / count
    out = {
        "schedule": spec.schedule, "stages": spec.stages, "seed": spec.seed,
        "training_mb_max": max(s.training_mb for s in stages),
        "training_mb": [round(s.training_mb, 1) for s in stages],
        "peak_rss_mb": [round(s.peak_rss_mb, 1) for s in stages],
        "kept": [s.max_kept for s in stages],
        "wall_s": result.wall_s, "measured_mb_per_s": count / result.wall_s,
        "bytes_up_per_mb": up, "bytes_down_per_mb": down,
        "eval_loss": result.eval_loss, "eval_accuracy": result.eval_accuracy,
        "untrained_eval_loss": untrained,
        "op_cpu_s": {f"{s.stage}{k}": v["cpu_s"] / v["count"] for s in stages
                     for k, v in s.ops.items()},
    }
    for link in LINKS_MBIT:
        out[f"projected_{link:g}"] = project(result, link)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| K | schedule | seeds | training memory above load, largest stage (MB) | kept "
        "micro-batches per stage | measured mb/s (shared cores) | projected mb/s, 1 Gbit/s | "
        "projected mb/s, 100 Mbit/s | KB per mb up / down | eval loss | eval accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["stages"], r["schedule"]), []).append(r)

    def span(values: list[float], fmt: str) -> str:
        mean = statistics.fmean(values)
        if len(values) == 1:
            return format(mean, fmt)
        return f"{format(mean, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"

    for (k, schedule), group in sorted(groups.items()):
        first = group[0]
        lines.append(
            f"| {k} | {schedule} | {len(group)} | "
            f"{span([g['training_mb_max'] for g in group], ',.0f')} | {first['kept']} | "
            f"{span([g['measured_mb_per_s'] for g in group], '.3f')} | "
            f"{span([g['projected_1000']['micro_batches_per_s'] for g in group], '.3f')} | "
            f"{span([g['projected_100']['micro_batches_per_s'] for g in group], '.3f')} | "
            f"{first['bytes_up_per_mb'] / 1e3:,.0f} / {first['bytes_down_per_mb'] / 1e3:,.0f} | "
            f"{span([g['eval_loss'] for g in group], '.4f')} | "
            f"{span([g['eval_accuracy'] for g in group], '.3f')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--schedules", default="gpipe,1f1b,zerolock")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--aux-layers", type=int, default=0)
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pipeline" / "bench.json")
    args = parser.parse_args()

    base = dict(model=args.model, micro_batches=args.micro_batches, steps=args.steps,
                batch_size=args.batch, max_seq_len=args.seq, lr=args.lr,
                aux_layers=args.aux_layers, eval_examples=args.eval_examples)
    untrained, _ = evaluate_chunks(PipelineSpec(stages=1, schedule="gpipe", **base), [])
    print(f"untrained eval loss {untrained:.4f}", flush=True)
    rows = []
    started = time.time()
    for k in (int(x) for x in args.stages.split(",")):
        for schedule in args.schedules.split(","):
            for seed in (int(x) for x in args.seeds.split(",")):
                spec = PipelineSpec(stages=k, schedule=schedule, seed=seed, **base)
                t = time.time()
                result = run_pipeline(spec)
                r = row(result, untrained)
                rows.append(r)
                print(f"K={k} {schedule} seed {seed}: {time.time() - t:.0f} s; training "
                      f"memory {r['training_mb']} MB; measured {r['measured_mb_per_s']:.3f} mb/s,"
                      f" projected {r['projected_1000']['micro_batches_per_s']:.3f} mb/s; eval "
                      f"loss {r['eval_loss']:.4f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python experiments/bench_pipeline.py", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.time() - started,
            "settings": base, "untrained_eval_loss": untrained}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = (f"# Pipeline: backprop pipelines against ZeroLock\n\nCommand: `{meta['command']}`  \n"
            f"Machine: {meta['machine']}; finished {meta['finished']}.  \n"
            f"Model {args.model}; {args.steps} steps of {args.micro_batches} micro-batches of "
            f"{args.batch} x {args.seq} tokens ({args.steps * args.micro_batches * args.batch} "
            f"examples), AdamW lr {args.lr:g}; untrained eval loss {untrained:.4f} "
            f"({args.eval_examples} validation examples).  \n"
            "Measured mb/s: the stages shared this machine's cores. Projected: each operation's "
            "measured CPU seconds replayed for K devices with a core each (a projection).\n\n"
            + table(rows) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
