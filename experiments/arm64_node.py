"""An arm64 SuperNode in a federated run: the node image built for linux/arm64, side by side with
the same image for this machine's architecture.

Each case is a real deployment (:func:`fedcybgd.deploy.local.run_deployment`): a SuperLink and a
Fleet gateway on 127.0.0.1 with TLS and SuperNode authentication, one SuperNode in a container of
the image (``docker run --platform ... --network host``; on an x86 machine qemu's binfmt handler
runs the arm64 one), the app submitted with ``flwr run``. While the node runs, the script asks the
node's container for ``platform.machine()``; after the run it reads the run's ``metrics.jsonl``:
the node's peak RSS while it handled a round (``client_peak_mem_mb``), its training seconds
(``client_train_s``) and the round's wall time.

    scripts/prepare-docker-offline.sh --install --platform linux/arm64   # the arm64 image (long)
    scripts/prepare-docker-offline.sh                                    # the x86 image
    python experiments/arm64_node.py                      # every case; `--resume` keeps done ones
    python experiments/arm64_node.py --only smollm2-lezo  # one case

Under emulation the arm64 times are those of qemu on this machine, not of a board: compare them
with each other (arm64 / x86 ratios), never as a Raspberry Pi's speed. The RSS is the node's own
and does not depend on the emulation.

Results: printed, and saved to ``experiments/results/arm64/results.json`` and ``table.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fedcybgd.deploy.commands import format_config
from fedcybgd.deploy.local import QUICK_RUN_CONFIG, NodeContainer, run_deployment

RESULTS = Path(__file__).resolve().parent / "results" / "arm64"
IMAGES = {"linux/arm64": "fedcybgd:0.1.0-arm64", "linux/amd64": "fedcybgd:0.1.0"}
# case -> run config. SmolLM2 (its real weights) for one round per rule, kept small. The tiny
# random Llama cannot federate across architectures as "tiny-llama": its random
# initialisation differs between x86 and arm64 builds of torch, and the server refuses the node
# by its pretrained checksum (the "tiny-*" cases show it). The "saved-tiny-*" cases save it
# once, on this machine, into the deployment's state folder (which the node's container sees
# at the same path) and run with that folder as the model: the same weights on both sides, and
# an emulated round in minutes.
SMALL = {"num-server-rounds": 1, "eval-examples": 16, "local-steps": 1, "batch-size": 4,
         "max-seq-len": 32}
SAVED_TINY = "<saved tiny-llama>"  # replaced by the folder run_case saves it in
CASES: dict[str, dict[str, object]] = {
    "smollm2-fo": {**SMALL, "update-rule": "fo"},
    "smollm2-zerolock": {**SMALL, "update-rule": "zerolock"},
    "smollm2-lezo": {**SMALL, "update-rule": "lezo", "local-steps": 2},
    "tiny-fo": {**QUICK_RUN_CONFIG, "update-rule": "fo"},
    "tiny-zerolock": {**QUICK_RUN_CONFIG, "update-rule": "zerolock"},
    "tiny-lezo": {**QUICK_RUN_CONFIG, "update-rule": "lezo"},
    "saved-tiny-fo": {**QUICK_RUN_CONFIG, "model": SAVED_TINY, "update-rule": "fo"},
    "saved-tiny-zerolock": {**QUICK_RUN_CONFIG, "model": SAVED_TINY, "update-rule": "zerolock"},
    "saved-tiny-lezo": {**QUICK_RUN_CONFIG, "model": SAVED_TINY, "update-rule": "lezo"},
    # The smoke test's case (tests/deploy/test_arm64_node.py, `make test-arm64`): one round of `fo`.
    "smoke": {**QUICK_RUN_CONFIG, "model": SAVED_TINY, "update-rule": "fo",
              "num-server-rounds": 1},
}
DEFAULT_CASES = ("saved-tiny-fo", "saved-tiny-zerolock", "saved-tiny-lezo", "smollm2-lezo")


def save_tiny(folder: Path) -> Path:
    """The tiny random Llama and its tokenizer, saved as a Hugging Face folder."""
    from fedcybgd.model.loading import load_model, load_tokenizer

    if not (folder / "model.safetensors").is_file():
        load_model("tiny-llama").save_pretrained(folder)
        load_tokenizer("tiny-llama").save_pretrained(folder)
    return folder


def _ask_machine(node: NodeContainer, state: Path, found: dict[str, str],
                 stop: threading.Event) -> None:
    """Poll the node's container until it answers ``platform.machine()``."""
    name = node.name_for(state, "supernode-1")
    while not stop.is_set():
        out = subprocess.run(
            [node.docker, "exec", name, "python", "-c",
             "import platform, torch; print(platform.machine(), torch.__version__)"],
            capture_output=True, text=True, timeout=300, check=False)
        if out.returncode == 0 and out.stdout.strip():
            found["machine"], found["torch"] = out.stdout.split()[:2]
            return
        stop.wait(2.0)


