"""A block's fo (or lezo) steps through ExecuTorch against eager PyTorch on SmolLM2, side by
side.

    .venv-executorch/bin/python experiments/executorch_node.py              # layer.3, 8 x 128
    .venv-executorch/bin/python experiments/executorch_node.py --block layer.20 --steps 5
    .venv-executorch/bin/python experiments/executorch_node.py --rule lezo --steps 8

One block of SmolLM2-135M (one layer a block) trains ``--steps`` AdamW steps on the same
random-token batches two ways, each in a process of its own so its peak RSS is its own, the two
alternating ``--repeats`` times: ``eager`` (PyTorch: the model with the language-modelling loss,
only the block trainable, as the ``fo`` rule) and ``executorch`` (the block's ExecuTorch program,
:class:`fedcybgd.model.block_programs.ProgramTrainer`, with the round's weights written to a
``.ptd``). The program is exported once first (its time and peak RSS reported; a node does this
once per block). Reported: seconds a step (median over steps after the first), the process's
peak RSS, and the trained block of the two compared (relative L2 of the difference of the
changes), and for the program the peak a node's memory budget is held against
(:meth:`fedcybgd.client.updates.fo_program.ProgramFirstOrder.peak_mb`, on the process's own
memory before the model was loaded). Writes ``experiments/results/executorch/node.json`` and
prints it.

``--rule lezo``: the ``lezo`` rule itself both ways on the same lm batches and seed: eager
(:class:`fedcybgd.client.updates.lezo.LeZO`, its losses from the frozen prefix) and through the
block's forward program (:class:`fedcybgd.client.updates.zo_program.ProgramLeZO`); seconds a
step are the round's over its steps (a step is two forwards); writes ``node-lezo.json``.

``--in-image IMAGE --platform linux/arm64``: the same measurement inside the node image for
another architecture (``scripts/prepare-docker-offline.sh --platform linux/arm64``; on an x86
machine qemu runs it), this checkout mounted over the image's package and ExecuTorch's wheels
for that platform unpacked beside it (``--site``, made with ``pip install --target DIR
--platform manylinux_2_28_aarch64 --only-binary=:all: --no-deps`` and the Makefile's
``EXECUTORCH`` list). The programs are the ones exported here (``--programs``, the same batch and
length): a phone or board loads programs exported on another machine. Under emulation the
seconds are qemu's on this machine (compare arm64 with x86 as ratios, never as a board's speed);
the peak RSS is the node's own. ``--tag`` names the result file (``node[-lezo]-TAG.json``).

    .venv-executorch/bin/python experiments/executorch_node.py --batch 1 --seq 32 --steps 3 \
        --programs outputs/et-programs-1x32 --tag x86-1x32                 # exports, x86 figures
    .venv-executorch/bin/python experiments/executorch_node.py --batch 1 --seq 32 --steps 3 \
        --programs outputs/et-programs-1x32 --tag arm64-1x32 --repeats 1 \
        --in-image fedcybgd:0.1.0-arm64 --platform linux/arm64 --site outputs/et-arm64
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def batches(vocab: int, rows: int, seq: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    from fedcybgd.model.block_programs import lm_inputs

    g = torch.Generator().manual_seed(0)
    return [lm_inputs([torch.randint(0, vocab, (seq,), generator=g).tolist()
                       for _ in range(rows)], seq, 0) for _ in range(steps)]


def lm_batches(vocab: int, rows: int, seq: int, steps: int) -> list[Any]:
    """The same random windows as :func:`batches`, as the ``lm`` task's batches."""
    from fedcybgd.data.prompts import EncodedExamples, collate

    out = []
    for ids, _mask, _targets in batches(vocab, rows, seq, steps):
        windows = ids.tolist()
        out.append(collate(EncodedExamples(
            input_ids=windows, labels=[-1] * rows, class_token_ids=(), pad_token_id=0,
            score_positions=[list(range(seq - 1))] * rows, targets=[w[1:] for w in windows])))
    return out


def zo_rule(mode: str, args: argparse.Namespace, base_hash: str) -> Any:
    from fedcybgd.client.updates.base import get_rule
    from fedcybgd.client.updates.zo_program import ProgramLeZO

    if mode == "eager":
        return get_rule("lezo")
    return ProgramLeZO(args.programs, args.model, base_hash, args.batch, args.seq)


