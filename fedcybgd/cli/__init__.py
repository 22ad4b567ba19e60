"""``fedcybgd``: the app's command line, in the style of Flower's ``flwr``.

    fedcybgd run [APP] [SUPERLINK] [--run-config ...] [--federation-config ...]
    fedcybgd node --superlink HOST:PORT --root-certificates CA --auth-key KEY [...]
    fedcybgd export DIR --gguf OUT.gguf [--type f16]
    fedcybgd export MODEL --executorch OUT_DIR [--layers-per-block 1] [--block NAME]
                    [--program fo|forward]
    fedcybgd report OUTPUT_DIR [OUTPUT_DIR ...]
    fedcybgd plots OUTPUT_DIR
    fedcybgd demo | certs | deploy-local | gateway [their own flags; --help]
    fedcybgd config-docs [PATH] [--check]

``run`` wraps ``flwr run APP SUPERLINK --stream`` and, unlike it, exits non-zero when the run
did not finish ``finished:completed`` (see :mod:`fedcybgd.cli.launch`). ``config-docs`` writes
the configuration reference's tables from the typed fields (see :mod:`fedcybgd.cli.reference`).
``node`` checks a node's files and settings and runs it as a SuperNode (see
:mod:`fedcybgd.cli.node`); ``export`` writes a run's model as GGUF
(:mod:`fedcybgd.model.export`), or each block's training step as an ExecuTorch program
(:mod:`fedcybgd.model.block_programs`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fedcybgd.cli import node
from fedcybgd.cli.launch import EXIT_CODES, Launch, launch
from fedcybgd.config import RunConfig
from fedcybgd.core.registry import resolve


def build_parser() -> argparse.ArgumentParser:
    """The ``fedcybgd`` argument parser and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="fedcybgd",
        description="Federated full-parameter fine-tuning of LLMs (FedCyBGD) on Flower.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run(commands)
    node.add_parser(commands)
    _add_export(commands)
    docs = commands.add_parser(
        "config-docs",
        help="Write the configuration reference's key tables from the typed fields.",
        description=(
            "Regenerate the tables of the configuration reference (every run-config, "
            "update-rule option and node-config key with its default, range and meaning) "
            "from the fields that declare them; the prose around them is kept."
        ),
    )
    docs.add_argument("path", nargs="?", default=None, metavar="PATH",
                      help="The reference to update (default: docs/configuration.md).")
    docs.add_argument("--check", action="store_true",
                      help="Write nothing; exit 1 when the file is not current.")
    for name, text in (("report", "Print the summaries of one or several runs side by side."),
                       ("plots", "Draw a run's plots.png again from its metrics.jsonl.")):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("folders", nargs="+" if name == "report" else 1, metavar="OUTPUT_DIR",
                         help="A run's output-dir (holding summary.json / metrics.jsonl).")
    for name, (_, text) in DELEGATED.items():
        sub = commands.add_parser(name, help=text, add_help=False,
                                  description=f"{text} (`fedcybgd {name} --help` for its flags)")
        sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _add_run(commands: Any) -> None:
    """``fedcybgd run``: flwr run with a checked exit."""
    run = commands.add_parser(
        "run",
        help="Run the app (flwr run --stream) and exit non-zero unless the run completed.",
        description=(
            "Run a Flower App with `flwr run APP SUPERLINK --stream`, print its log as it "
            "comes, then read the run's final status (`flwr ls --run-id`). Unlike `flwr run`, "
            "the exit status tells whether the run completed; a failed or refused run prints "
            "the line that says why and where the full log is. On the local simulation it uses "
            "this environment's own SuperLink, takes a relative output-dir from the folder it "
            "is typed in (a run without output-dir whose default folder is taken gets a fresh "
            "one), and refuses a run that needs more nodes than the simulation starts."
        ),
        epilog="exit status: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES),
    )
    run.add_argument("app", nargs="?", default=".",
                     help="The Flower App directory to run (default: .).")
    run.add_argument("superlink", nargs="?", default=None,
                     help="The SuperLink connection to use (default: the Flower "
                          "configuration's default, e.g. 'local').")
    run.add_argument("-c", "--run-config", action="append", default=[], metavar="TEXT",
                     help="Override run configuration values: '<k1>=<v1> <k2>=<v2>' or a "
                          "TOML file; may be given more than once (passed to flwr run).")
    run.add_argument("--federation-config", action="append", default=[], metavar="TEXT",
                     help="Override federation configuration values, e.g. "
                          "'num-supernodes=8' (passed to flwr run).")
    run.add_argument("--federation", default=None, metavar="TEXT",
                     help="The federation to submit the run to, '@<account>/<name>' "
                          "(passed to flwr run).")
    run.add_argument("--log-dir", default=None, metavar="DIR",
                     help="Where the run's full log is saved as run-<run-id>.log "
                          "(default: $FLWR_HOME/fedcybgd-logs).")
    run.add_argument("--stop-on-interrupt", action="store_true",
                     help="On Ctrl-C, stop the submitted run too (`flwr stop`); without it "
                          "the run goes on, as with `flwr run`.")


