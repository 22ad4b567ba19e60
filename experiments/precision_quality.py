"""Does holding frozen blocks in bf16 or int8 hurt learning? A short federated run per setting.

The same run (seed, data, schedule) with ``frozen-dtype``/``frozen-quant`` fp32, bf16 and
bf16+int8, through the real ClientApp and server loop (:func:`fedcybgd.server.app.run_server`)
on a :class:`~fedcybgd.harness.loopback.LoopbackGrid`, in this process. In-process rather than
``flwr run``: Ray's simulation actors import the installed package, not a worktree's code. The
server evaluates its fp32 global model (``eval-precision = "float32"``) on the first
``--eval-examples`` rows of the validation split before round 1 and after the last round.

    python experiments/precision_quality.py            # SmolLM2-135M, 2 nodes, 4 rounds

Results: printed, and saved to ``experiments/results/precision_quality.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"),
            "int8": ("bfloat16", "int8")}


def run_one(name: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One federated run (``seed``) with frozen blocks held as ``SETTINGS[name]``; its eval
    figures."""
    import torch

    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    torch.manual_seed(seed)
    dtype, quant = SETTINGS[name]
    root = root / f"{name}-seed{seed}"
    config: dict[str, Any] = {
        "model": args.model, "partitioner": "iid", "num-server-rounds": args.rounds,
        "clients-per-round": args.nodes, "update-rule": args.rule,
        "local-steps": args.local_steps, "batch-size": args.batch,
        "max-seq-len": args.seq, "lr": args.lr, "eval-every": 0,
        "eval-examples": args.eval_examples, "eval-split": "validation",
        "seed": seed, "frozen-dtype": dtype, "frozen-quant": quant,
        "output-dir": str(root / "out"),
    }
    grid = LoopbackGrid(client_app, args.nodes, config, keep_sent=1,
                        node_config=lambda i: {"cache-dir": str(root / f"cache{i}")})
    started = time.perf_counter()
    run_server(grid, RunConfig.from_run_config(config), node_wait_s=5.0)
    rows = [json.loads(line) for line in
            (root / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    trained = [r for r in rows if r.get("round", 0) > 0]
    return {
        "setting": name, "seed": seed, "frozen-dtype": dtype, "frozen-quant": quant,
        "eval_loss_start": evals[0]["eval_loss"], "eval_accuracy_start": evals[0]["eval_accuracy"],
        "eval_loss": evals[-1]["eval_loss"], "eval_accuracy": evals[-1]["eval_accuracy"],
        "failed_blocks": sum(len(r.get("failed_blocks") or []) for r in trained),
        "rounds": len(trained), "wall_s": time.perf_counter() - started,
    }


def spread(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per setting: the final eval loss's mean, min and max over seeds, and the largest gap to
    fp32 at the same seed (what the comparison is judged on against fp32's own seed spread)."""
    out: dict[str, dict[str, float]] = {}
    fp32 = {r["seed"]: r["eval_loss"] for r in rows if r["setting"] == "fp32"}
    for name in dict.fromkeys(r["setting"] for r in rows):
        losses = {r["seed"]: r["eval_loss"] for r in rows if r["setting"] == name}
        values = list(losses.values())
        gaps = [abs(v - fp32[s]) for s, v in losses.items() if s in fp32]
        out[name] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values),
                     "seed_spread": max(values) - min(values),
                     "max_gap_to_fp32_same_seed": max(gaps) if gaps else float("nan")}
    return out


def spread_table(rows: list[dict[str, Any]]) -> str:
    """:func:`spread` as lines of text."""
    return "\n".join(
        f"{name:>5}: final eval loss mean {s['mean']:.4f} (min {s['min']:.4f}, max "
        f"{s['max']:.4f}, spread {s['seed_spread']:.4f}); largest gap to fp32 at the same seed "
        f"{s['max_gap_to_fp32_same_seed']:.4f}" for name, s in spread(rows).items())


def main() -> None:
    """Run every setting and tabulate."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--settings", default="fp32,bf16,int8")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rule", default="fo")
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--seeds", default="0,1",
                        help="comma-separated; every setting runs with each (the seed spread)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "precision_quality.json"))
    parser.add_argument("--merge", action="store_true",
                        help="keep --out's rows of other (setting, seed) pairs, made with the "
                             "same settings, and tabulate them all (adding a seed later)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="precision-quality-") as tmp:
        for seed in [int(x) for x in args.seeds.split(",")]:
            for name in args.settings.split(","):
                row = run_one(name, seed, args, Path(tmp))
                rows.append(row)
                print(f"{name:>5} seed {seed}: eval loss {row['eval_loss_start']:.4f} -> "
                      f"{row['eval_loss']:.4f}"
                      f", accuracy {row['eval_accuracy_start']:.3f} -> "
                      f"{row['eval_accuracy']:.3f}, failed blocks {row['failed_blocks']}, "
                      f"{row['wall_s']:.0f} s", flush=True)
    out = Path(args.out)
    command = "python experiments/precision_quality.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "merge", "seeds", "settings"))
    meta: dict[str, Any] = {"command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "runs": [f"--seeds {args.seeds} --settings {args.settings}"]}
    if args.merge and out.exists():
        before = json.loads(out.read_text())
        if before["meta"]["command"] != command:  # other settings: not one table
            raise SystemExit(f"--merge: {out} was made by {before['meta']['command']!r}, "
                             f"not {command!r}")
        new = {(r["setting"], r["seed"]) for r in rows}
        rows = [r for r in before["rows"] if (r["setting"], r["seed"]) not in new] + rows
        meta["runs"] = before["meta"].get("runs", []) + meta["runs"]
    print(spread_table(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": spread(rows)}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