def train_zo(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """``lezo`` in this process, eagerly or through the block's forward program."""
    from safetensors.torch import save_file

    from fedcybgd.core.checksum import content_checksum
    from fedcybgd.core.measure import rss_bytes
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.layerwise import LayerStack
    from fedcybgd.model.loading import load_model
    from fedcybgd.rules import TrainTask

    torch.set_num_threads(args.threads)
    if mode == "executorch":
        from executorch.extension.pybindings import portable_lib  # noqa: F401
    runtime = rss_bytes() / 2**20
    model = load_model(args.model)
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = BlockMap(model, 1)
    rule = zo_rule(mode, args, content_checksum(dict(model.named_parameters())))
    task = TrainTask(model=model, stack=LayerStack(model), blocks=blocks, block=args.block,
                     batches=iter(lm_batches(int(model.config.vocab_size), args.batch,
                                             args.seq, args.steps)),
                     steps=args.steps, lr=args.lr, weight_decay=0.0, seed=0, options={})
    row: dict[str, Any] = {"mode": mode}
    if mode == "executorch":
        entry = rule.program(model, blocks, args.block)
        held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        row["estimate_mb"] = rule.need_mb(entry, held, runtime, {})
        row["planned_mb"] = entry.planned_bytes / 2**20
    began = time.perf_counter()
    outcome = rule.train(task)
    took = time.perf_counter() - began
    trained = {k: v.contiguous() for k, v in blocks.get(model, args.block).items()}
    save_file(trained, str(args.programs / f"trained-{mode}.safetensors"))
    row.update(step_s=[took / args.steps] * args.steps, loss=outcome.loss,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               native_libraries_mb=native_libraries_mb())
    return row


def train(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's steps in this process; saves the trained block beside the programs."""
    if args.rule == "lezo":
        return train_zo(mode, args)
    from safetensors.torch import save_file

    from fedcybgd.core.measure import rss_bytes
    from fedcybgd.model.block_programs import (
        ProgramTrainer,
        WithLMLoss,
        named_tensors,
        read_manifest,
    )
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.loading import load_model

    torch.set_num_threads(args.threads)
    if mode == "executorch":  # the runtime's libraries count in the process's own memory
        import executorch.extension.training  # noqa: F401
        from executorch.extension.pybindings import portable_lib  # noqa: F401
    # What the process holds besides the model (the node's runtime figure). After the load the
    # weights are not all resident yet (read lazily), so it is taken before it.
    runtime = rss_bytes() / 2**20
    model = load_model(args.model)
    blocks = BlockMap(model, 1)
    own = set(blocks.info(args.block).param_names)
    data = batches(int(model.config.vocab_size), args.batch, args.seq, args.steps)
    times = []
    if mode == "eager":
        for n, p in model.named_parameters():
            p.requires_grad_(n in own)
        params = [p for n, p in model.named_parameters() if n in own]
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        wrapped = WithLMLoss(model)
        for ids, mask, targets in data:
            began = time.perf_counter()
            optimizer.zero_grad()
            wrapped(ids, mask, targets).backward()
            optimizer.step()
            times.append(time.perf_counter() - began)
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if n in own}
    else:
        from fedcybgd.client.updates.fo_program import ProgramFirstOrder

        entry = read_manifest(args.programs)[args.block]
        held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        estimate = ProgramFirstOrder.peak_mb(entry, held, runtime)
        trainer = ProgramTrainer(args.programs, entry, named_tensors(model), args.lr, 0.0)
        for ids, mask, targets in data:
            began = time.perf_counter()
            trainer.step(ids, mask, targets)
            times.append(time.perf_counter() - began)
        trained = trainer.block()
        trainer.close()
    save_file({k: v.contiguous() for k, v in trained.items()},
              str(args.programs / f"trained-{mode}.safetensors"))
    row = {"mode": mode, "step_s": times,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "native_libraries_mb": native_libraries_mb()}
    if mode == "executorch":  # what a node's memory budget is held against
        row["estimate_mb"] = estimate
        row["planned_mb"] = entry.planned_bytes / 2**20
    return row


def package_folders() -> dict[str, Path]:
    """Where torch and ExecuTorch are installed in this environment (ExecuTorch is a namespace
    package: its first search location)."""
    import importlib.util

    folders = {}
    for package in ("torch", "executorch"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"{package} is not installed in {sys.executable}'s environment")
        folders[package] = Path(next(iter(spec.submodule_search_locations))).resolve()
    return folders


def native_libraries_mb() -> dict[str, float]:
    """The size on disk of the native libraries this process has mapped, by package: what a
    node's training step loads of torch and of ExecuTorch's runtime (``/proc/self/maps``)."""
    import os

    roots = {package: str(folder) for package, folder in package_folders().items()}
    seen: dict[str, set[str]] = {package: set() for package in ("torch", "executorch")}
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        for package, root in roots.items():
            if path.startswith(root + "/") and ".so" in path:
                seen[package].add(path)
    return {package: sum(os.path.getsize(p) for p in paths) / 2**20
            for package, paths in seen.items()}


def installed_mb() -> dict[str, float]:
    """The size on disk of the torch and ExecuTorch packages as installed here: what a node that
    trains through the runtime installs of each."""
    return {name: sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
            for name, folder in package_folders().items()}


def bindings_need_torch() -> dict[str, list[str]]:
    """The torch libraries each ExecuTorch Python binding loads (``ldd``, transitively):
    whether a node could train through the runtime without torch installed. Empty lists: it
    could."""
    root = package_folders()["executorch"] / "extension"
    found: dict[str, list[str]] = {}
    for library in sorted([*root.glob("pybindings/_C*.so"),
                           *root.glob("training/pybindings/_training_lib*.so")]):
        loads = subprocess.run(["ldd", str(library)], capture_output=True, text=True,
                               check=True).stdout
        names = [line.split()[0] for line in loads.splitlines() if line.strip()]
        torch_names = [n for n in names if n.startswith(("libtorch", "libc10"))]
        found[library.name.split(".")[0]] = torch_names
    return found


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Export the block's program in this process (its time and peak RSS)."""
    from fedcybgd.model.block_programs import export_programs, read_manifest

    if args.rule == "lezo":  # the node's own folder layout: the rule exports it
        from fedcybgd.core.checksum import content_checksum
        from fedcybgd.model.blocks import BlockMap
        from fedcybgd.model.loading import load_model

        model = load_model(args.model)
        rule = zo_rule("executorch", args, content_checksum(dict(model.named_parameters())))
        began = time.perf_counter()
        rule.program(model, BlockMap(model, 1), args.block)
        return {"export_s": time.perf_counter() - began, "note": "exported unless present",
                "export_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    try:
        entry = read_manifest(args.programs).get(args.block)
    except (OSError, ValueError, TypeError, KeyError):  # none, or another release's manifest
        entry = None
    if entry is not None and (entry.batch, entry.seq) == (args.batch, args.seq):
        return {"export_s": None, "note": "program reused"}
    began = time.perf_counter()
    export_programs(args.model, args.programs, 1, args.batch, args.seq, [args.block])
    return {"export_s": time.perf_counter() - began,
            "export_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child(what: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", what, "--model", args.model, "--block",
               args.block, "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
               str(args.steps), "--lr", str(args.lr), "--threads", str(args.threads),
               "--programs", str(args.programs), "--rule", args.rule]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare(args: argparse.Namespace) -> dict[str, float]:
    from safetensors.torch import load_file

    from fedcybgd.model.loading import load_model

    base = dict(load_model(args.model).named_parameters())
    eager = load_file(str(args.programs / "trained-eager.safetensors"))
    program = load_file(str(args.programs / "trained-executorch.safetensors"))
    diff = sum(float((program[n] - eager[n]).norm() ** 2) for n in eager) ** 0.5
    size = sum(float((eager[n] - base[n].detach()).norm() ** 2) for n in eager) ** 0.5
    worst = max(float((program[n] - eager[n]).abs().max()) for n in eager)
    return {"relative_l2_of_change_difference": diff / size, "max_abs_difference": worst,
            "change_l2": size}


def in_image(args: argparse.Namespace) -> None:
    """Run this script with the same arguments inside ``args.in_image`` (the checkout mounted at
    ``/repo`` ahead of the image's package, ``args.site`` ahead of its site-packages)."""
    root = HERE.parent.resolve()
    if args.site is None or not (args.site / "executorch").is_dir():
        raise SystemExit(f"--site {args.site}: no executorch package there (see --help)")
    inner = list(sys.argv[1:])
    for flag in ("--in-image", "--platform", "--site"):
        while flag in inner:
            at = inner.index(flag)
            del inner[at:at + 2]
    paths = {"--programs": args.programs.resolve(), "--out": args.out.resolve()}
    for flag, path in paths.items():
        if not path.is_relative_to(root):
            raise SystemExit(f"{flag} {path}: must lie inside this checkout (it is mounted)")
        if flag in inner:
            del inner[inner.index(flag):inner.index(flag) + 2]
        inner += [flag, f"/repo/{path.relative_to(root)}"]
    import os

    docker = ["docker", "run", "--rm", *(["--platform", args.platform] if args.platform else []),
              "--user", f"{os.getuid()}:{os.getgid()}",
              "-v", f"{root}:/repo", "-v", f"{args.site.resolve()}:/site:ro", "-w", "/repo",
              "-e", "PYTHONPATH=/repo:/site", args.in_image, "python"]
    if args.rule == "lezo":
        share_programs(args, docker)
    command = [*docker, "experiments/executorch_node.py", *inner]
    print("+", " ".join(command), flush=True)
    raise SystemExit(subprocess.run(command, check=False).returncode)


def share_programs(args: argparse.Namespace, docker: list[str]) -> None:
    """Let the image's node find the forward programs exported here: a node keeps them in a
    folder named by the model, the shapes and the torch and ExecuTorch releases
    (:func:`fedcybgd.model.block_programs.runtime_key`), and the image's torch build is named
    differently (PyPI's aarch64 wheel has no ``+cpu``). The program files do not depend on the
    torch that exported them, only on ExecuTorch's format, so each folder exported here is
    linked under the image's name."""
    script = ("import torch; from importlib.metadata import version; "
              "print(torch.__version__, version('executorch'))")
    versions = subprocess.run([*docker, "-c", script], capture_output=True, text=True, check=True)
    torch_version, et_version = versions.stdout.split()[-2:]
    for folder in sorted(args.programs.glob(f"*-{args.batch}x{args.seq}-torch*-et*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        name = f"{folder.name.split('-')[0]}-{args.batch}x{args.seq}-torch{torch_version}" \
            f"-et{et_version}"
        link = folder.with_name(name)
        if not link.exists():
            link.symlink_to(folder.name)
            print(f"linked {link.name} -> {folder.name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--block", default="layer.3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--programs", type=Path, default=Path("outputs/executorch-programs"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "executorch")
    parser.add_argument("--child", choices=("export", "eager", "executorch"))
    parser.add_argument("--rule", choices=("fo", "lezo"), default="fo")
    parser.add_argument("--tag", default="", help="result file node[-RULE]-TAG.json")
    parser.add_argument("--in-image", default="", help="run inside this node image (docker)")
    parser.add_argument("--platform", default="", help="the image's platform, e.g. linux/arm64")
    parser.add_argument("--site", type=Path, default=None,
                        help="ExecuTorch's wheels unpacked for the image's platform")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite table.md from the JSONs in --out")
    args = parser.parse_args()
    if args.report_only:
        write_table(args.out)
        return
    if args.in_image:
        in_image(args)
        return
    if args.child == "export":
        print(json.dumps(export(args)))
        return
    if args.child:
        print(json.dumps(train(args.child, args)))
        return
    exported = child("export", args)
    runs = [child(mode, args) for _ in range(args.repeats) for mode in ("eager", "executorch")]
    summary = {}
    for mode in ("eager", "executorch"):
        mine = [r for r in runs if r["mode"] == mode]
        steps = [s for r in mine for s in r["step_s"][1:]]
        summary[mode] = {"median_step_s": statistics.median(steps),
                         "min_step_s": min(steps), "max_step_s": max(steps),
                         "first_step_s": [r["step_s"][0] for r in mine],
                         "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
                         "native_libraries_mb": mine[0]["native_libraries_mb"]}
        if mode == "executorch":
            summary[mode]["estimate_mb"] = max(r["estimate_mb"] for r in mine)
            summary[mode]["planned_mb"] = mine[0]["planned_mb"]
    from importlib.metadata import version

    result = {"machine": f"{platform.machine()}, {platform.python_version()}, torch "
                         f"{torch.__version__}, executorch {version('executorch')}",
              "time": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python experiments/executorch_node.py " + " ".join(sys.argv[1:]),
              "args": {k: str(v) for k, v in vars(args).items()}, "export": exported,
              "bindings_need_torch": bindings_need_torch(), "installed_mb": installed_mb(),
              "side_by_side": summary, "trained_block": compare(args), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "node" + ("" if args.rule == "fo" else f"-{args.rule}") + \
        (f"-{args.tag}" if args.tag else "") + ".json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    write_table(args.out)


def write_table(out: Path) -> None:
    """``table.md``: the side-by-side runs of every rule measured (``node*.json``)."""
    lines = ["# A SmolLM2 block through ExecuTorch against eager PyTorch, side by side", "",
             "Command: `.venv-executorch/bin/python experiments/executorch_node.py [--rule "
             "lezo] [--batch B --seq S] [--in-image IMAGE --platform linux/arm64 ...]` (each "
             "row's command in its JSON beside this file; aarch64 rows ran under qemu, their "
             "seconds are emulation's). Seconds a step: `fo` the median after "
             "the first, `lezo` the median over runs of a round's seconds over its steps (a step "
             "is two forwards); peak RSS: the process's; estimate: what a node's memory budget "
             "is held to; planned: the program's memory plan; libraries: the size on disk of the "
             "torch and ExecuTorch native libraries the process mapped.", "",
             "| rule | block, tokens | machine | trainer | s a step | peak RSS MB | estimate MB "
             "| planned MB | torch libs MB | ExecuTorch libs MB | trained block vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(out.glob("node*.json")):
        result = json.loads(path.read_text())
        a = result["args"]
        rule = a.get("rule", "fo")
        for mode, row in result["side_by_side"].items():
            libs = row.get("native_libraries_mb", {})

            def mb(value: float | None) -> str:
                return "-" if value is None or math.isnan(value) else f"{value:,.0f}"

            lines.append(
                f"| {rule} | {a['block']}, {a['batch']} x {a['seq']} | "
                f"{result['machine'].split(',')[0]} | {mode} | {row['median_step_s']:.1f} | "
                f"{row['peak_rss_mb']:,.0f} | {mb(row.get('estimate_mb'))} | "
                f"{mb(row.get('planned_mb'))} | "
                f"{libs.get('torch', math.nan):.0f} | {libs.get('executorch', math.nan):.0f} | "
                f"{result['trained_block']['relative_l2_of_change_difference']:.1e} of its "
                "change |")
    needs = {}
    for path in sorted(out.glob("node*.json")):
        result = json.loads(path.read_text())
        for binding, libraries in result.get("bindings_need_torch", {}).items():
            needs[(result["machine"].split(",")[0], binding)] = libraries
    installs = {}
    for path in sorted(out.glob("node*.json")):
        result = json.loads(path.read_text())
        if "installed_mb" in result:
            installs[result["machine"].split(",")[0]] = result["installed_mb"]
    if installs:
        lines += ["", "Installed size of the packages a node training through ExecuTorch needs: " +
                  "; ".join(f"{machine}: torch {mb['torch']:,.0f} MB, ExecuTorch "
                            f"{mb['executorch']:,.0f} MB" for machine, mb in sorted(
                                installs.items())) + "."]
    if needs:
        lines += ["", "Torch libraries the runtime's Python bindings load (`ldd`), so a node "
                  "training through them needs torch installed: " + "; ".join(
                      f"{machine} `{binding}`: {', '.join(libs) or 'none'}"
                      for (machine, binding), libs in sorted(needs.items())) + "."]
    (out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
