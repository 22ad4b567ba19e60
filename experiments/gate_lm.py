"""The gate: on one node, does full fine-tuning beat LoRA at language modelling?

    python experiments/gate_lm.py --resume                 # Shakespeare, every method
    python experiments/gate_lm.py --resume --only full     # some methods
    python experiments/gate_lm.py --report-only            # rewrite table.md from results.json

Each method trains SmolLM2-135M on the same windows of the ``lm`` task's training split, on one
node holding the whole split (the payoff profiles' centralized bounds: the ServerApp's FedAvg
runner and the real ClientApp in this process, :func:`fedcybgd.harness.loopback.run_in_process`):

- ``full``: every parameter (AdamW);
- ``lora-qv``: LoRA rank 8 on ``q_proj``, ``v_proj``;
- ``lora-all``: LoRA rank 8 on every projection of attention and MLP;
- ``lora-all-r64``: the same at rank 64.

LoRA's alpha is twice its rank (16, 128). A run is 4 rounds of 30 AdamW steps of 8 windows of
128 tokens (120 steps, about 123k training tokens), its rate decayed by round on a cosine to a
tenth (``lr-schedule = "cosine"``; the optimizer state starts afresh each round, as for the
profiles' bounds).

Procedure, fixed before the runs:

1. **Rates, on the validation split.** Seed 0, each method over its bracket of rates (full
   3e-5, 1e-4, 3e-4; LoRA 3e-4, 1e-3, 3e-3); a method whose lowest validation loss sits at an
   edge of its bracket gets the next rate beyond it (x or / sqrt(10)), up to two more. The rate
   with the lowest validation loss (the first ``eval-examples`` validation windows) is chosen.
2. **Seeds.** Seeds 1 and 2 at the chosen rate (seed 0's run at it is reused). The seed changes
   the batches drawn and the LoRA initialisation.
3. **Test.** Each run's final model is scored on the first ``--test-windows`` windows of the
   test split (loss per token), and on the reference text before and after (``reference-
   dataset``, Rotten Tomatoes test reviews: the forgetting).
4. **Verdict.** Full fine-tuning wins clearly when its worst seed's test loss is below every
   LoRA method's best seed by at least 0.05 nats/token; below by less: a win inside the margin;
   otherwise no win.

Results are appended to ``experiments/results/gate-lm/results.json`` after every run; ``--resume``
skips the runs already there (with the same config); ``table.md`` is rewritten each time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from provenance import commands_line, with_command

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARGIN = 0.05  # nats/token: a clear win
SEEDS = (0, 1, 2)
ALL_PROJECTIONS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

BASE: dict[str, Any] = {
    "model": "smollm2-135m",
    "task": "lm",
    "strategy": "fedavg",
    "num-server-rounds": 4,
    "clients-per-round": 1,
    "local-steps": 30,
    "batch-size": 8,
    "max-seq-len": 128,
    "lr-schedule": "cosine",
    "partitioner": "iid",
    "eval-every": 0,  # before and after training only
    "eval-split": "validation",
    "eval-examples": 128,
    "eval-batch-size": 16,
    "reference-dataset": "rotten-tomatoes",
}
METHODS: dict[str, dict[str, Any]] = {
    "full": {"fedavg-params": "full"},
    "lora-qv": {"fedavg-params": "lora", "lora-rank": 8, "lora-alpha": 16,
                "lora-target-modules": "q_proj,v_proj"},
    "lora-all": {"fedavg-params": "lora", "lora-rank": 8, "lora-alpha": 16,
                 "lora-target-modules": ALL_PROJECTIONS},
    "lora-all-r64": {"fedavg-params": "lora", "lora-rank": 64, "lora-alpha": 128,
                     "lora-target-modules": ALL_PROJECTIONS},
}
BRACKETS: dict[str, list[float]] = {
    "full": [3e-5, 1e-4, 3e-4],
    "lora-qv": [3e-4, 1e-3, 3e-3],
    "lora-all": [3e-4, 1e-3, 3e-3],
    "lora-all-r64": [3e-4, 1e-3, 3e-3],
}
EXTENSIONS = 2  # rates added beyond an edge of a bracket, at most
CORPORA: dict[str, dict[str, Any]] = {"shakespeare": {"dataset": "shakespeare"},
                                     "ukrainian-exams": {"dataset": "ukrainian-exams"}}


def run_id(corpus: str, method: str, lr: float, seed: int) -> str:
    """``corpus/method@lr<rate>@seed<n>``."""
    return f"{corpus}/{method}@lr{lr:g}@seed{seed}"


def config_of(corpus: str, method: str, lr: float, seed: int) -> dict[str, Any]:
    """The run config of one run."""
    return {**BASE, **CORPORA[corpus], **METHODS[method], "lr": lr, "seed": seed}


def tokens_seen() -> int:
    """Training windows' tokens of a run at most (steps x batch x window)."""
    return (BASE["num-server-rounds"] * BASE["local-steps"] * BASE["batch-size"]
            * BASE["max-seq-len"])


