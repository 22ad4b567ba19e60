"""Step time and peak memory of the local update rules, side by side, on one batch.

Every configuration runs in a fresh subprocess (the allocator never gives memory back, so a
shared process would hide later peaks); each loads the model, takes one warm-up step and then
times ``--steps`` steps on the same batches. Reported per configuration: seconds per step, peak
RSS and peak RSS above the loaded model's RSS. ``full`` is whole-model AdamW fine-tuning and
``inference`` a no-grad forward: the two reference points.

    python experiments/bench_updates.py                      # all rules, SmolLM2, batch 16x32
    python experiments/bench_updates.py --rules fo,full --blocks bottom,top
    python experiments/bench_updates.py --variants precision --blocks bottom,top
    python experiments/bench_updates.py --task sft --seq 128   # loss on response tokens
    python experiments/bench_updates.py --task classification,sft --variants fo,lezo-0.25 \
        --blocks top --batch 8 --seq 128        # side by side: bench_updates_tasks.json
    python experiments/bench_updates.py --variants fo@top,fo/recompute@bottom --jobs 2

Each row also reports the runtime's own RSS (after imports, tokenizer and data, before the
model), the peak above it, and the memory model's estimate
(:func:`fedcybgd.memory.estimate.estimate_peak_mb`) with its error against the measured peak.

``--task sft`` turns each review into an instruction example whose response is the review
itself (``Repeat this review: ...`` -> the review), so about half of each sequence is scored:
the LM head then runs on every response token, the classification one on one token per row.

Results: printed, and saved to ``experiments/results/bench_updates.json`` (a ``--variants``
set such as ``precision``: ``bench_updates_<set>.json``; ``--out`` chooses).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
# name -> (update rule, rule options); a "/bf16" or "/int8" suffix: the blocks not trained are
# held as frozen-dtype bfloat16 (and frozen-quant int8), as a client with those keys holds them
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "inference": ("inference", {}),
    "full": ("full", {}),
    "fo": ("fo", {}),
    "zerolock": ("zerolock", {}),
    "zerolock-tuned": ("zerolock", {"zerolock-head": "tuned"}),
    # a fit in every measured step (refit 0), on the step's one batch: a round's worst case
    "zerolock-calibrated": ("zerolock", {"zerolock-head": "calibrated",
                                         "zerolock-calib-refit": 0.0,
                                         "zerolock-calib-batches": 1}),
    "zerolock-calibrated-aux4": ("zerolock", {"zerolock-head": "calibrated",
                                              "zerolock-aux-layers": 4,
                                              "zerolock-calib-refit": 0.0,
                                              "zerolock-calib-batches": 1}),
    "zerolock-calibrated-aux8": ("zerolock", {"zerolock-head": "calibrated",
                                              "zerolock-aux-layers": 8,
                                              "zerolock-calib-refit": 0.0,
                                              "zerolock-calib-batches": 1}),
    "mezo": ("mezo", {}),
    "lezo-0.25": ("lezo", {"lezo-density": 0.25}),
    "lezo-0.5": ("lezo", {"lezo-density": 0.5}),
    "fo/recompute": ("fo", {"fo-recompute": True}),
    "fo/bf16": ("fo", {}),
    "fo/int8": ("fo", {}),
    "fo/recompute/bf16": ("fo", {"fo-recompute": True}),
    "lezo-0.25/bf16": ("lezo", {"lezo-density": 0.25}),
    "lezo-0.25/int8": ("lezo", {"lezo-density": 0.25}),
    "inference/int8": ("inference", {}),
    # without the step cache: z drawn three times a step, the exact restore saved sparsely
    "mezo/lean": ("mezo", {"zo-step-cache-mb": 0.0}),
    # a step cache large enough for the whole SmolLM2 (z and start: 8 bytes a perturbed element)
    "mezo/cache": ("mezo", {"zo-step-cache-mb": 1024.0}),
    "lezo-0.25/cache": ("lezo", {"lezo-density": 0.25, "zo-step-cache-mb": 256.0}),
    "lezo-0.25/lean": ("lezo", {"lezo-density": 0.25, "zo-step-cache-mb": 0.0}),
}
# --variants names one of these for a whole set: fp32 vs bf16 vs int8 frozen, recompute or not
VARIANT_SETS = {
    "precision": "inference,inference/int8,lezo-0.25,lezo-0.25/bf16,lezo-0.25/int8,fo,"
                 "fo/bf16,fo/int8,fo/recompute,fo/recompute/bf16",
    # the zeroth-order step against its floor (two forwards), with and without the step cache
    "zo-floor": "inference,mezo,mezo/cache,lezo-0.25,lezo-0.25/cache",
}
# Where a zeroth-order step's time goes (TrainOutcome metrics, seconds a step): the frozen
# prefix, the two forwards, drawing z once (the step cache), the perturb/restore/update passes,
# and the round's bookkeeping (the block's checksums before and after, the log's encoding: once
# a round, shared by `--round-steps` steps; at the default of one step a round, once a step).
ZO_PROFILE = ("prefix_s", "zo_forward_s", "z_s", "perturb_s", "seedlog_s")
PRECISIONS = {"bf16": ("bfloat16", "none"), "int8": ("bfloat16", "int8")}


def precision_of(variant: str) -> tuple[str, str]:
    """``(frozen-dtype, frozen-quant)`` of a variant name."""
    suffix = variant.rsplit("/", 1)[-1]
    return PRECISIONS.get(suffix, ("float32", "none"))


def pick_block(names: list[str], where: str) -> str:
    """bottom / middle / top decoder-layer block, or the whole stack."""
    layers = [n for n in names if n.startswith("layer.")]
    if where == "bottom":
        return layers[0]
    if where == "middle":
        return layers[len(layers) // 2]
    if where == "lower-top":  # the top block of the lower half
        return layers[len(layers) // 2 - 1]
    if where == "top":
        return layers[-1]
    raise ValueError(f"unknown block position {where!r}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process (called in a subprocess by :func:`main`)."""
    import pandas as pd
    import torch

    from fedcybgd.client.updates import TrainTask, get_rule
    from fedcybgd.core.measure import PeakMemory, release_freed, rss_bytes
    from fedcybgd.memory.estimate import ModelShape, estimate_peak_mb
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model, load_tokenizer, resolve
    from fedcybgd.model.precision import FrozenBlocks, Precision
    from fedcybgd.tasks import shares
    from fedcybgd.tasks.objective import batch_loss, scored_logits

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rule_name, options = VARIANTS[args.variant]
    if rule_name in ("lezo", "mezo"):
        from fedcybgd.rules.builtin import LezoOptions

        # a row says which restore path it measured (rows without the key predate the cache)
        options = {"zo-step-cache-mb": LezoOptions().step_cache_mb, **options}
    precision = Precision(*precision_of(args.variant))
    tokenizer = load_tokenizer(args.model)
    frame = shares.load_split("rotten-tomatoes", "train")
    task = None
    if args.task == "sft":
        from fedcybgd.config import RunConfig
        from fedcybgd.tasks.build import build_task

        task = build_task(RunConfig(task="sft", partitioner="iid"))
        frame = task.check(pd.DataFrame({
            "prompt": [f"Repeat this review: {t}" for t in frame["text"]],
            "response": frame["text"]}))
    batches = list(
        __import__("itertools").islice(
            shares.batches(frame, tokenizer, args.batch, args.seq, seed=0, task=task),
            (args.steps + 1) * args.round_steps,
        )
    )
    # The modeling code transformers imports lazily is runtime too, not the model's memory.
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(resolve(args.model)))]
    runtime_mb = rss_bytes() / 2**20  # python, torch, transformers, tokenizer, data
    model = load_model(args.model)
    for p in model.parameters():
        p.requires_grad_(False)
    stack = LayerStack(model)
    whole = args.where == "whole"
    blocks = BlockMap(model, stack.num_layers if whole else args.layers_per_block)
    block = pick_block(blocks.names, "bottom" if whole else args.where)
    # Weights load memory-mapped: page every tensor in, as a client holding the model has, so
    # a rule that never touches the upper layers is not credited with memory it would use.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)
    shape = ModelShape.of(model, blocks)
    if not precision.full:
        # What a client with frozen-dtype/frozen-quant holds: every block but the trained one
        # frozen, built from the exact fp32 weights; the trained one rebuilt as fresh fp32 (as
        # ClientModel.train_block does), so no tensor keeps the loader's fp32 buffer alive.
        frozen = FrozenBlocks(model, blocks, precision)
        # The trained block's fp32 copy is taken only when it is thawed, and dropped after:
        # held for the whole row it counted as model memory (407 MB for the 30-layer block of
        # the inference rows).
        exact_block = blocks.get(model, block) if rule_name != "inference" else None
        for name in blocks.names:
            frozen.freeze(name, blocks.get(model, name))
        if exact_block is not None:
            frozen.thaw(block, exact_block)
        del exact_block
        __import__("gc").collect()
        release_freed()
    loaded_mb = rss_bytes() / 2**20
    # The estimate at the batches' own scored positions (how good the memory model is), and at
    # the task's bound (what a budget check uses: every position of an sft row may be scored).
    scored = max(b.num_scored for b in batches[args.round_steps:])  # the peak: the largest
    bound = (task or shares.default_task()).max_scored_tokens(args.batch, args.seq)
    estimate, estimate_bound = (
        (estimate_peak_mb(shape, blocks, rule_name, block, args.batch, args.seq,
                          precision=precision, options=options, scored_tokens=n)
         for n in (scored, bound))
        if rule_name != "full" else (float("nan"), float("nan"))
    )

    profile: dict[str, float] = {}

    def round_fn(index: int) -> None:
        """Round ``index``: ``--round-steps`` steps, in one call of the rule as a node makes
        (its once-a-round work, such as the block's checksums, shared by the round's steps)."""
        first = index * args.round_steps
        if rule_name in ("inference", "full"):
            for i in range(first, first + args.round_steps):
                step_fn(i)
            return
        task = TrainTask(model=model, stack=stack, blocks=blocks, block=block,
                         batches=iter(batches[first:first + args.round_steps]),
                         steps=args.round_steps, lr=1e-6, weight_decay=0.0,
                         seed=index, options=dict(options),
                         state_dir=Path(args.state_dir) if args.state_dir else None)
        rule = get_rule(rule_name)
        rule.train(task)
        times = getattr(rule, "last_times", {})  # a zeroth-order rule's split of the round
        if index > 0:  # the warm-up round is not profiled
            for key in ZO_PROFILE:
                if key in times:
                    profile[key] = profile.get(key, 0.0) + times[key] / timed_steps

    def step_fn(batch_index: int) -> None:
        batch = batches[batch_index]
        if rule_name == "inference":
            with torch.no_grad():
                hidden = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0,
                                   stack.num_layers)
                scored_logits(stack, hidden.states, batch)
            return
        if rule_name == "full":
            for p in model.parameters():
                p.requires_grad_(True)
            hidden = stack.run(stack.embed(batch.input_ids, batch.attention_mask), 0,
                               stack.num_layers)
            batch_loss(scored_logits(stack, hidden.states, batch), batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-6) if rule_name == "full" else None
    )
    timed_steps = args.steps * args.round_steps
    round_fn(0)  # warm-up: allocator, optimizer state, lazy inits
    with PeakMemory() as mem:
        started = time.perf_counter()
        for i in range(1, args.steps + 1):
            round_fn(i)
        elapsed = time.perf_counter() - started
    return {
        "variant": args.variant,
        "rule": rule_name,
        "block": "all layers" if whole else block,
        "where": args.where,
        "step_s": elapsed / timed_steps,
        "round_steps": args.round_steps,
        "peak_rss_mb": mem.peak_mb,
        "loaded_rss_mb": loaded_mb,
        "peak_above_loaded_mb": mem.peak_mb - loaded_mb,
        "runtime_rss_mb": runtime_mb,
        "peak_above_runtime_mb": mem.peak_mb - runtime_mb,
        "frozen": precision.describe(),
        "options": options,
        "estimate_mb": estimate,
        "estimate_error": estimate / mem.peak_mb - 1,
        "estimate_at_task_bound_mb": estimate_bound,
        "scored_tokens_max": scored,
        "scored_tokens_bound": bound,
        "batch": args.batch,
        "seq": args.seq,
        "tokens": int(sum(int(b.attention_mask.sum())
                          for b in batches[args.round_steps:]) / timed_steps),
        "task": args.task,
        "scored_tokens": int(sum(b.num_scored for b in batches[args.round_steps:]) / timed_steps),
        "profile_s": profile,
    }


