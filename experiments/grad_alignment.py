"""Gradient alignment of ZeroLock's local objectives with the true backprop gradient, per layer.

For every chosen decoder layer ``k`` of the model and every local-head construction, on held-out
batches (Rotten Tomatoes validation split, the classification task): the cosine between the
gradient, with respect to layer ``k``'s parameters, of the local objective (the loss of a head
on layer ``k``'s output, its input detached, as ``zerolock`` trains a one-layer block) and the
true gradient of the task loss (backprop from the model's own output through every layer
above), and the ratio of their norms (local / true). Also, per layer: the same cosine on the
gradient with respect to layer ``k``'s output states (at the scored positions, and over every
position), the share of the true output gradient that sits at the scored positions (the rest
reaches layer ``k`` through attention of the layers above, which no local head at the scored
position can see), and the lens's ``KL(final || head)`` on the held-out rows.

Constructions (heads), each a :class:`~fedcybgd.client.updates.local_heads.LocalHead`:

* ``frozen-lm``: the frozen final norm + LM head (``zerolock-head = frozen-lm``, the logit lens);
* ``tuned``: the ``tuned`` head's residual map, identity at start, trained on the task loss for
  ``--tuned-steps`` steps at ``--tuned-lr`` on the fit batches (what it learns over a round,
  without the block moving under it);
* ``calibrated-ls``: the calibrated head (:mod:`fedcybgd.client.updates.calibration`), least
  squares only;
* ``calibrated-kl``: least squares, then ``--kl-steps`` steps on ``KL(final || lens)`` at the
  scored positions (the tuned-lens objective);
* ``<head>+auxM``: the head reads the output of layer ``k + M`` (capped at the last layer):
  the ``M`` layers above ``k`` run frozen, the gradient flowing through their activations
  (``zerolock-aux-layers``; AugLocal-style), and the translator maps that layer.

Translators are fitted on ``--fit-batches`` batches of the TRAIN split (a node's own data);
alignment is measured on ``--eval-batches`` batches of the VALIDATION split.

    nice -n 5 python experiments/grad_alignment.py                       # every layer
    nice -n 5 python experiments/grad_alignment.py --layers 0,7,14,21,28 --eval-batches 2

Results: a table on stdout, ``experiments/results/grad_alignment.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = ("frozen-lm", "tuned", "calibrated-ls", "calibrated-kl")
CONSTRUCTIONS = (*HEADS, "frozen-lm+aux4", "calibrated-ls+aux2", "calibrated-ls+aux4")


def parse_construction(name: str) -> tuple[str, int]:
    """``head[+auxM]`` -> (head, M): the head reads layer ``k + M``, the M frozen layers above
    layer ``k`` run with grad through their activations (AugLocal-style)."""
    head, _, aux = name.partition("+aux")
    if head not in HEADS or (aux and not aux.isdigit()):
        raise SystemExit(f"unknown construction {name!r}; heads: {HEADS}, optional +auxM")
    return head, int(aux or 0)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """``all``, ``every:N`` (0, N, 2N, ... and the last) or a comma list of layer indices."""
    if spec == "all":
        return list(range(num_layers))
    if spec.startswith("every:"):
        step = int(spec.split(":", 1)[1])
        if step < 1:
            raise SystemExit(f"--layers every:N needs N >= 1, got {step}")
        return sorted({*range(0, num_layers, step), num_layers - 1})
    layers = sorted({int(x) for x in spec.split(",") if x.strip()})
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise SystemExit(f"--layers: {bad} not in [0, {num_layers})")
    return layers


def cosine(a: Any, b: Any) -> float:
    """Cosine of two flat tensors (nan when either is zero)."""
    a, b = a.double(), b.double()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return math.nan
    return float((a @ b) / (na * nb))


def main() -> None:
    """Fit the heads, measure the alignment per layer, print, save JSON and a plot."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="all", help="all, every:N, or e.g. 0,7,14")
    parser.add_argument("--constructions", default=",".join(CONSTRUCTIONS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--fit-batches", type=int, default=4)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--kl-steps", type=int, default=10)
    parser.add_argument("--kl-lr", type=float, default=1e-3)
    parser.add_argument("--tuned-steps", type=int, default=20)
    parser.add_argument("--tuned-lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "grad_alignment.json"))
    args = parser.parse_args()

    import torch

    from fedcybgd.client.updates.calibration import (
        collect_rows,
        fit_least_squares,
        lens_kl,
        refine_kl,
    )
    from fedcybgd.client.updates.local_heads import LocalHead, Translator
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model, load_tokenizer
    from fedcybgd.tasks import shares
    from fedcybgd.tasks.objective import batch_loss, scored_logits, scored_states

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    constructions = [c for c in args.constructions.split(",") if c]
    parsed = {c: parse_construction(c) for c in constructions}
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    stack = LayerStack(model)
    layers = parse_layers(args.layers, stack.num_layers)
    last = stack.num_layers - 1
    # the layer each construction's head reads, per measured layer
    reads = {(k, c): min(k + parsed[c][1], last) for k in layers for c in constructions}
    sources = sorted(set(reads.values()))
    fit = list(itertools.islice(shares.batches(shares.load_split("rotten-tomatoes", "train"),
                                             tokenizer, args.batch, args.seq, seed=0),
                                args.fit_batches))
    held = list(itertools.islice(shares.batches(shares.load_split("rotten-tomatoes", "validation"),
                                              tokenizer, args.batch, args.seq, seed=1),
                                 args.eval_batches))

    # ---- fit the heads (timed: this is what a node pays)
    costs: dict[str, float] = {}
    started = time.perf_counter()
    rows = collect_rows(stack, fit, sources)
    costs["collect_s"] = time.perf_counter() - started
    held_rows = collect_rows(stack, held, sources)
    bases = sorted({h for h, _ in parsed.values()}, key=HEADS.index)
    fitted: dict[tuple[str, int], Translator | None] = {}
    fitted_kl: dict[tuple[str, int], float] = {}
    costs["ls_s"] = costs["kl_s"] = costs["tuned_s"] = 0.0
    needed = {(parsed[c][0], reads[(k, c)]) for k in layers for c in constructions}
    for j in sources:
        ls = None
        if any((h, j) in needed for h in ("calibrated-ls", "calibrated-kl")):
            t0 = time.perf_counter()
            ls = fit_least_squares(rows.sources[j], rows.target, ridge=args.ridge, seed=j)
            costs["ls_s"] += time.perf_counter() - t0
        for h in bases:
            if (h, j) not in needed:
                continue
            translator: Translator | None = None
            if h == "calibrated-ls":
                translator = ls
            elif h == "calibrated-kl":
                assert ls is not None
                translator = Translator(ls.hidden)
                translator.load_state_dict(ls.state_dict())
                t0 = time.perf_counter()
                refine_kl(stack, translator, rows.scored_sources[j], rows.scored_target,
                          args.kl_steps, lr=args.kl_lr, seed=j)
                costs["kl_s"] += time.perf_counter() - t0
            elif h == "tuned":
                translator = Translator(int(rows.target.shape[1]))
                opt = torch.optim.AdamW(translator.parameters(), lr=args.tuned_lr,
                                        weight_decay=0.0)
                t0 = time.perf_counter()
                per_batch = torch.split(rows.scored_sources[j], [b.num_scored for b in fit])
                for step in range(args.tuned_steps):
                    b = step % len(fit)
                    logits = stack.head_logits(stack.final_hidden(translator(per_batch[b])))
                    with torch.enable_grad():
                        batch_loss(logits, fit[b]).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                costs["tuned_s"] += time.perf_counter() - t0
            if translator is not None:
                for p in translator.parameters():
                    p.requires_grad_(False)
            fitted[(h, j)] = translator
            fitted_kl[(h, j)] = lens_kl(stack, translator, held_rows.scored_sources[j],
                                        held_rows.scored_target)
        print(f"fitted layer {j}: " + "  ".join(f"{h} KL {fitted_kl[(h, j)]:.3f}"
                                                for h in bases if (h, j) in needed), flush=True)
    heads = {c: {k: fitted[(parsed[c][0], reads[(k, c)])] for k in layers}
             for c in constructions}
    kl = {c: {k: fitted_kl[(parsed[c][0], reads[(k, c)])] for k in layers}
          for c in constructions}

    # ---- alignment on held-out batches
    by_layer: dict[int, list[torch.nn.Parameter]] = {
        k: list(stack.layers[k].parameters()) for k in layers}
    acc: dict[tuple[int, str], dict[str, list[float]]] = {}
    share: dict[int, list[float]] = {k: [] for k in layers}
    true_loss: list[float] = []
    align_started = time.perf_counter()
    for batch in held:
        for k in layers:
            for p in by_layer[k]:
                p.requires_grad_(True)
        base = stack.embed(batch.input_ids, batch.attention_mask)
        outs: dict[int, torch.Tensor] = {}
        with torch.enable_grad():
            hidden = base
            for k in range(stack.num_layers):
                hidden = stack.run(hidden, k, k + 1)
                if k in by_layer:
                    outs[k] = hidden.states
            loss = batch_loss(scored_logits(stack, hidden.states, batch), batch)
            flat_params = [p for k in layers for p in by_layer[k]]
            grads = torch.autograd.grad(loss, flat_params + [outs[k] for k in layers])
        true_loss.append(float(loss.detach()))
        at = 0
        true_param: dict[int, torch.Tensor] = {}
        for k in layers:
            n = len(by_layer[k])
            true_param[k] = torch.cat([g.reshape(-1) for g in grads[at:at + n]])
            at += n
        true_out = dict(zip(layers, grads[len(flat_params):], strict=True))
        del grads, outs, hidden, loss
        # the inputs of each layer, recomputed without grad (a local head detaches them)
        inputs: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            hidden = base
            for k in range(stack.num_layers):
                if k in by_layer:
                    inputs[k] = hidden.states
                hidden = stack.run(hidden, k, k + 1)
        for k in layers:
            scored_true = scored_states(true_out[k], batch)
            share[k].append(float(scored_true.pow(2).sum() / true_out[k].pow(2).sum()))
            for c in constructions:
                aux = reads[(k, c)] - k
                head = LocalHead(stack, translator=heads[c][k], aux_layers=aux,
                                 aux_start=k + 1)
                with torch.enable_grad():
                    out = stack.run(base.with_states(inputs[k]), k, k + 1)
                    local = head.loss(out, batch)
                    got = torch.autograd.grad(local, by_layer[k] + [out.states])
                local_param = torch.cat([g.reshape(-1) for g in got[:-1]])
                local_out = got[-1]
                rec = acc.setdefault((k, c), {"param_cos": [], "norm_ratio": [],
                                              "out_cos_scored": [], "out_cos_all": [],
                                              "local_loss": []})
                rec["param_cos"].append(cosine(local_param, true_param[k]))
                rec["norm_ratio"].append(float(local_param.norm() / true_param[k].norm()))
                rec["out_cos_scored"].append(cosine(scored_states(local_out, batch).reshape(-1),
                                                    scored_true.reshape(-1)))
                rec["out_cos_all"].append(cosine(local_out.reshape(-1),
                                                 true_out[k].reshape(-1)))
                rec["local_loss"].append(float(local.detach()))
        for k in layers:
            for p in by_layer[k]:
                p.requires_grad_(False)
    align_s = time.perf_counter() - align_started

    # ---- report
    table: list[dict[str, Any]] = []
    for k in layers:
        for c in constructions:
            rec = acc[(k, c)]
            table.append({"layer": k, "construction": c, "lens_kl": kl[c][k],
                          "true_share_scored": statistics.fmean(share[k]),
                          **{m: statistics.fmean(v) for m, v in rec.items()}})
    print(f"\ntrue loss on the held-out batches: {statistics.fmean(true_loss):.3f}")
    print(f"{'layer':>5} {'share@scored':>12} " + "".join(f"{c:>30}" for c in constructions))
    print(f"{'':>5} {'':>12} " + "".join(f"{'cos / |l|/|t| / out-cos / KL':>30}"
                                        for _ in constructions))
    for k in layers:
        cells = []
        for c in constructions:
            r = next(x for x in table if x["layer"] == k and x["construction"] == c)
            cells.append(f"{r['param_cos']:+.3f} / {r['norm_ratio']:6.2f} / "
                         f"{r['out_cos_scored']:+.2f} / {r['lens_kl']:5.2f}")
        print(f"{k:>5} {statistics.fmean(share[k]):>12.3f} " + "".join(f"{x:>30}" for x in cells))
    medians = {c: statistics.median(r["param_cos"] for r in table if r["construction"] == c)
               for c in constructions}
    print("median parameter-gradient cosine across layers: "
          + ", ".join(f"{c} {m:+.3f}" for c, m in medians.items()))
    costs["align_s"] = align_s
    costs["fit_rows"] = float(rows.target.shape[0])
    print("costs: " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
            "true_loss": statistics.fmean(true_loss)}
    out.write_text(json.dumps({"meta": meta, "median_param_cos": medians, "costs": costs,
                               "rows": table}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cos_ax, ratio_ax, kl_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for c in constructions:
        mine = [r for r in table if r["construction"] == c]
        xs = [r["layer"] for r in mine]
        cos_ax.plot(xs, [r["param_cos"] for r in mine], "o-", label=c)
        ratio_ax.plot(xs, [r["norm_ratio"] for r in mine], "o-", label=c)
        kl_ax.plot(xs, [r["lens_kl"] for r in mine], "o-", label=c)
    cos_ax.plot(layers, [statistics.fmean(share[k]) for k in layers], "k:",
                label="true grad share at scored pos.")
    cos_ax.set_ylabel("cosine(local, true) of the layer's parameter gradient")
    ratio_ax.set_ylabel("|local grad| / |true grad|")
    ratio_ax.set_yscale("log")
    kl_ax.set_ylabel("KL(final || head) at scored positions")
    kl_ax.set_yscale("log")
    for ax in (cos_ax, ratio_ax, kl_ax):
        ax.set_xlabel("layer")
    cos_ax.legend(fontsize=8)
    fig.suptitle(f"{args.model}: ZeroLock local heads vs backprop, Rotten Tomatoes validation")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
