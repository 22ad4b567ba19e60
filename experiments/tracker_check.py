r"""What the trackers recorded for a finished run, against its ``metrics.jsonl``; a screenshot of
TensorBoard's scalars page.

    fedcybgd run . local \
        --run-config "trackers='tensorboard,mlflow,wandb' output-dir='$PWD/outputs/trk'"
    python experiments/tracker_check.py outputs/trk [--screenshot]

For every scalar of every ``metrics.jsonl`` row it reads the value back from TensorBoard's event
files, the MLflow run (the default SQLite store in the output folder) and the offline W&B run
file, and counts the values that differ (relative tolerance 1e-6; TensorBoard stores float32).
With ``--screenshot``, it starts ``tensorboard`` on a free loopback port and takes a headless
Chromium screenshot of the scalars page (Debian: ``apt-get install chromium``). Figures go to
``experiments/results/trackers/`` (``check.json``, ``check.md``, ``tensorboard-scalars.png``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fedcybgd.server.trackers import scalars, wandb_history

RESULTS = Path(__file__).resolve().parent / "results" / "trackers"


def expected(out: Path) -> dict[str, dict[int, float]]:
    """``metrics.jsonl`` as name -> {round: value}, the scalars the trackers are sent."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    want: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in scalars(row).items():
            want.setdefault(key, {})[int(row["round"])] = value
    return want


def tensorboard_values(out: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {key: {e.step: e.value for e in events.Scalars(key)}
            for key in events.Tags()["scalars"]}


def mlflow_values(out: Path) -> dict[str, dict[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("fedcybgd")
    (run,) = client.search_runs([experiment.experiment_id])
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics}


def wandb_values(out: Path) -> dict[str, dict[int, float]]:
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    return wandb_history(next(run_dir.glob("run-*.wandb")))


def compare(want: dict[str, dict[int, float]], got: dict[str, dict[int, float]]) -> dict:
    """Values checked, missing and differing (beyond 1e-6 relative)."""
    checked = missing = differ = 0
    for key, by_round in want.items():
        for step, value in by_round.items():
            checked += 1
            have = got.get(key, {}).get(step)
            if have is None:
                missing += 1
            elif not math.isclose(have, value, rel_tol=1e-6, abs_tol=1e-9):
                differ += 1
    return {"values": checked, "missing": missing, "differ": differ}


def screenshot(out: Path, png: Path) -> None:
    """TensorBoard on a free loopback port, its scalars page shot by headless Chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium on PATH (Debian: apt-get install chromium)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    board = subprocess.Popen([str(Path(sys.executable).parent / "tensorboard"), "--logdir",
                              str(out / "tensorboard"), "--host", "127.0.0.1", "--port",
                              str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(120):
            try:
                urllib.request.urlopen(url, timeout=2).read(100)
                break
            except OSError:
                time.sleep(0.5)
        png.parent.mkdir(parents=True, exist_ok=True)
        # the legacy scalars dashboard, the run's evaluation and training curves; WebGL through
        # SwiftShader (software) so the lines are drawn without a GPU
        subprocess.run([chromium, "--headless", "--no-sandbox", "--use-angle=swiftshader",
                        "--enable-unsafe-swiftshader", "--hide-scrollbars",
                        "--window-size=1600,1200", "--virtual-time-budget=20000",
                        f"--screenshot={png}",
                        f"{url}#scalars&_smoothingWeight=0&tagFilter=%5E(eval_loss%7C"
                        "eval_accuracy%7Ctrain_loss%7Cbytes_up%7Cclient_peak_mem_mb)%24"],
                       check=True, timeout=180, capture_output=True)
    finally:
        board.terminate()
        board.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="a finished run's output folder")
    parser.add_argument("--screenshot", action="store_true",
                        help="also shoot TensorBoard's scalars page (headless Chromium)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    out = args.output_dir.resolve()
    want = expected(out)
    readers = {"tensorboard": tensorboard_values, "mlflow": mlflow_values,
               "wandb": wandb_values}
    report = {"output_dir": str(out), "rounds": max(max(v) for v in want.values()),
              "scalars": len(want), "trackers": {}}
    for name, read in readers.items():
        try:
            report["trackers"][name] = compare(want, read(out))
        except (FileNotFoundError, ValueError, StopIteration) as err:
            report["trackers"][name] = {"error": f"{type(err).__name__}: {err}"}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"Run `{out.name}`: {report['scalars']} scalars over rounds 0-{report['rounds']} "
             "in metrics.jsonl.", "", "| tracker | values checked | missing | differ |",
             "|---|---|---|---|"]
    for name, figures in report["trackers"].items():
        if "error" in figures:
            lines.append(f"| {name} | - | - | {figures['error']} |")
        else:
            lines.append(f"| {name} | {figures['values']} | {figures['missing']} | "
                         f"{figures['differ']} |")
    (args.results / "check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.screenshot:
        png = args.results / "tensorboard-scalars.png"
        screenshot(out, png)
        print(f"screenshot: {png} ({png.stat().st_size} bytes)")
    bad = [n for n, f in report["trackers"].items() if f.get("missing") or f.get("differ")
           or "error" in f]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
