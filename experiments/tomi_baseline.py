"""SmolLM2-135M-Instruct on the built-in ``tomi`` task (sft): zero-shot, then a short
centralized first-order fine-tune, both scored on the same test rows.

The fine-tune is the ``fo`` update rule (backprop, AdamW on the block only) on the top block
(by default the top 6 decoder layers, ``--layers-per-block 6``; 30: every decoder layer), fed
with training batches of the task, as a client would be, only without federation. It tells the
payoff experiments how far learning can move this task. Scored as the task scores itself:
greedy generations (exact match = the run's accuracy, token F1), overall and by ToMi question
type, and the response loss / perplexity.

    nice -n 5 python experiments/tomi_baseline.py            # the figures in docs/data.md
    python experiments/tomi_baseline.py --test-examples 48 --steps 4   # a quick look

Writes ``experiments/results/tomi_baseline.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from fedcybgd.client.updates import TrainTask, get_rule
from fedcybgd.config import RunConfig
from fedcybgd.data.prompts import collate
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.layerwise import LayerStack
from fedcybgd.model.loading import load_model, load_tokenizer
from fedcybgd.tasks import build_task, shares
from fedcybgd.tasks.sequences import sequence_nll
from fedcybgd.tasks.sft import generate, normalize_answer, token_f1

RESULTS = Path(__file__).resolve().parent / "results"


@torch.no_grad()
def score(task: Any, stack: LayerStack, tokenizer: Any, frame: Any, args: Any) -> dict[str, Any]:
    """The sft task's scores on ``frame``: greedy generations of every row scored by exact
    match and token F1 (overall and by question type), and the response loss of the first
    ``--loss-examples`` rows. The same functions as :meth:`SFTTask.evaluate`, split so that
    the loss pass (a second forward of every prompt) can cover fewer rows on a slow CPU."""
    started = time.perf_counter()
    encode = task.encoder(tokenizer, args.max_seq_len)
    items = task.examples(frame)
    # Prompts of equal length batch together (less left padding); order does not change scores.
    order = sorted(range(len(items)), key=lambda i: len(encode.format.prompt(items[i])))
    exact = [0.0] * len(items)
    f1 = [0.0] * len(items)
    named = [0.0] * len(items)  # lenient: the answer word anywhere in the generation
    answers = [""] * len(items)
    for start in range(0, len(order), args.eval_batch):
        rows = order[start:start + args.eval_batch]
        prompts = [encode.format.prompt(items[r])[-args.max_seq_len:] for r in rows]
        for row, text in zip(rows, generate(stack, tokenizer, prompts, args.max_new_tokens),
                             strict=True):
            reference = items[row][-1]["content"]
            exact[row] = float(normalize_answer(text) == normalize_answer(reference))
            f1[row] = token_f1(text, reference)
            named[row] = float(normalize_answer(reference) in normalize_answer(text).split())
            answers[row] = text
    nll = tokens = 0.0
    for start in range(0, min(args.loss_examples, len(items)), args.eval_batch):
        part = items[start:min(start + args.eval_batch, args.loss_examples)]
        total, count = sequence_nll(stack, collate(encode(part), task=task))
        nll, tokens = nll + float(total.sum()), tokens + float(count.sum())
    by_type = {}
    for kind in sorted(set(frame["question_type"])):
        rows = [i for i, t in enumerate(frame["question_type"]) if t == kind]
        by_type[kind] = {"examples": len(rows),
                         "exact_match": sum(exact[i] for i in rows) / len(rows),
                         "token_f1": sum(f1[i] for i in rows) / len(rows)}
    n = len(items)
    loss = nll / max(tokens, 1.0)
    return {"examples": n, "exact_match": sum(exact) / n, "token_f1": sum(f1) / n,
            "answer_in_generation": sum(named) / n,
            "response_loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "loss_examples": min(args.loss_examples, n), "by_question_type": by_type,
            "sample_answers": [{"reference": items[i][-1]["content"], "generated": answers[i]}
                               for i in range(min(6, n))],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test-examples", type=int, default=240,
                        help="first N test rows (a seeded sample of the 1,200)")
    parser.add_argument("--loss-examples", type=int, default=64,
                        help="the response loss on the first N of them")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--layers-per-block", type=int, default=6,
                        help="the top block is trained; 30: one block of every decoder layer")
    parser.add_argument("--max-seq-len", type=int, default=160)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--eval-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "tomi_baseline.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    run = RunConfig(dataset="tomi", max_new_tokens=args.max_new_tokens,
                    max_seq_len=args.max_seq_len)
    task = build_task(run)
    test = task.split("test").head(args.test_examples)
    train = task.split("train")
    model = load_model("smollm2-135m")
    tokenizer = load_tokenizer("smollm2-135m")
    for p in model.parameters():
        p.requires_grad_(False)
    stack = LayerStack(model)
    blocks = BlockMap(model, layers_per_block=args.layers_per_block)
    block = [b for b in blocks.names if b.startswith("layer.")][-1]

    zero_shot = score(task, stack, tokenizer, test, args)
    print(f"zero-shot  exact match {zero_shot['exact_match']:.3f}  token F1 "
          f"{zero_shot['token_f1']:.3f}  on {zero_shot['examples']} test questions "
          f"({zero_shot['seconds']} s)", flush=True)

    batches = shares.batches(train, tokenizer, args.batch, args.max_seq_len, seed=args.seed,
                           task=task)
    started = time.perf_counter()
    outcome = get_rule("fo").train(TrainTask(
        model=model, stack=stack, blocks=blocks, block=block, batches=batches,
        steps=args.steps, lr=args.lr, weight_decay=0.0, seed=args.seed))
    train_seconds = time.perf_counter() - started
    print(f"fo on {block}: {outcome.steps} steps of {args.batch} in {train_seconds:.0f} s",
          flush=True)

    tuned = score(task, stack, tokenizer, test, args)
    print(f"fine-tuned exact match {tuned['exact_match']:.3f}  token F1 "
          f"{tuned['token_f1']:.3f}  ({tuned['seconds']} s)", flush=True)
    for kind in zero_shot["by_question_type"]:
        before, after = zero_shot["by_question_type"][kind], tuned["by_question_type"][kind]
        print(f"  {kind:13s} {before['examples']:4d} questions: exact match "
              f"{before['exact_match']:.3f} -> {after['exact_match']:.3f}")

    result = {
        "what": "SmolLM2-135M-Instruct on dataset 'tomi' (task sft): zero-shot, then the fo "
                "rule on one block, centralized; the same test rows before and after",
        "command": "nice -n 5 python experiments/tomi_baseline.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": "smollm2-135m", "dataset": "tomi", "task": run.task_kind,
        "splits": {s: len(task.split(s)) for s in ("train", "validation", "test")},
        "block": block, "train": {"steps": outcome.steps, "batch": args.batch, "lr": args.lr,
                                  "examples_seen": outcome.steps * args.batch,
                                  "skipped_steps": outcome.skipped_steps,
                                  "seconds": round(train_seconds, 1)},
        "zero_shot": zero_shot, "fine_tuned": tuned,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
