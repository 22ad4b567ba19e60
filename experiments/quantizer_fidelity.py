"""How much of a real FedCyBGD update each quantizer keeps, one shot.

Trains SmolLM2 for two rounds at the app's defaults with exact fp32 traffic (the real ServerApp
logic and ClientApp over the loopback Grid), takes the installed update (the final model minus
the pretrained one), rounds it through each codec of the wire format (``encode`` then
``decode``, exactly what a node or the server would get) and evaluates the model with the
rounded update. Error feedback would send what a codec dropped later; this measures what one
transmission keeps, which is what a codec costs before feedback can help.

    python experiments/quantizer_fidelity.py          # about 5 min on 2 CPU cores

Results: printed; ``experiments/results/quantizer_fidelity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
CODECS = ("none", "delta+int8+zstd", "delta+int4+zstd", "delta+int2+zstd",
          "delta+topk+int8+zstd", "zero")


def main() -> None:
    """Train, round the update through each codec, evaluate."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default="outputs/quantizer_fidelity")
    parser.add_argument("--out", default=str(RESULTS / "quantizer_fidelity.json"))
    args = parser.parse_args()

    import torch

    from fedcybgd.compression import decode, encode
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import run_in_process
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model
    from fedcybgd.server.common import Evaluator

    config = {"num-server-rounds": args.rounds, "eval-every": 0, "upload-codec": "fp32",
              "download-codec": "fp32", "install-codec": "none", "error-feedback": False}
    started = time.perf_counter()
    run_in_process(config, 8, args.work)
    train_s = time.perf_counter() - started
    run = RunConfig.from_run_config(config)
    model = load_model(run.model)
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    trained = type(model).from_pretrained(Path(args.work) / "run" / "final").state_dict()
    changed = {k: v for k, v in trained.items() if not torch.equal(v, pretrained[k])}
    evaluate = Evaluator(run, LayerStack(model))

    rows = []
    for codec in CODECS:
        if codec in ("none", "zero"):
            payload_bytes = None
            rounded = changed if codec == "none" else {k: pretrained[k] for k in changed}
        else:
            base = {k: pretrained[k] for k in changed}
            payload = encode(changed, codec, block="update", target_version=1, base=base)
            payload_bytes = len(payload)
            rounded = decode(payload, base=base, max_bytes=len(payload)).tensors
        dot = norm_true = norm_sent = 0.0
        for k in changed:
            true = (changed[k] - pretrained[k]).double()
            sent = (rounded[k] - pretrained[k]).double()
            dot += float((true * sent).sum())
            norm_true += float(true.square().sum())
            norm_sent += float(sent.square().sum())
        model.load_state_dict({**pretrained, **rounded})
        result = evaluate()
        cosine = dot / (norm_true * norm_sent) ** 0.5 if norm_sent else 0.0
        numel = sum(v.numel() for v in changed.values())
        row = {"codec": codec, "eval_loss": result.loss, "eval_accuracy": result.accuracy,
               "cosine": cosine, "norm_ratio": (norm_sent / norm_true) ** 0.5,
               "bytes_per_value": None if payload_bytes is None else payload_bytes / numel}
        rows.append(row)
        per = "" if payload_bytes is None else f"  {payload_bytes / numel:.3f} B/value"
        print(f"{codec:<22} eval loss {result.loss:.4f}  acc {result.accuracy:.3f}  "
              f"cos {cosine:.3f}  norm ratio {row['norm_ratio']:.3f}{per}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": args.rounds, "train_s": train_s,
                               "changed_values": sum(v.numel() for v in changed.values()),
                               "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