def run_case(case: str, node_platform: str, work: Path) -> dict[str, Any]:
    """One deployment: one node in a container of ``node_platform``'s image."""
    node = NodeContainer(IMAGES[node_platform], platform=node_platform)
    state = Path(tempfile.mkdtemp(prefix="fedcybgd-arm64-state-"))
    found: dict[str, str] = {}
    stop = threading.Event()
    asker = threading.Thread(target=_ask_machine, args=(node, state, found, stop), daemon=True)
    asker.start()
    out = work / f"{case}-{node_platform.split('/')[1]}"
    config = {**CASES[case], "overwrite": True}
    if config.get("model") == SAVED_TINY:
        config["model"] = str(save_tiny(state / "tiny-llama-saved"))
    start = time.monotonic()
    try:
        result = run_deployment(1, format_config(config), out,
                                tls=True, state=state, timeout=7200.0, node_container=node)
    finally:
        stop.set()
        asker.join(timeout=5.0)
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()] if (
        out / "metrics.jsonl").is_file() else []
    trained = [r for r in rows if r.get("round", 0) >= 1 and r.get("update_rule")]
    return {
        "case": case, "platform": node_platform, "image": node.image,
        "status": result.status, "reason": result.reason,
        "node_machine": found.get("machine", "?"), "node_torch": found.get("torch", "?"),
        "rules": sorted({rule for r in trained for rule in r["update_rule"]}),
        "rounds": len(trained),
        "client_peak_mem_mb": max((r["client_peak_mem_mb"] for r in trained), default=None),
        "client_train_s": [round(r["client_train_s"], 3) for r in trained],
        "round_s": [round(r["round_s"], 1) for r in trained],
        "wall_s": round(wall, 1),
        "host": platform.machine(),
    }


def table(results: list[dict[str, Any]]) -> str:
    """The side-by-side table: each case on arm64 and on this machine's architecture."""
    lines = ["| case | node platform | node machine | status | rules | client peak MB "
             "| train s per round | round s | arm64 / x86 train time |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["case"], r["platform"]): r for r in results}
    for r in results:
        mean = sum(r["client_train_s"]) / max(1, len(r["client_train_s"]))
        ratio = ""
        other = by.get((r["case"], "linux/amd64"))
        if r["platform"] == "linux/arm64" and other and other["client_train_s"]:
            x86 = sum(other["client_train_s"]) / len(other["client_train_s"])
            ratio = f"{mean / x86:.1f}x" if x86 > 0 else ""
        peak = r["client_peak_mem_mb"]
        lines.append(
            f"| {r['case']} | {r['platform']} | {r['node_machine']} | {r['status']} "
            f"| {', '.join(r['rules'])} | {peak:,.0f} | {mean:.2f} "
            f"| {', '.join(str(s) for s in r['round_s'])} | {ratio} |" if peak is not None else
            f"| {r['case']} | {r['platform']} | {r['node_machine']} | {r['status']} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="",
                        help=f"comma-separated cases of {', '.join(CASES)} (default: "
                             f"{', '.join(DEFAULT_CASES)})")
    parser.add_argument("--platforms", default="linux/arm64,linux/amd64")
    parser.add_argument("--resume", action="store_true", help="keep cases already saved")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cases = [c for c in args.only.split(",") if c] or list(DEFAULT_CASES)
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {sorted(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    results: list[dict[str, Any]] = json.loads(saved.read_text()) if saved.is_file() else []
    done = {(r["case"], r["platform"]) for r in results if r["status"] == "finished:completed"}
    work = Path(tempfile.mkdtemp(prefix="fedcybgd-arm64-"))
    for case in cases:
        for node_platform in args.platforms.split(","):
            if args.resume and (case, node_platform) in done:
                print(f"--- {case} on {node_platform}: done before, kept", flush=True)
                continue
            print(f"--- {case} on {node_platform}", flush=True)
            row = run_case(case, node_platform, work)
            print(json.dumps(row), flush=True)
            results = [r for r in results if (r["case"], r["platform"]) != (case, node_platform)]
            results.append(row)
            saved.write_text(json.dumps(results, indent=1) + "\n")
    order = {c: i for i, c in enumerate(CASES)}
    results.sort(key=lambda r: (order.get(r["case"], 99), r["platform"]))
    text = table(results)
    (args.out / "table.md").write_text(
        "# An arm64 SuperNode beside an x86 one\n\n"
        "Command: `python experiments/arm64_node.py` (images from "
        "`scripts/prepare-docker-offline.sh [--platform linux/arm64]`); host "
        f"{platform.machine()}. arm64 runs under qemu emulation: its times are relative "
        "figures, not a board's.\n\n" + text)
    print(text)
    return 0 if all(r["status"] == "finished:completed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