def test_scores(config: dict[str, Any], final: Path, windows: int) -> dict[str, float]:
    """Loss per token, perplexity and next-token accuracy of the model in ``final`` on the
    first ``windows`` test windows (no reference text: the run's own evaluations have it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fedcybgd.config import RunConfig
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_tokenizer
    from fedcybgd.tasks.build import build_task

    run = RunConfig.from_run_config({**config, "reference-dataset": "", "eval-split": "test",
                                     "eval-examples": windows})
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    model.eval()
    task = build_task(run)
    frame = task.eval_frame("test", windows)
    result = task.evaluate(LayerStack(model), load_tokenizer(run.model), frame,
                           run.eval_batch_size, run.max_seq_len)
    return {"test_loss": result.loss, "test_perplexity": result.metrics["perplexity"],
            "test_accuracy": result.accuracy, "test_tokens": result.metrics["tokens"],
            "test_windows": result.examples}


def run_one(corpus: str, method: str, lr: float, seed: int, work: Path,
            test_windows: int) -> dict[str, Any]:
    """One centralized run and its test scores."""
    from fedcybgd.harness.loopback import run_in_process

    config = config_of(corpus, method, lr, seed)
    out = work / run_id(corpus, method, lr, seed).replace("/", "_")
    started = time.perf_counter()
    summary, records = run_in_process(config, 1, out)
    trained_s = time.perf_counter() - started
    first, last = records[0], records[-1]
    scores = test_scores(config, out / "run" / "final", test_windows)
    shutil.rmtree(out, ignore_errors=True)  # weights and caches: GBs, not results
    return {
        "corpus": corpus, "method": method, "lr": lr, "seed": seed, "config": config,
        "validation_loss_before": first["eval_loss"], "validation_loss": last["eval_loss"],
        "validation_windows": last.get("eval_examples"),
        "reference_loss_before": first.get("eval_reference_loss"),
        "reference_loss_after": last.get("eval_reference_loss"),
        **scores,
        "train_loss_by_round": [r.get("train_loss") for r in records if r["round"] > 0],
        "client_peak_mem_mb": summary.get("client_peak_mem_mb"),
        "train_s": sum(float(r.get("client_train_s") or 0.0) for r in records),
        "wall_s": time.perf_counter() - started, "run_s": trained_s,
    }


def chosen_rate(results: dict[str, Any], corpus: str, method: str) -> tuple[float | None,
                                                                           list[float]]:
    """The rate with the lowest seed-0 validation loss among those run, and the rates still to
    run at seed 0 (the bracket, then one beyond an edge that holds the lowest)."""
    rates = list(BRACKETS[method])
    for _ in range(EXTENSIONS + 1):
        done = {lr: results[run_id(corpus, method, lr, 0)]["validation_loss"]
                for lr in rates if run_id(corpus, method, lr, 0) in results}
        # the bracket's middle rate first, then its edges: the earliest runs tell the most
        middle = sorted(BRACKETS[method])[len(BRACKETS[method]) // 2]
        missing = sorted((lr for lr in rates if lr not in done),
                         key=lambda lr: abs(math.log(lr / middle)))
        if missing:
            return None, missing
        best = min(done, key=lambda lr: done[lr])
        ordered = sorted(rates)
        if len(rates) - len(BRACKETS[method]) >= EXTENSIONS:
            return best, []
        if best == ordered[0]:
            rates.append(float(f"{ordered[0] / math.sqrt(10):.2g}"))
        elif best == ordered[-1]:
            rates.append(float(f"{ordered[-1] * math.sqrt(10):.2g}"))
        else:
            return best, []
    return best, []


def verdict(results: dict[str, Any], corpus: str) -> list[str]:
    """The gate's answer for one corpus, with its numbers (nothing until every seed ran)."""
    per: dict[str, list[float]] = {}
    for method in METHODS:
        best, todo = chosen_rate(results, corpus, method)
        if best is None or todo:
            return []
        runs = [results.get(run_id(corpus, method, best, s)) for s in SEEDS]
        if any(r is None for r in runs):
            return []
        per[method] = [float(r["test_loss"]) for r in runs if r is not None]
    worst_full = max(per["full"])
    lines = []
    clear = True
    for method in METHODS:
        if method == "full":
            continue
        margin = min(per[method]) - worst_full
        word = ("clear win" if margin >= MARGIN else "win inside the margin" if margin > 0
                else "no win")
        clear &= margin >= MARGIN
        lines.append(f"- full's worst seed {worst_full:.4f} vs {method}'s best seed "
                     f"{min(per[method]):.4f}: {margin:+.4f} nats/token ({word})")
    spread = {m: max(v) - min(v) for m, v in per.items()}
    lines.append("- seed spread (max - min test loss): " + ", ".join(
        f"{m} {s:.4f}" for m, s in spread.items()))
    lines.insert(0, f"**Verdict ({corpus}): " + (
        "full fine-tuning beats every LoRA clearly" if clear else
        "full fine-tuning does not beat every LoRA by the margin") + "**")
    return lines