def _add_export(commands: Any) -> None:
    """``fedcybgd export``: a run's model as one GGUF file."""
    export = commands.add_parser(
        "export",
        help="Write a trained model (a run's output-dir, or its final/) as one GGUF file.",
        description=(
            "Write a run's model (its output-dir, whose final/ holds the model, or any Hugging "
            "Face model folder) as GGUF, the file llama.cpp-"
            "class runtimes load on a device: hyperparameters, the tokenizer with its chat "
            "template, and the weights at the chosen type. Families: llama (SmolLM2), "
            "mistral, qwen2. Every tensor is checked first (present, with the config's shape; "
            "finite; within what the type stores): a checkpoint that fails is refused in one "
            "line naming the tensor (exit status 2) and no file is written."
        ),
    )
    export.add_argument("folder", metavar="DIR", help="A run's output-dir (its final/ is "
                        "exported, e.g. outputs/demo) or a model folder (e.g. "
                        "outputs/demo/final).")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--gguf", metavar="OUT", help="The GGUF file to write.")
    target.add_argument("--executorch", metavar="OUT_DIR", help=(
        "Write each block's training step as an ExecuTorch program instead: OUT_DIR/<block>.pte "
        "(the model with the language-modelling loss and the block's backward, every weight "
        "outside it), <block>.ptd (its weights) and manifest.json (model, block, shapes, the "
        "program's checksum, the weights' base hash); with --program forward, "
        "<block>.forward.pte (the loss with the block's tensors as inputs, for lezo and mezo). "
        "DIR may also be a built-in model name (e.g. smollm2-135m). Needs ExecuTorch "
        "(`make executorch`)."))
    export.add_argument("--type", default="f16", choices=("f32", "f16", "q8_0", "q4_1"),
                        help="GGUF weight type: f32, f16 (default), q8_0 or q4_1 (1-D tensors "
                             "stay f32).")
    defaults = RunConfig()
    export.add_argument("--layers-per-block", type=int, default=defaults.layers_per_block,
                        help="ExecuTorch: the run's layers-per-block.")
    export.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="ExecuTorch: the run's batch-size (the program's batch).")
    export.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len,
                        help="ExecuTorch: the run's max-seq-len (the program's window).")
    export.add_argument("--block", action="append", metavar="NAME",
                        help="ExecuTorch: export only this block (repeatable; default: all).")
    export.add_argument("--program", action="append", metavar="KIND",
                        help="ExecuTorch: fo (the block's training step, for update-rule fo) "
                             "or forward (its loss with the block's tensors as inputs, for "
                             "lezo and mezo); repeatable; default: fo.")


