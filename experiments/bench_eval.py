"""The ``sft`` evaluation's cost: one prompt pass for the loss and the answer, against two.

Evaluating an instruction task scores the reference response (response loss) and decodes an
answer greedily (exact match, token F1). Run apart, each costs a forward over every prompt;
:func:`fedcybgd.tasks.sft.score_and_generate` runs the prompts once with the KV cache and does
both from it; and it batches the prompts by length, so a batch is padded to about its own
prompts' length instead of the longest of rows that happen to sit together. This script
evaluates the same held-out questions three ways, side by side in one process (the order rotates
per batch): two passes in file order, one pass in file order, one pass in batches by length; it
prints the seconds each takes, the padded prompt tokens, and how far their figures differ.

    python experiments/bench_eval.py                        # SmolLM2-135M, ToMi test, 256 rows
    python experiments/bench_eval.py --rows 600 --batch 32 --threads 2

Results: printed, and saved to ``experiments/results/bench_eval.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default="tomi")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=160)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_eval.json")
    args = parser.parse_args()

    import torch

    from fedcybgd.config import RunConfig
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model, load_tokenizer
    from fedcybgd.tasks.build import build_task
    from fedcybgd.tasks.sft import SFTTask, normalize_answer, score_and_generate

    torch.set_num_threads(args.threads)
    run = RunConfig.from_run_config({"model": args.model, "dataset": args.dataset,
                                     "max-new-tokens": args.max_new_tokens})
    task = build_task(run)
    if not isinstance(task, SFTTask):
        raise SystemExit(f"--dataset {args.dataset}: an sft task is needed, got {task.name}")
    tokenizer = load_tokenizer(args.model)
    stack = LayerStack(load_model(args.model))
    items = task.examples(task.split("test").head(args.rows))
    encode = task.encoder(tokenizer, args.max_seq_len)
    joined = encode.joined(items)
    n = len(items)
    # each way's batches: rows in file order, or sorted by prompt length (as the task does)
    in_order = list(range(n))
    by_length = sorted(in_order, key=lambda i: joined[i].positions[0])
    ways = {"two passes": in_order, "one pass": in_order, "one pass, by length": by_length}

    seconds = dict.fromkeys(ways, 0.0)
    nll = dict.fromkeys(ways, 0.0)
    padded = dict.fromkeys(ways, 0)
    answers: dict[str, list[str]] = {way: [""] * n for way in ways}
    tokens = 0.0
    starts = list(range(0, n, args.batch))
    for number, start in enumerate(starts):
        names = list(ways)
        names = names[number % len(names):] + names[:number % len(names)]  # rotate the order
        for way in names:
            rows = ways[way][start:start + args.batch]
            part = [joined[i] for i in rows]
            padded[way] += len(rows) * max(j.positions[0] + 1 for j in part)
            began = time.perf_counter()
            if way == "two passes":
                total, count, texts = task.score_and_generate_apart(stack, tokenizer, encode, part)
            else:
                scored = score_and_generate(stack, tokenizer, part, args.max_new_tokens)
                if scored is None:
                    raise SystemExit(f"{args.model} keeps no KV cache: nothing to compare")
                total, count, texts = scored
            seconds[way] += time.perf_counter() - began
            nll[way] += float(total.sum())
            if way == "two passes":
                tokens += float(count.sum())
            for i, text in zip(rows, texts, strict=True):
                answers[way][i] = text
    references = [normalize_answer(m[-1]["content"]) for m in items]
    base = answers["two passes"]
    out: dict[str, Any] = {
        "model": args.model, "dataset": args.dataset, "rows": n, "batch": args.batch,
        "max_seq_len": args.max_seq_len, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "prompt_tokens": sum(j.positions[0] + 1 for j in joined),
        "padded_prompt_tokens": padded, "seconds": seconds,
        "speedup": {way: seconds["two passes"] / seconds[way] for way in ways},
        "response_loss": {way: v / tokens for way, v in nll.items()},
        "exact_match": {way: sum(normalize_answer(t) == r for t, r in zip(a, references,
                                                                           strict=True)) / n
                        for way, a in answers.items()},
        "same_answers_as_two_passes": {way: sum(x == y for x, y in zip(a, base, strict=True)) / n
                                       for way, a in answers.items()},
    }
    print(f"{n} rows of {args.dataset}, batch {args.batch}, {args.threads} threads, "
          f"{out['prompt_tokens']} prompt tokens:")
    for way in ways:
        print(f"  {way:20s} {seconds[way]:7.1f} s ({out['speedup'][way]:.2f}x)  padded prompt "
              f"tokens {padded[way]}  response loss {out['response_loss'][way]:.6f}  exact "
              f"match {out['exact_match'][way]:.3f}  the same answer as two passes on "
              f"{out['same_answers_as_two_passes'][way]:.1%} of rows")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
