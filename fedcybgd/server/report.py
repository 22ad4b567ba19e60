"""Human-readable progress lines and the final table (rich), printed by the ServerApp.

Sizes are in MiB (2**20 bytes), as ``fedcybgd report`` shows them: traffic from the byte
counts, memory from the ``*_mem_mb`` figures, which are MiB too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

_console = Console(highlight=False, soft_wrap=True)


def _mib(value: float | int | None) -> str:
    """A byte count in MiB."""
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def print_progress(record: dict[str, Any], total_rounds: int) -> None:
    """One line per round: a bar, the blocks trained, loss, bytes and eval when there is one."""
    done = int(record["round"])
    width = 20
    filled = round(width * done / total_rounds)
    bar = "█" * filled + "·" * (width - filled)
    parts = [
        f"[{bar}] round {done}/{total_rounds}",
        f"blocks {','.join(record.get('blocks', [])) or '-'}",
        f"loss {record['train_loss']:.4f}" if record.get("train_loss") is not None else "loss -",
        f"down {_mib(record['bytes_down'])} up {_mib(record['bytes_up'])}",
        f"mem {record['client_peak_mem_mb']:.0f} MiB",
        f"{record['round_s']:.1f} s",
    ]
    if record.get("eval_accuracy") is not None:
        examples = record.get("eval_examples")
        parts.append(f"eval acc {record['eval_accuracy']:.3f} loss {record['eval_loss']:.4f}"
                     + (f" ppl {record['eval_perplexity']:.2f}"
                        if record.get("eval_perplexity") is not None else "")
                     + (f" on {examples} examples" if examples is not None else ""))
        if record.get("eval_reference_loss") is not None:
            parts.append(f"reference loss {record['eval_reference_loss']:.4f}")
    if record.get("failed_blocks"):
        parts.append(f"re-queued {','.join(record['failed_blocks'])}")
    _console.print(" | ".join(parts))


def print_summary_table(summary: dict[str, Any]) -> None:
    """The closing table of a run."""
    name = {"fedavg": "FedAvg", "pipeline": "Pipeline"}.get(summary.get("strategy", ""),
                                                           "FedCyBGD")
    table = Table(title=f"{name} on {summary['model']} ({summary['update_rule']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    evaluated = _evaluated(summary)
    first, last = (evaluated[0], evaluated[-1]) if evaluated else ({}, {})
    # a language-modelling run's accuracy is its next-token accuracy
    accuracy = "eval next-token accuracy" if "eval_tokens" in last else "eval accuracy"
    table.add_row(f"{accuracy} before", f"{summary['initial_eval_accuracy']:.3f}")
    table.add_row(f"{accuracy} after", f"{summary['final_eval_accuracy']:.3f}")
    table.add_row("eval loss before", f"{summary['initial_eval_loss']:.4f}")
    table.add_row("eval loss after", f"{summary['final_eval_loss']:.4f}")
    for key, name, form in (("eval_perplexity", "eval perplexity", ".2f"),
                            ("eval_reference_loss", "reference loss (forgetting)", ".4f")):
        if first.get(key) is not None and last.get(key) is not None:
            table.add_row(f"{name} before", f"{first[key]:{form}}")
            table.add_row(f"{name} after", f"{last[key]:{form}}")
    if summary.get("eval_examples") is not None:
        table.add_row("eval examples", str(summary["eval_examples"]))
    table.add_row("rounds", str(summary["rounds"]))
    for way in ("down", "up"):  # weights have an fp32 size to compare; activations do not
        raw = summary.get(f"bytes_{way}_raw")
        table.add_row(f"bytes {way} (sent / as fp32)" if raw else f"bytes {way}",
                      f"{_mib(summary[f'bytes_{way}'])}" + (f" / {_mib(raw)}" if raw else ""))
    table.add_row("client peak memory", f"{summary['client_peak_mem_mb']:.0f} MiB")
    if summary.get("dp"):  # the privacy spent, as summary.json and privacy.json record it
        epsilon, delta = summary.get("dp_epsilon"), summary.get("dp_delta")
        table.add_row(f"dp epsilon ({summary['dp']})",
                      ("-" if epsilon is None else f"{float(epsilon):.3g}")
                      + ("" if delta is None else f" at delta {float(delta):g}"))
    if summary.get("mean_round_s") is not None:
        table.add_row("mean round time", f"{summary['mean_round_s']:.1f} s")
    table.add_row("outputs", summary["output_dir"])
    _console.print(table)
    samples = summary.get("final_samples") or []
    if samples:
        answers = Table(title="Sample answers after training (samples/ has every evaluation's)")
        for column in ("prompt", "reference", "answer"):
            answers.add_column(column, overflow="fold")
        for sample in samples:
            answers.add_row(*(_short(str(sample.get(k, ""))) for k in
                              ("prompt", "reference", "answer")))
        _console.print(answers)


def _evaluated(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The evaluated rows of the run's ``metrics.jsonl`` (none when it is not there)."""
    path = Path(str(summary.get("output_dir", ""))) / "metrics.jsonl"
    if not summary.get("output_dir") or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("eval_loss") is not None]


def _short(text: str, limit: int = 160) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 1] + "…"