# Commands that are their own module's command line: name -> (module, what it does)
DELEGATED: dict[str, tuple[str, str]] = {
    "demo": ("fedcybgd.cli.demo", "Run the demo: a simulated federation that fine-tunes "
                                  "SmolLM2 and reports what it gained."),
    "certs": ("fedcybgd.deploy.certs", "Make a CA, a server certificate and SuperNode keys."),
    "deploy-local": ("fedcybgd.deploy.local", "A SuperLink and SuperNodes on 127.0.0.1, a "
                                              "run through them (TLS and node auth with --tls)."),
    "gateway": ("fedcybgd.deploy.gateway", "The Fleet gateway: the Fleet API alone on the "
                                           "nodes' address, over TLS."),
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:  # its own flags, --help included, go to its module
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "config-docs":
        return _config_docs(args.path, args.check)
    if args.command == "node":
        return node.run(args)
    if args.command == "export" and args.executorch:
        return _export_executorch(args)
    if args.command == "export":
        return _export(args.folder, args.gguf, args.type)
    if args.command in ("report", "plots"):
        from pathlib import Path

        from fedcybgd.cli import outputs

        folders = [Path(f) for f in args.folders]
        return outputs.report(folders) if args.command == "report" else outputs.plots(folders[0])
    if args.command in DELEGATED:
        return _delegate(args.command, args.rest)
    if args.command != "run":
        parser.error(f"unknown command {args.command!r}")
    return launch(Launch(app=args.app, superlink=args.superlink, run_config=args.run_config,
                         federation_config=args.federation_config, federation=args.federation,
                         log_dir=args.log_dir, stop_on_interrupt=args.stop_on_interrupt))


def _delegate(name: str, argv: list[str]) -> int:
    main = resolve(f"{DELEGATED[name][0]}:main")
    program, sys.argv[0] = sys.argv[0], f"fedcybgd {name}"  # the module's parser's name
    try:
        return int(main(argv) or 0)
    finally:
        sys.argv[0] = program


def _config_docs(path: str | None, check: bool) -> int:
    from pathlib import Path

    from fedcybgd.cli import reference

    target = Path(path) if path else reference.DEFAULT_PATH
    try:
        current = reference.write(target, check=check)
    except (OSError, reference.ReferenceError) as err:
        print(f"fedcybgd config-docs: {target}: {err}")
        return 2
    if check and not current:
        print(f"{target} is not current; run `fedcybgd config-docs {target}`")
        return 1
    print(f"{target}: {'current' if current else 'updated'}")
    return 0


def _export_executorch(args: Any) -> int:
    """``fedcybgd export --executorch``: the block programs of a model (a built-in name, a model
    folder, or a run's output-dir whose ``final/`` is one). A refusal is one line on stderr and
    exit status 2."""
    from pathlib import Path

    from fedcybgd.model.block_programs import ExecuTorchError, export_programs

    if args.type != "f16":
        print("fedcybgd export: --type is the GGUF file's weight type; the ExecuTorch programs "
              "read fp32 weights", file=sys.stderr)
        return 2
    source = args.folder
    if (Path(source) / "final" / "config.json").is_file():
        source = str(Path(source) / "final")
    try:
        written = export_programs(source, Path(args.executorch), args.layers_per_block,
                                  args.batch_size, args.max_seq_len, args.block,
                                  tuple(args.program or ("fo",)))
    except (ExecuTorchError, OSError, ValueError) as err:
        print(f"fedcybgd export: {err}", file=sys.stderr)
        return 2
    for entry in written:
        size = (Path(args.executorch) / entry.program).stat().st_size
        what = "trainable" if entry.kind == "fo" else "input"
        print(f"{Path(args.executorch) / entry.program}: {size / 1024:.0f} KiB, block "
              f"{entry.block}, {len(entry.trainable)} {what} tensors, batch "
              f"{entry.batch} x {entry.seq}")
    return 0


def _export(folder: str, out: str, kind: str) -> int:
    """``fedcybgd export``: ``folder`` is a model folder, or a run's output-dir whose
    ``final/`` is one. A refused or failed export is one line on stderr and exit status 2, with
    no file left behind (see :func:`fedcybgd.model.export.export_gguf`)."""
    from pathlib import Path

    from fedcybgd.model.export import ExportError, export_gguf

    source = Path(folder)
    if not (source / "config.json").is_file() and (source / "final" / "config.json").is_file():
        source = source / "final"  # a run's output-dir: its model
    if not (source / "config.json").is_file() and (source / "summary.json").is_file():
        print(f"fedcybgd export: {source} is a run's output-dir without a final/ model (a "
              "failed or unfinished run leaves none: its summary.json has the status)",
              file=sys.stderr)
        return 2
    if not (source / "config.json").is_file():
        print(f"fedcybgd export: {source} holds no model (no config.json, nor a final/ with "
              "one); give a run's output-dir or its final/ folder", file=sys.stderr)
        return 2
    try:
        written = export_gguf(source, Path(out), kind)
    except (ExportError, OSError) as err:
        print(f"fedcybgd export: {err}", file=sys.stderr)
        return 2
    print(f"{written}: {written.stat().st_size / 2**20:.1f} MiB, {kind}")
    return 0
