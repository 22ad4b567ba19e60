"""Can a FedCyBGD block's training step run as an ExecuTorch program, equal to eager PyTorch?

    python experiments/executorch_block.py                       # three tiny families
    python experiments/executorch_block.py --models tiny-llama --block 2

ExecuTorch is not a dependency of the project yet: its wheel asks for protobuf 7 and packaging
26, which flwr 1.42 refuses. Its training path needs only five packages beside ours, installed
without their dependencies (the venv's numpy, protobuf and packaging serve it)::

    .venv/bin/pip install --no-deps executorch==1.5.1 torchao==0.18.0 flatbuffers ruamel.yaml \
        tabulate

Per model: every parameter frozen but the block's; the model with the next-token loss exported
(``torch.export``, transformers' eager attention: SDPA's CPU backward is outside the core ATen
set), its joint forward-backward graph (``_export_forward_backward``), ``aten.empty_permuted``
rewritten as ``empty`` + ``permute`` (``to_edge`` refuses it), then ``to_edge`` and
``to_executorch``. The program runs in ExecuTorch's training module on one batch; its loss and
the block's gradients are compared with eager PyTorch's on the same batch. Writes
``experiments/results/executorch/block.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


class WithLoss(torch.nn.Module):
    """The model and its next-token loss: what the program computes."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def measure(name: str, block_index: int, batch: int, seq: int, seed: int) -> dict[str, Any]:
    """One model's block: the program's size and times, its loss and gradients against eager."""
    from executorch.exir import to_edge
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    from fedcybgd.model.block_programs import rewrite_empty_permuted
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.loading import load_model

    model = load_model(name)
    model.config.use_cache = False
    model.config._attn_implementation = "eager"
    blocks = BlockMap(model, 1)
    block = blocks.names[block_index]
    own = set(blocks.info(block).param_names)
    for n, p in model.named_parameters():
        p.requires_grad_(n in own)
    wrapped = WithLoss(model)
    ids = torch.randint(0, int(model.config.vocab_size), (batch, seq),
                        generator=torch.Generator().manual_seed(seed))
    began = time.perf_counter()
    program = _export_forward_backward(export(wrapped, (ids,), strict=False))
    rewritten = sum(n.target == torch.ops.aten.empty_permuted.default
                    for n in program.graph_module.graph.nodes)
    rewrite_empty_permuted(program.graph_module)
    exported_s = time.perf_counter() - began
    buffer = to_edge(program).to_executorch().buffer
    lowered_s = time.perf_counter() - began - exported_s
    module = _load_for_executorch_for_training_from_buffer(buffer)
    began = time.perf_counter()
    out = module.forward_backward("forward", (ids,))
    step_s = time.perf_counter() - began
    got = {k.removeprefix("model."): v for k, v in module.named_gradients().items()}
    loss = wrapped(ids)
    loss.backward()
    eager = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    worst = max(float((got[n] - g).abs().max() / (g.abs().max() + 1e-12))
                for n, g in eager.items() if n in got)
    return {"model": name, "block": block, "block_tensors": len(own),
            "program_gradients": sorted(got) == sorted(eager),
            "empty_permuted_rewritten": rewritten, "pte_bytes": len(buffer),
            "export_s": exported_s, "to_executorch_s": lowered_s, "step_s": step_s,
            "loss_program": float(out[0].detach()), "loss_eager": float(loss.detach()),
            "worst_relative_gradient_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+",
                        default=["tiny-llama", "tiny-mistral", "tiny-qwen2"])
    parser.add_argument("--block", type=int, default=1, help="index in the block list")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "executorch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(m, args.block, args.batch, args.seq, args.seed) for m in args.models]
    from importlib.metadata import version

    result = {"machine": f"{platform.machine()}, {platform.python_version()}, torch "
                         f"{torch.__version__}, executorch {version('executorch')}",
              "time": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args) | {"out": str(args.out)},
              "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "block.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