def table(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The Markdown report."""
    lines = ["# The gate: full fine-tuning against LoRA at language modelling, one node", "",
             commands_line(meta), "",
             f"Machine: {meta.get('machine', '?')}. Model: {BASE['model']}. Each run: "
             f"{BASE['num-server-rounds']} rounds x {BASE['local-steps']} steps x batch "
             f"{BASE['batch-size']} x {BASE['max-seq-len']} tokens (at most {tokens_seen():,} "
             "training tokens), cosine by round to a tenth of the rate. Validation: the first "
             f"{BASE['eval-examples']} validation windows (rates chosen on it, seed 0); test: "
             f"the first {meta.get('test_windows', '?')} test windows; reference: the first "
             f"{BASE['eval-examples']} windows of {BASE['reference-dataset']}'s test reviews "
             "(before -> after: the forgetting). Losses in nats per token. Win criterion, fixed "
             f"before the runs: full's worst seed beats each LoRA's best seed on test loss by "
             f">= {MARGIN} nats/token.", ""]
    for corpus in CORPORA:
        mine = {k: v for k, v in results.items() if v["corpus"] == corpus}
        if not mine:
            continue
        lines += [f"## {corpus}", "", "### Rates (seed 0, validation loss)", "",
                  "| method | rate | validation loss | test loss | reference before -> after | "
                  "min |", "|---|---|---|---|---|---|"]
        for method in METHODS:
            best, _ = chosen_rate(results, corpus, method)
            for r in sorted((v for v in mine.values() if v["method"] == method
                             and v["seed"] == 0), key=lambda v: v["lr"]):
                mark = " (chosen)" if best is not None and r["lr"] == best else ""
                lines.append(
                    f"| {method} | {r['lr']:g}{mark} | {r['validation_loss']:.4f} | "
                    f"{r['test_loss']:.4f} | {_ref(r)} | {r['wall_s'] / 60:.1f} |")
        lines += ["", "### Seeds at the chosen rate (test)", "",
                  "| method | rate | test loss by seed | mean | spread | perplexity (mean) | "
                  "next-token acc (mean) | reference before -> after (mean) |",
                  "|---|---|---|---|---|---|---|---|"]
        for method in METHODS:
            best, _ = chosen_rate(results, corpus, method)
            if best is None:
                continue
            runs = [mine[i] for s in SEEDS if (i := run_id(corpus, method, best, s)) in mine]
            if not runs:
                continue
            losses = [r["test_loss"] for r in runs]
            before = statistics.mean(r["reference_loss_before"] for r in runs)
            after = statistics.mean(r["reference_loss_after"] for r in runs)
            lines.append(
                f"| {method} | {best:g} | {', '.join(f'{x:.4f}' for x in losses)} "
                f"({len(runs)} of {len(SEEDS)}) | {statistics.mean(losses):.4f} | "
                f"{max(losses) - min(losses):.4f} | "
                f"{statistics.mean(r['test_perplexity'] for r in runs):.2f} | "
                f"{statistics.mean(r['test_accuracy'] for r in runs):.4f} | "
                f"{before:.4f} -> {after:.4f} ({after - before:+.4f}) |")
        lines += [""]
        found = verdict(results, corpus)
        lines += found if found else ["Verdict: not yet (runs missing)."]
        lines += ["", f"{len(mine)} runs so far.", ""]
    return "\n".join(lines) + "\n"


def _ref(r: dict[str, Any]) -> str:
    if r.get("reference_loss_before") is None:
        return "-"
    return f"{r['reference_loss_before']:.4f} -> {r['reference_loss_after']:.4f}"


def save(path: Path, results: dict[str, Any], meta: dict[str, Any]) -> None:
    """``results.json`` and ``table.md`` (written, then printed by the caller)."""
    path.mkdir(parents=True, exist_ok=True)
    body = {"meta": meta, "runs": results}
    tmp = path / "results.json.tmp"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    tmp.replace(path / "results.json")
    (path / "table.md").write_text(table(results, meta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="shakespeare", choices=sorted(CORPORA))
    parser.add_argument("--only", default="", help="comma-separated methods")
    parser.add_argument("--resume", action="store_true", help="skip runs already saved")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--test-windows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "gate-lm")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "gate-lm")
    args = parser.parse_args()
    methods = [m for m in args.only.split(",") if m] or list(METHODS)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--only: unknown methods {unknown}; known: {list(METHODS)}")
    path = args.results / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {"meta": {}, "runs": {}}
    results: dict[str, Any] = saved["runs"]
    command = "python experiments/gate_lm.py " + " ".join(sys.argv[1:])
    meta = {**saved["meta"], "commands": with_command(saved["meta"], command.strip()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                       f"{platform.python_version()}",
            "test_windows": args.test_windows, "tokens_per_run": tokens_seen()}
    if args.report_only:
        save(args.results, results, meta)
        print(table(results, meta))
        return
    import torch

    torch.set_num_threads(args.threads)

    def current(key: str, run: dict[str, Any]) -> bool:
        # a saved run counts when it was made with this script's config and test windows
        return (run["config"] == config_of(run["corpus"], run["method"], run["lr"], run["seed"])
                and run.get("test_windows") == args.test_windows)

    mine = {k: v for k, v in results.items()
            if v["corpus"] == args.corpus and v["method"] in methods}
    for key, run in mine.items():
        if not args.resume or not current(key, run):
            del results[key]  # run again

    def one(method: str, lr: float, seed: int) -> None:
        key = run_id(args.corpus, method, lr, seed)
        print(f"== {key}", flush=True)
        result = run_one(args.corpus, method, lr, seed, args.work, args.test_windows)
        results[key] = result
        save(args.results, results, meta)
        print(f"== {key}: validation {result['validation_loss']:.4f}, test "
              f"{result['test_loss']:.4f}, reference {result['reference_loss_before']:.4f} -> "
              f"{result['reference_loss_after']:.4f}, {result['wall_s'] / 60:.1f} min",
              flush=True)

    # 1. rates at seed 0, round-robin over the methods so each bracket fills evenly
    pending = True
    while pending:
        pending = False
        for method in methods:
            _, todo = chosen_rate(results, args.corpus, method)
            if todo:
                pending = True
                one(method, todo[0], 0)
    # 2. seeds at the chosen rates
    for seed in SEEDS[1:]:
        for method in methods:
            best, todo = chosen_rate(results, args.corpus, method)
            assert best is not None and not todo
            if run_id(args.corpus, method, best, seed) not in results:
                one(method, best, seed)
    save(args.results, results, meta)
    print(table(results, meta))


if __name__ == "__main__":
    main()