def main() -> None:
    """Run every requested configuration in its own process and tabulate."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", "--rules", default=",".join(VARIANTS))
    parser.add_argument("--blocks", default="bottom,middle,top,whole",
                        help="bottom,lower-top,middle,top (one block each; lower-top: the "
                             "lower half's top block) and/or whole (all layers)")
    parser.add_argument("--layers-per-block", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (after a warm-up one)")
    parser.add_argument("--round-steps", type=int, default=1,
                        help="steps a round, in one call of the rule (the app's local-steps is "
                             "5): its once-a-round work is shared by them; s/step = a timed "
                             "round's time / round-steps")
    parser.add_argument("--task", default="classification",
                        help="the loss: classification (one label token per row), sft (every "
                             "response token), or both, comma-separated: each configuration "
                             "then runs for each task in turn (side by side, same batch/seq)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier timings on a shared machine)")
    parser.add_argument("--out", default="",
                        help="default: results/bench_updates.json, or bench_updates_<set>.json "
                             "for a --variants set, so a set never overwrites the main rows")
    parser.add_argument("--jobs", type=int, default=1,
                        help="configurations measured at once (each in its own process, so "
                             "its peak RSS is its own; step times then compete for CPUs)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        print(json.dumps(measure(args)))
        return

    from fedcybgd.client.updates import available_rules

    rules = set(available_rules()) | {"inference", "full"}
    tasks = args.task.split(",")
    if not tasks or set(tasks) - {"classification", "sft"}:
        raise SystemExit(f"--task: classification and/or sft, got {args.task!r}")
    commands: list[tuple[str, str, list[str]]] = []
    for item in VARIANT_SETS.get(args.variants, args.variants).split(","):
        variant, _, only = item.partition("@")  # "fo/recompute@bottom": that block only
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; known: {list(VARIANTS)}")
        if VARIANTS[variant][0] not in rules:
            print(f"skip {variant}: rule {VARIANTS[variant][0]!r} is not available")
            continue
        wheres = [only] if only else args.blocks.split(",")
        if VARIANTS[variant][0] in ("inference", "full"):
            wheres = ["whole"]
        for where in wheres:
            for task in tasks:
                commands.append((variant, where, [
                    sys.executable, __file__, "--one", "--variant", variant, "--where", where,
                    "--model", args.model, "--layers-per-block", str(args.layers_per_block),
                    "--batch", str(args.batch), "--seq", str(args.seq),
                    "--steps", str(args.steps), "--round-steps", str(args.round_steps),
                    "--threads", str(args.threads), "--task", task,
                    "--state-dir", str(RESULTS / ".state" / f"{variant}-{where}-{task}"),
                ]))
    rows: list[dict[str, Any]] = []

    def run_one(job: tuple[str, str, list[str]]) -> dict[str, Any] | None:
        variant, where, command = job
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"FAILED {variant}/{where}:\n{done.stderr[-2000:]}", flush=True)
            return None
        row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{variant:>18} {row['block']:>12} {row['task']:>14} "
              f"{row['tokens']:5d}/{row['scored_tokens']:4d} tok/scored  "
              f"{row['step_s']:7.3f} s/step  "
              f"peak {row['peak_rss_mb']:7.0f} MB  "
              f"above model {row['peak_above_loaded_mb']:7.0f} MB  "
              f"above runtime ({row['runtime_rss_mb']:4.0f}) "
              f"{row['peak_above_runtime_mb']:6.0f} MB  "
              f"estimate {row['estimate_mb']:6.0f} MB ({row['estimate_error']:+.0%})"
              + "".join(f"  {k} {v:.3f}" for k, v in row.get("profile_s", {}).items()),
              flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = [row for row in pool.map(run_one, commands) if row is not None]
    if not args.out:
        name = (f"bench_updates_{args.variants}.json" if args.variants in VARIANT_SETS
                else "bench_updates_tasks.json" if len(tasks) > 1 else "bench_updates.json")
        args.out = str(RESULTS / name)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "threads": args.threads,
        "jobs": args.jobs,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    floor = zo_floor_table(rows)
    if floor:
        out.with_suffix(".md").write_text(floor)
        print(floor)
    print(f"saved {out}")


def zo_floor_table(rows: list[dict[str, Any]]) -> str:
    """Each zeroth-order row's step against its floor, two forwards of the ``inference`` row of
    the same block and task, with its profile; empty without such pairs."""
    forward = {(r["where"], r["task"]): r["step_s"] for r in rows if r["variant"] == "inference"}
    zo = [r for r in rows if r["rule"] in ("lezo", "mezo") and (r["where"], r["task"]) in forward]
    if not zo:
        return ""
    lines = ["| variant | where | step cache MB | s/step | vs 2 forwards | without the round's "
             "bookkeeping | " + " | ".join(ZO_PROFILE) + " |", "|---" * (6 + len(ZO_PROFILE)) + "|"]
    for r in zo:
        two = 2 * forward[(r["where"], r["task"])]
        profile = r.get("profile_s", {})
        lines.append(f"| {r['variant']} | {r['where']} | "
                     f"{r['options'].get('zo-step-cache-mb', '-')} | {r['step_s']:.3f} | "
                     f"{r['step_s'] / two:.2f}x | "
                     f"{(r['step_s'] - profile.get('seedlog_s', 0.0)) / two:.2f}x | "
                     + " | ".join(f"{profile.get(k, float('nan')):.3f}" for k in ZO_PROFILE)
                     + " |")
    by_variant = {(r["variant"], r["where"]): r["step_s"] for r in zo}
    for (variant, where), step in by_variant.items():
        if variant == "mezo" and ("lezo-0.25", where) in by_variant:
            lines.append(f"\nMeZO / LeZO-0.25 ({where}): "
                         f"{step / by_variant[('lezo-0.25', where)]:.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
