"""The ``sft`` evaluation's cost: one prompt pass for the loss and the answer, against two.

Evaluating an instruction task scores the reference response (response loss) and decodes an
answer greedily (exact match, token F1). Run apart, each costs a forward over every prompt;
:func:`fedcybgd.tasks.sft.score_and_generate` runs the prompts once with the KV cache and does
both from it. This script evaluates the same held-out questions both ways, side by side in one
process (the order alternates per batch), and prints the seconds each takes and how far their
figures differ.

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
    from fedcybgd.tasks.base import build_task
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

    seconds = {"one pass": 0.0, "two passes": 0.0}
    nll = {"one pass": 0.0, "two passes": 0.0}
    tokens = 0.0
    exact = {"one pass": 0, "two passes": 0}
    same_answer = 0
    for number, start in enumerate(range(0, len(items), args.batch)):
        part = items[start:start + args.batch]
        answers: dict[str, list[str]] = {}
        order = ["one pass", "two passes"] if number % 2 == 0 else ["two passes", "one pass"]
        for way in order:
            began = time.perf_counter()
            if way == "one pass":
                scored = score_and_generate(stack, tokenizer, encode.joined(part),
                                            args.max_new_tokens)
                if scored is None:
                    raise SystemExit(f"{args.model} keeps no KV cache: nothing to compare")
                total, count, texts = scored
            else:
                total, count, texts = task.score_and_generate_apart(
                    stack, tokenizer, encode, part, args.max_seq_len)
            seconds[way] += time.perf_counter() - began
            nll[way] += float(total.sum())
            answers[way] = texts
            exact[way] += sum(normalize_answer(t) == normalize_answer(m[-1]["content"])
                              for t, m in zip(texts, part, strict=True))
        tokens += float(count.sum())
        same_answer += sum(a == b for a, b in zip(answers["one pass"], answers["two passes"],
                                                  strict=True))
    n = len(items)
    out: dict[str, Any] = {
        "model": args.model, "dataset": args.dataset, "rows": n, "batch": args.batch,
        "max_seq_len": args.max_seq_len, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "seconds": seconds, "speedup": seconds["two passes"] / seconds["one pass"],
        "response_loss": {k: v / tokens for k, v in nll.items()},
        "exact_match": {k: v / n for k, v in exact.items()},
        "same_answers": same_answer / n,
    }
    print(f"{n} rows of {args.dataset}, batch {args.batch}, {args.threads} threads:")
    for way in ("two passes", "one pass"):
        print(f"  {way:10s} {seconds[way]:7.1f} s  response loss "
              f"{out['response_loss'][way]:.6f}  exact match {out['exact_match'][way]:.3f}")
    print(f"  one pass is {out['speedup']:.2f}x faster; the same answer on "
          f"{out['same_answers']:.1%} of rows")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
