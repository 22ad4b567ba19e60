"""The output-folder rule every strategy follows (FedCyBGD and the FedAvg baselines).

A run never starts over another run's outputs by accident: a non-empty ``output-dir`` is used
only with ``resume = true`` (continue that run) or ``overwrite = true`` (replace its outputs),
and nothing is removed without a log line naming it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from fedcybgd.config import ConfigError
from fedcybgd.core.atomic import fsync_dir, make_dirs, write_bytes
from fedcybgd.server.output_dir import earlier_outputs, name_entries, output_dir_refusal

log = logging.getLogger(__name__)

# What a run writes in its output folder; ``overwrite = true`` removes these and nothing else.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoint", "final", "samples")


class OutputDirError(ConfigError):
    """The output folder holds another run's outputs and the run config does not say what to do."""


def check_output_dir(out: Path, resume: bool, overwrite: bool, can_resume: bool) -> None:
    """Check ``out`` against the output rule, changing nothing (a runner checks at once, and
    creates the folder with :func:`prepare_output_dir` once its nodes are there, so a run that
    fails at its start leaves no folder behind). Parameters and errors as
    :func:`prepare_output_dir`'s."""
    refusal = output_dir_refusal(out, resume, overwrite)
    if refusal is not None:
        raise OutputDirError(refusal)
    entries = earlier_outputs(out)
    if entries and resume and not can_resume:
        raise OutputDirError(
            f"output-dir {out} holds earlier outputs ({name_entries(entries)}) and this "
            "strategy keeps no checkpoint, so resume = true cannot continue that run: set "
            "overwrite = true to replace them, or choose another output-dir"
        )


def prepare_output_dir(out: Path, resume: bool, overwrite: bool, can_resume: bool) -> None:
    """Check ``out`` against the output rule, clear it for ``overwrite``, and create it.

    Parameters
    ----------
    out : Path
        The run's output folder.
    resume, overwrite : bool
        The run config's ``resume`` and ``overwrite``.
    can_resume : bool
        Whether the strategy checkpoints (FedCyBGD) or not (the FedAvg baselines).

    Raises
    ------
    OutputDirError
        ``out`` holds entries besides the launcher's logs and neither key allows using it, or
        both keys are set, or ``resume`` is asked of a strategy that keeps no checkpoint.
    """
    check_output_dir(out, resume, overwrite, can_resume)
    log.info("outputs: %s", out)
    entries = earlier_outputs(out)
    if not entries:
        if resume and not can_resume:
            log.info("resume = true, but this strategy keeps no checkpoint and %s holds no "
                     "outputs: starting fresh", out)
        make_dirs(out)
        return
    if resume:  # a strategy that keeps no checkpoint was refused above
        return
    for path in entries:
        if path.name not in RUN_OUTPUTS:
            log.warning("overwrite = true: leaving %s in place (not an output of a run)", path)
            continue
        if path.is_dir() and not path.is_symlink():
            count = sum(1 for p in path.rglob("*") if not p.is_dir())
            log.warning("overwrite = true: removing %s (%d files)", path, count)
            shutil.rmtree(path)
        else:
            log.warning("overwrite = true: removing %s", path)
            path.unlink()
    fsync_dir(out)


def remove_final(final_dir: Path) -> None:
    """Remove ``final_dir`` (a failed run's folder must not hold a model that looks like its
    result; an earlier attempt may have left one), with a log line naming it."""
    if final_dir.is_dir() and not final_dir.is_symlink():
        log.warning("the run failed: removing %s (not a result of this run)", final_dir)
        shutil.rmtree(final_dir)
    elif final_dir.exists() or final_dir.is_symlink():
        log.warning("the run failed: removing %s (not a result of this run)", final_dir)
        final_dir.unlink()


def write_model_card(final_dir: Path, summary: dict[str, Any]) -> Path:
    """``final/README.md``: what the model is and how it was made, from the run's summary
    (base model, method and rule, rounds, data, what crossed the wire, the clients' peak
    memory, the evaluation before and after, and the privacy spent when DP was on)."""
    run = summary.get("run_config", {})
    strategy = summary.get("strategy", "fedcybgd")
    rule = summary.get("update_rule")
    method = {
        "fedavg": f"FedAvg over {run.get('fedavg-params', 'full')} parameters (Flower)",
        "pipeline": f"pipeline training over {run.get('pipeline-stages')} nodes, schedule "
                    f"`{run.get('pipeline-schedule')}`",
    }.get(strategy, f"FedCyBGD (cycle block gradient descent), update rule `{rule}`")
    rows = [
        ("base model", f"`{summary.get('model')}`"),
        ("method", method),
        ("rounds", summary.get("rounds_run", summary.get("rounds"))),
        *((("stages (nodes)", run.get("pipeline-stages")),
           ("step: micro-batches x batch", f"{run.get('micro-batches')} x "
                                            f"{run.get('batch-size')}"))
          if strategy == "pipeline" else
          (("nodes per round", run.get("clients-per-round")),
           ("local steps x batch", f"{run.get('local-steps')} x {run.get('batch-size')}"))),
        ("task / data", f"`{run.get('task')}` / `{run.get('dataset')}` "
                        f"(partitioner `{run.get('partitioner')}`)"),
        ("seed", run.get("seed")),
        ("bytes down / up (payloads)", f"{_mb(summary.get('bytes_down'))} / "
                                       f"{_mb(summary.get('bytes_up'))}"),
        ("client peak memory", f"{summary.get('client_peak_mem_mb', 0):.0f} MB"),
        ("eval loss before -> after", f"{_num(summary.get('initial_eval_loss'))} -> "
                                      f"{_num(summary.get('final_eval_loss'))}"),
        ("eval metric before -> after", f"{_num(summary.get('initial_eval_accuracy'))} -> "
                                        f"{_num(summary.get('final_eval_accuracy'))}"),
    ]
    if summary.get("dp"):
        rows.append(("differential privacy",
                     f"`{summary['dp']}`: epsilon {_num(summary.get('dp_epsilon'))} at delta "
                     f"{summary.get('dp_delta')} ({summary.get('dp_accounting')})"))
    else:
        rows.append(("differential privacy", "off"))
    lines = ["# Model card", "",
             "Trained by fedcybgd (federated full-parameter fine-tuning on Flower).", "",
             "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
             "The run's own records sit beside this folder: `summary.json` (every figure above "
             "and the whole run config), `metrics.jsonl` (one row a round).", "",
             "Load it with `AutoModelForCausalLM.from_pretrained(\"<this folder>\")`; for a "
             "GGUF runtime on a device: `fedcybgd export <this folder> --gguf model.gguf "
             "--type q8_0`.", ""]
    path = final_dir / "README.md"
    write_bytes(path, "\n".join(lines).encode())
    return path


def _mb(value: Any) -> str:
    return f"{float(value or 0) / 2**20:.1f} MiB"


def _num(value: Any) -> str:
    return "-" if value is None else f"{float(value):.4g}"
