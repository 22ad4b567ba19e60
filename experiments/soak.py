"""Fault soak: many nodes, many rounds, hostile nodes, lost/late/corrupted replies, server kills.

The real ServerApp (``run_server``) and ClientApp run in one process over a
:class:`fedcybgd.harness.faults.FaultyGrid` on a tiny model. A share of the nodes is hostile (every
upload is one of :data:`fedcybgd.harness.faults.HOSTILE`); every node's replies may be lost, late or
corrupted; the server is killed at planned rounds at one of three points (while replies
arrive; between the checkpoint's block files and its ``state.json``; after ``state.json`` but
before the metrics row) and restarted with ``resume = true``. Then it checks:

* the run completes, and ``metrics.jsonl`` has exactly one row per round;
* every block version is accounted for: each row's blocks are installed or failed, each
  assignment is accepted or dropped with a reason, and each block's final version is the last
  round that installed it;
* the final model is finite and equals a replay, on a fresh model, of the uploads the server
  says it accepted (decoded and merged here, independently);
* no delivered honest upload was dropped, and no hostile one was accepted (save those the
  server may accept after bounding them, such as a capped example count);
* the server's memory stays bounded (RSS late in the run vs early).

It prints and saves (``results.json`` in ``--out``) nodes, rounds, faults injected by kind,
uploads dropped by reason, resumes, wall time and peak RSS. Usage::

    python experiments/soak.py                 # 100 nodes, 30 rounds (~10 min on 2 cores)
    python experiments/soak.py --nodes 24 --rounds 8 --kills 2   # the test's size
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil
import torch
from flwr.app import Message
from flwr.supercore.task_identity import TaskIdentity

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.compression import decode, payload_from_array, read_header, uses_base
from fedcybgd.config import RunConfig
from fedcybgd.harness.faults import SANITIZED, FaultyGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import configure_logging, run_server
from fedcybgd.strategies.aggregate import weighted_mean
from fedcybgd.strategies.quantized_install import QuantizedInstall

KILL_POINTS = ("while replies arrive", "between block files and state.json",
               "after state.json, before the metrics row")


class ServerKilled(BaseException):
    """Raised at a planned point to stop the server as a crash would."""


class RssSampler:
    """Samples this process's RSS every 0.2 s in a thread."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(0.2)

    def now(self) -> int:
        return int(self.process.memory_info().rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def soak_config(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The run config: a tiny Llama, every block in the cycle, two nodes per block."""
    return {
        "model": "tiny-llama", "partitioner": "iid", "num-server-rounds": args.rounds,
        "clients-per-round": args.clients_per_round, "clients-per-block": 2,
        "layers-per-block": 1, "train-embeddings": True, "train-head": True,
        "update-rule": "fo", "local-steps": 2, "batch-size": 4, "max-seq-len": 48,
        "lr": 1e-3, "eval-every": 10, "eval-examples": 16, "eval-batch-size": 16,
        "output-dir": str(out / "run"), "seed": args.seed,
    }


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak and its checks; returns the figures (raises AssertionError on a failure)."""
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    work = Path(tempfile.mkdtemp(prefix="fedcybgd-soak-"))
    config = soak_config(args, work)
    rng = random.Random(args.seed)
    first_node = 1001
    hostile = set(rng.sample(range(first_node, first_node + args.nodes),
                             max(1, round(args.hostile * args.nodes))))
    grid = FaultyGrid(client_app, args.nodes, config,
                      node_config=lambda i: {"cache-dir": str(work / "cache")},
                      first_node_id=first_node, keep_sent=1, hostile=hostile,
                      lose=args.lose, delay=args.delay, corrupt=args.corrupt, seed=args.seed)
    kill_rounds = sorted(rng.sample(range(2, args.rounds), min(args.kills, args.rounds - 2)))
    # (round, point) in order; a kill whose point its round never reaches (no block file
    # written, say) moves on to the next round
    plan = [(r, KILL_POINTS[i % len(KILL_POINTS)]) for i, r in enumerate(kill_rounds)]
    kills: list[dict[str, Any]] = []
    rss_by_round: dict[int, int] = {}
    current = {"round": 0}

    def kill_if_planned(point: str) -> None:
        if plan and current["round"] >= plan[0][0] and plan[0][1] == point:
            plan.pop(0)
            kills.append({"round": current["round"], "point": point})
            raise ServerKilled(f"killed in round {current['round']} {point}")

    def before_reply(replies: list[Message]) -> None:
        current["round"] = max(grid.delivered)
        rss_by_round[current["round"]] = sampler.now()
        kill_if_planned(KILL_POINTS[0])

    def on_checkpoint_file(path: Path) -> None:
        if path.name == "state.json":
            kill_if_planned(KILL_POINTS[2])
        else:
            kill_if_planned(KILL_POINTS[1])

    grid.before_reply = before_reply
    began = time.perf_counter()
    resumes = 0
    with RssSampler() as sampler:
        while True:
            run = RunConfig.from_run_config(dict(config, resume=resumes > 0))
            try:
                summary = run_server(grid, run, node_wait_s=5.0,
                                     on_checkpoint_file=on_checkpoint_file)
                break
            except ServerKilled as killed:
                print(f"  {killed}; restarting with resume = true", flush=True)
                resumes += 1
    wall = time.perf_counter() - began

    out = Path(config["output-dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checks = check_run(args, config, grid, rows, summary, out)
    early = [rss_by_round[r] for r in sorted(rss_by_round)[2:6]]
    late = [rss_by_round[r] for r in sorted(rss_by_round)[-4:]]
    growth_mb = (statistics.mean(late) - statistics.mean(early)) / 2**20
    assert growth_mb < args.max_rss_growth_mb, f"server RSS grew by {growth_mb:.0f} MB"
    drops: Counter[str] = Counter()
    for row in rows[1:]:
        drops.update(row.get("dropped", {}))
    return {
        "nodes": args.nodes,
        "hostile_nodes": len(hostile),
        "rounds": args.rounds,
        "clients_per_round": args.clients_per_round,
        "faults_injected": dict(sorted(grid.faults.items())),
        "uploads_dropped": dict(sorted(drops.items())),
        "kills": kills,
        "resumes": resumes,
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(sampler.peak / 2**20, 1),
        "rss_growth_mb": round(growth_mb, 1),
        **checks,
    }


def check_run(args: argparse.Namespace, config: dict[str, Any], grid: FaultyGrid,
              rows: list[dict[str, Any]], summary: dict[str, Any], out: Path) -> dict[str, Any]:
    """The soak's assertions (see the module docstring)."""
    assert [r["round"] for r in rows] == list(range(args.rounds + 1)), "one row per round"
    last_install: dict[str, int] = {}
    accepted_uploads = 0
    for row in rows[1:]:
        installed = set(row["accepted"])
        assert installed | set(row["failed_blocks"]) == set(row["blocks"]), row["round"]
        assert not installed & set(row["failed_blocks"]), row["round"]
        taken = sum(len(v) for v in row["accepted"].values())
        assert taken + sum(row["dropped"].values()) == len(row["clients"]), row["round"]
        accepted_uploads += taken
        for block in installed:
            last_install[block] = row["round"]
    versions = summary["block_versions"]
    for block, version in versions.items():
        assert version == last_install.get(block, 0), f"block {block}: version {version}"

    # Replay the accepted uploads on a fresh model, decoding each here.
    run = RunConfig.from_run_config(config)
    model = load_model(run.model)
    blocks = BlockMap(model, run.layers_per_block)
    cap = run.local_steps * run.batch_size
    # installs rounded as install-codec says (the server's own rounding, applied to the mean
    # taken here), each block's rounding carried to its next install; with clients-per-block
    # 2 no block is self-synced, so every install is rounded
    rounding = QuantizedInstall(run.install_spec) if run.install_spec != "none" else None
    replay_version: dict[str, int] = {}
    residuals: dict[str, dict[str, torch.Tensor]] = {}
    honest_dropped, hostile_taken = 0, 0
    for row in rows[1:]:
        attempt = grid.delivered[row["round"]]
        accepted_nodes = {int(n) for nodes in row["accepted"].values() for n in nodes}
        for node, (reply, fault) in attempt.items():
            ok = (reply.has_content() and protocol.STATE in reply.content.config_records
                  and reply.content.config_records[protocol.STATE].get(protocol.STATUS)
                  == protocol.OK)
            if not fault and ok and node not in accepted_nodes:
                honest_dropped += 1
            if fault and node in accepted_nodes and fault not in SANITIZED:
                hostile_taken += 1
        for block in sorted(row["accepted"]):
            start = {k: v.detach().clone() for k, v in blocks.get(model, block).items()}
            uploads = []
            for node in row["accepted"][block]:
                reply, _ = attempt[int(node)]
                payload = payload_from_array(reply.content.array_records[protocol.UPLOAD][block])
                spec = read_header(payload, max_bytes=len(payload)).spec
                tensors = decode(payload, base=start if uses_base(spec) else None,
                                 expect_block=block, max_bytes=len(payload),
                                 expect_shapes={k: tuple(v.shape) for k, v in start.items()}
                                 ).tensors
                examples = float(reply.content.metric_records[protocol.METRICS][
                    protocol.NUM_EXAMPLES])  # type: ignore[arg-type]
                uploads.append((min(examples, cap), tensors))
            merged = weighted_mean(uploads)
            if rounding is not None:
                done = rounding.round(block, start, replay_version.get(block, 0), merged,
                                      row["round"], residuals.get(block))
                merged, residuals[block] = done.tensors, done.residual
            blocks.set(model, block, merged)
            replay_version[block] = row["round"]
    final = load_model(str(out / "final"))
    replayed = dict(model.named_parameters())
    mismatched = [name for name, p in final.named_parameters()
                  if not torch.equal(p.detach(), replayed[name].detach())]
    finite = all(bool(torch.isfinite(p).all()) for p in final.parameters())
    assert finite, "the final model holds NaN or Inf"
    assert not mismatched, f"final model differs from the replay in {mismatched[:5]}"
    assert honest_dropped == 0, f"{honest_dropped} honest uploads were dropped"
    assert hostile_taken == 0, f"{hostile_taken} hostile uploads were accepted"
    return {"accepted_uploads": accepted_uploads, "final_equals_replay": True,
            "final_finite": finite, "honest_uploads_dropped": honest_dropped,
            "hostile_uploads_accepted": hostile_taken,
            "final_eval_loss": summary["final_eval_loss"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients-per-round", type=int, default=8)
    parser.add_argument("--hostile", type=float, default=0.1, help="share of hostile nodes")
    parser.add_argument("--lose", type=float, default=0.08, help="chance a reply is lost")
    parser.add_argument("--delay", type=float, default=0.05, help="chance a reply is late")
    parser.add_argument("--corrupt", type=float, default=0.05, help="chance of flipped bytes")
    parser.add_argument("--kills", type=int, default=6, help="server kills (then resumes)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/soak"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    import logging

    logging.getLogger("fedcybgd").setLevel(logging.ERROR)  # drops are counted, not printed
    results = run_soak(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
    lost = results["faults_injected"].get("reply lost", 0) + results["faults_injected"].get(
        "reply late", 0)
    print(f"lost or late: {lost} of {args.rounds * args.clients_per_round} replies "
          f"({lost / (args.rounds * args.clients_per_round):.0%}); saved to "
          f"{args.out / 'results.json'}")
    return 0 if not math.isnan(results["final_eval_loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
