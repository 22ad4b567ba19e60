"""Client compute of a profile's methods, measured side by side in one piece.

A long profile's runs are spread over pieces run on different days, and the machine's speed
drifts between them (on the 2-core machine the same method's client seconds a round differed by
up to 40% from one piece to the next), so the client seconds a run records compare only with
those of runs in the same piece. This script runs every method of the profile back to back, a
few rounds each, on each partition and as each bound, at the profile's base seed, with the
evaluation cut to a few rows, and saves each one's client seconds a round (the slowest client of
each round, as the profile records it), keyed by the run's id without its seed:
``results/<profile>/client_compute.json``.
``payoff.py`` reads that file when it lies beside the profile's ``results.json`` and measures
the compute budget with it: a run's client compute after round ``r`` is ``r`` times its method's
seconds a round measured here.

    python experiments/client_compute.py --profile payoff-long
    python experiments/client_compute.py --profile payoff-long --passes 2   # with a repeat

A federated method runs ``--rounds`` rounds (even: FedCyBGD's block cycle alternates a cheaper
top block and a costlier bottom one), a bound ``--bound-rounds`` of its own long rounds. With
``--passes 2`` the whole list runs twice in turn, and the file keeps every pass, so the spread
shows how much the machine drifted while it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from payoff import COMPUTE
from provenance import with_command
from run_experiments import CENTRAL, HERE, ROOT, load_profile, planned_runs, run_one

# The evaluation runs on the server, outside the client's seconds; a few rows keep it short.
EVAL_ROWS = 8


def per_round(result: dict[str, Any]) -> float:
    """The run's client seconds a round: each round's slowest client, averaged."""
    trained = [r for r in result["records"] if r["round"] > 0]
    return mean(float(r.get("client_train_s", 0.0)) for r in trained)


def measure_plan(profile: dict[str, Any], only: set[str] | None, rounds: int,
                 bound_rounds: int) -> list[dict[str, Any]]:
    """The profile's runs at its base seed, shortened to ``rounds`` (a bound's to
    ``bound_rounds``) with the evaluation cut to :data:`EVAL_ROWS` rows at the end."""
    seed = int(profile["base"]["seed"])
    plan = []
    for item in planned_runs(profile, only):
        if item["seed"] != seed:
            continue
        bound = item["partition"] == CENTRAL
        config = {**item["config"], "num-server-rounds": bound_rounds if bound else rounds,
                  "eval-every": 0, "eval-examples": EVAL_ROWS}
        plan.append({**item, "config": config})
    return plan


def main() -> None:
    """Run the shortened runs and save their client seconds a round."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--only", default="", help="comma-separated methods")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bound-rounds", type=int, default=1)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--work", default=str(ROOT / "outputs" / "experiments"))
    args = parser.parse_args()
    if args.rounds < 1 or args.bound_rounds < 1 or args.passes < 1:
        raise SystemExit("--rounds, --bound-rounds and --passes must be at least 1")

    profile = load_profile(args.profile)
    threads = int(profile["profile"]["threads"])
    only = {m.strip() for m in args.only.split(",") if m.strip()} or None
    plan = measure_plan(profile, only, args.rounds, args.bound_rounds)
    if not plan:
        raise SystemExit(f"{args.profile}: no run to measure (--only {args.only!r})")
    out = Path(args.results) / profile["name"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / COMPUTE
    earlier = json.loads(path.read_text()) if path.exists() else {}
    meta = {"profile": profile["name"],
            "commands": [" ".join(["python", *sys.argv])],
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                       f"{platform.python_version()}",
            "rounds": args.rounds, "bound_rounds": args.bound_rounds, "time": ""}
    if only:  # a piece adds to the methods measured before; a whole measurement starts afresh
        meta["commands"] = with_command(earlier.get("meta", {}), meta["commands"][0])
    units: dict[str, Any] = earlier.get("units", {}) if only else {}
    for item in plan:
        units.pop(item["id"], None)
    began = time.perf_counter()
    for n in range(args.passes):
        for item in plan:
            key = item["id"]  # method@task@partition: a run of the base seed
            print(f"--- pass {n + 1}: {key} ({time.perf_counter() - began:.0f} s in)", flush=True)
            result = run_one({**item, "id": f"compute-{key}"}, Path(args.work) / profile["name"],
                             item["nodes"], threads)
            entry = units.setdefault(key, {"method": item["method"], "task": item["task"],
                                           "partition": item["partition"], "passes": []})
            entry["passes"].append({
                "seconds_per_round": per_round(result),
                "rounds": [float(r.get("client_train_s", 0.0)) for r in result["records"]
                           if r["round"] > 0],
                "at": time.strftime("%Y-%m-%d %H:%M:%S")})
            entry["seconds_per_round"] = mean(p["seconds_per_round"] for p in entry["passes"])
            meta["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
            path.write_text(json.dumps({"meta": meta, "units": units}, indent=1))
            print(f"    {entry['passes'][-1]['seconds_per_round']:.2f} s a round", flush=True)
    for key, entry in units.items():
        spread = [p["seconds_per_round"] for p in entry["passes"]]
        print(f"{key:45s} {entry['seconds_per_round']:7.2f} s a round "
              f"[{min(spread):.2f}-{max(spread):.2f}]")
    print(f"saved {path} ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
