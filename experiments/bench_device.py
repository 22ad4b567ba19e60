"""The client's update rules on an accelerator, side by side with the CPU: exactness and speed.

Prepared for a lent GPU (run it there and record its figures); it runs on
any ``--device`` (``cpu`` too, which is how it is kept working here). In one process, on the
real SmolLM2 model and Rotten Tomatoes batches, through the client's own :class:`ClientModel`
(device placement, frozen precision) and the registered rules:

1. the zeroth-order z / update fingerprint on the CPU and on the device (equal: a seed log
   trained there replays exactly on a CPU server; different: the node uploads weights);
2. piecewise logits (the rules' :class:`LayerStack`) against the model's own forward on the
   device, on a padded batch, fp32 and bf16 frozen;
3. per variant (rule, block, frozen precision): seconds per local step and the peak device
   memory (``torch.cuda.max_memory_allocated``; the process RSS on the CPU), on the device and,
   with ``--cpu-too``, on the CPU in the same run for the speed ratio.

    python experiments/bench_device.py --device cuda --cpu-too   # on a lent GPU, ~3 min
    python experiments/bench_device.py --device cpu --steps 1 --variants fo@top   # smoke

Results: printed, and saved to ``experiments/results/bench_device_<device>.json``.
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
# name -> (rule, options, frozen dtype, frozen quant); "@where" picks the block
VARIANTS: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "inference": ("inference", {}, "float32", "none"),
    "fo": ("fo", {}, "float32", "none"),
    "fo/bf16": ("fo", {}, "bfloat16", "none"),
    "fo/recompute": ("fo", {"fo-recompute": True}, "float32", "none"),
    "zerolock": ("zerolock", {}, "float32", "none"),
    "lezo": ("lezo", {}, "float32", "none"),
    "lezo/int8": ("lezo", {}, "bfloat16", "int8"),
}
DEFAULT = ("inference@top,fo@top,fo@bottom,fo/bf16@top,fo/recompute@bottom,zerolock@middle,"
           "lezo@top,lezo/int8@top")


def pick(names: list[str], where: str) -> str:
    layers = [b for b in names if b.startswith("layer.")]
    return {"bottom": layers[0], "middle": layers[len(layers) // 2], "top": layers[-1]}[where]


def logits_gap(model_name: str, device: str, dtype: str, batches: list[Any]) -> float:
    """Largest |piecewise - model| logit over a padded batch, frozen blocks in ``dtype``."""
    import torch

    from fedcybgd.client.runtime import ClientModel
    from fedcybgd.model.precision import Precision

    cm = ClientModel(model_name, 4, device, Precision(dtype, "none"))
    batch = batches[0].to(cm.device)
    with torch.no_grad():
        own = cm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        piece = cm.stack.all_logits(batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    return float((own.float() - piece.float()).abs()[real].max())


def time_variant(model_name: str, device: str, name: str, batches: list[Any], steps: int,
                 state_dir: Path) -> dict[str, Any]:
    """Seconds per local step and peak memory of one variant on ``device``."""
    import torch

    from fedcybgd.client.runtime import ClientModel
    from fedcybgd.client.updates import TrainTask, get_rule
    from fedcybgd.core.measure import PeakMemory
    from fedcybgd.model.precision import Precision
    from fedcybgd.tasks.objective import scored_logits

    variant, _, where = name.partition("@")
    rule, options, dtype, quant = VARIANTS[variant]
    cm = ClientModel(model_name, 4, device, Precision(dtype, quant))
    block = pick(cm.blocks.names, where or "top")
    cm.train_block(block, None)  # type: ignore[arg-type]  # pretrained: no cache needed
    on = [b.to(cm.device) for b in batches]
    cuda = cm.device.type == "cuda"

    def step(i: int) -> None:
        if rule == "inference":
            with torch.no_grad():
                hidden = cm.stack.run(cm.stack.embed(on[i].input_ids, on[i].attention_mask), 0,
                                      cm.stack.num_layers)
                scored_logits(cm.stack, hidden.states, on[i])
            return
        task = TrainTask(model=cm.model, stack=cm.stack, blocks=cm.blocks, block=block,
                         batches=iter([on[i]]), steps=1, lr=1e-6, weight_decay=0.0, seed=i,
                         options=dict(options), state_dir=state_dir / name.replace("/", "-"))
        get_rule(rule).train(task)

    step(0)  # warm-up: kernels, allocator, optimizer state
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with PeakMemory() as mem:
        began = time.perf_counter()
        for i in range(1, steps + 1):
            step(i)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - began
    return {"variant": name, "device": str(cm.device), "block": block, "step_s": elapsed / steps,
            "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "peak_rss_mb": mem.peak_mb}


def main() -> None:
    """Run the checks and the variants; print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=DEFAULT)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu-too", action="store_true",
                        help="time every variant on the CPU too, in this run (the speed ratio)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import itertools
    import tempfile

    import torch

    from fedcybgd.model.devices import resolve_device
    from fedcybgd.model.loading import load_tokenizer
    from fedcybgd.protocol.zeroth_order import z_fingerprint
    from fedcybgd.tasks import shares

    device = str(resolve_device(args.device))
    frame = shares.load_split("rotten-tomatoes", "train")
    batches = list(itertools.islice(
        shares.batches(frame, load_tokenizer(args.model), args.batch, args.seq, seed=0),
        args.steps + 1))
    fingerprints = {"cpu": z_fingerprint("cpu"), device: z_fingerprint(device)}
    print(f"z fingerprint: cpu {fingerprints['cpu']}, {device} {fingerprints[device]} "
          f"({'equal' if len(set(fingerprints.values())) == 1 else 'DIFFERENT'})", flush=True)
    gaps = {dtype: logits_gap(args.model, device, dtype, batches)
            for dtype in ("float32", "bfloat16")}
    print(f"piecewise vs model logits on {device}: " + ", ".join(
        f"{k} {v:.2e}" for k, v in gaps.items()), flush=True)
    rows = []
    devices = [device] + (["cpu"] if args.cpu_too and device != "cpu" else [])
    with tempfile.TemporaryDirectory(prefix="bench-device-") as tmp:
        for name in args.variants.split(","):
            for where in devices:
                row = time_variant(args.model, where, name, batches, args.steps, Path(tmp))
                rows.append(row)
                peak = (f"{row['peak_device_mb']:7.0f} MB on device" if row["peak_device_mb"]
                        is not None else f"{row['peak_rss_mb']:7.0f} MB RSS")
                print(f"{name:<22}{where:<8}{row['step_s']:8.3f} s/step  {peak}", flush=True)
    for name in args.variants.split(","):
        pair = {r["device"].split(":")[0]: r["step_s"] for r in rows if r["variant"] == name}
        if "cpu" in pair and len(pair) == 2:
            other = next(k for k in pair if k != "cpu")
            print(f"{name:<22}{other} is {pair['cpu'] / pair[other]:.1f}x the CPU's speed")
    out = Path(args.out) if args.out else RESULTS / f"bench_device_{device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "device_name": (torch.cuda.get_device_name() if device.startswith("cuda")
                                    else platform.processor())},
        "args": vars(args), "z_fingerprints": fingerprints, "logits_max_abs_gap": gaps,
        "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
