"""``make demo``: run the app on Flower's Simulation Engine and show the results.

Runs ``flwr run . local --stream`` from the project folder with a private ``FLWR_HOME`` (so the
managed local SuperLink it starts is ours to stop), then prints where the outputs are.
Extra arguments are passed to ``flwr run`` (e.g. ``--run-config "num-server-rounds=2"``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from fedcybgd.model.loading import cache_root

PROJECT = Path(__file__).resolve().parent.parent
# The demo's size on top of the app's (tuned) defaults: 4 rounds of one 4-layer block each, top
# first (half a cycle), 4 nodes averaged per block, evaluated before and after only; IID
# partitions, the paper's setting (Dirichlet 0.5 too: experiments/demo_seeds.py). In the sweep
# (experiments/results/sweep/) lr 1e-4 had learned as much after these 4 rounds as after 8; the
# demo's former 3 rounds at lr 3e-4 did not hold across seeds
# (experiments/results/demo_seeds_3rounds_lr3e-4.md). About 3 minutes on 2 CPU cores.
DEMO_RUN_CONFIG = "partitioner='iid' num-server-rounds=4 eval-every=0 max-seq-len=48"


def write_flower_config(flwr_home: Path) -> None:
    """A Flower configuration with the managed local simulation SuperLink as default."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
    )


def stop_local_superlink(flwr_home: Path) -> None:
    """Stop the background SuperLink that ``flwr run . local`` started under ``flwr_home``."""
    result = subprocess.run(["pgrep", "-f", f"flower-superlink.*{flwr_home}"],
                            capture_output=True, text=True, check=False)
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Run the simulation; returns flwr's exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=8, help="simulated SuperNodes")
    parser.add_argument("--output-dir", default=str(PROJECT / "outputs" / "demo"))
    parser.add_argument("--run-config", default="", help="extra run-config overrides")
    args = parser.parse_args(argv)

    # Outside the project: everything in the project folder may end up in the app bundle.
    flwr_home = Path(os.environ.get("FLWR_HOME", cache_root() / "flwr-home")).resolve()
    write_flower_config(flwr_home)
    bin_dir = str(Path(sys.executable).parent)  # flower-superlink & co. live beside python
    # Runtime dependency installation would `uv sync` the app's requirements per run, pulling
    # a CUDA torch; everything is installed in this virtualenv already.
    env = dict(os.environ, FLWR_HOME=str(flwr_home), HF_HUB_OFFLINE="1",
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    # The demo replaces its previous outputs (a rerun gives the same numbers).
    # Two --run-config options: Flower applies them in order (a key may not repeat within
    # one), so a user's keys override the demo's size.
    overrides = (f"output-dir='{Path(args.output_dir).resolve()}' overwrite=true "
                 f"{args.run_config}").strip()
    flwr = str(Path(sys.executable).with_name("flwr"))
    command = [
        flwr, "run", str(PROJECT), "local", "--stream",
        "--run-config", DEMO_RUN_CONFIG, "--run-config", overrides,
        "--federation-config",
        f"num-supernodes={args.nodes} client-resources-num-cpus=2",
    ]
    print("$", " ".join(shlex.quote(c) for c in command), flush=True)
    try:
        code = subprocess.run(command, env=env, cwd=PROJECT, check=False).returncode
    finally:
        stop_local_superlink(flwr_home)
    summary = Path(args.output_dir).resolve() / "summary.json"
    if summary.exists():
        print(f"outputs: {summary.parent} (metrics.jsonl, summary.json, plots.png, final/, "
              "checkpoint/)")
    else:
        print(f"no summary at {summary}: the run did not finish", file=sys.stderr)
        code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
