"""The experiments harness end to end on the smoke profile (tiny random model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, f"experiments/{script}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def run_harness(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("run_experiments.py", *args)


@pytest.fixture(scope="module")
def payoff_smoke(tmp_path_factory: pytest.TempPathFactory) -> Callable[
        [Path], tuple[subprocess.CompletedProcess[str], list[str]]]:
    """The payoff smoke profile's ``fedcybgd-fo`` and ``central-lora`` runs (8 runs), made once
    for the module; each test gets its own copy of the results and work folders."""
    first = tmp_path_factory.mktemp("payoff-smoke")
    done = run_harness("--profile", "payoff-smoke", "--results", str(first / "results"),
                       "--work", str(first / "work"), "--only", "fedcybgd-fo,central-lora")

    def copy_to(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        for part in ("results", "work"):
            if (first / part).exists():
                shutil.copytree(first / part, tmp_path / part)
        return done, ["--profile", "payoff-smoke", "--results", str(tmp_path / "results"),
                      "--work", str(tmp_path / "work")]

    return copy_to


@pytest.mark.slow
def test_smoke_profile_writes_results_table_and_plots(tmp_path):
    # Prepare: two methods of the smoke profile, the seed check included
    common = ["--profile", "smoke", "--results", str(tmp_path / "results"),
              "--work", str(tmp_path / "work")]
    # Execute
    done = run_harness(*common, "--only", "fedavg-full,fedcybgd-fo")
    # Assert
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "results" / "smoke"
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["runs"]) == ["fedavg-full@dirichlet", "fedcybgd-fo@dirichlet",
                                   "fedcybgd-fo@movie", "fedcybgd-fo@dirichlet@seed1"]
    full, ours = saved["runs"]["fedavg-full@dirichlet"], saved["runs"]["fedcybgd-fo@dirichlet"]
    # same client-rounds; FedAvg moves the whole model, FedCyBGD one block at a time
    assert full["client_rounds"] == ours["client_rounds"] == 4
    assert full["wire_bytes_up"] > 10 * ours["wire_bytes_up"]
    assert ours["config"]["partitioner"] == "dirichlet"
    assert saved["runs"]["fedcybgd-fo@movie"]["config"]["partitioner"] == "movie"
    assert saved["runs"]["fedcybgd-fo@dirichlet@seed1"]["config"]["seed"] == 1
    table = (out / "table.md").read_text()
    assert "## Targets" in table and "[dirichlet] FedCyBGD-fo >= 50x less total traffic" in table
    assert "seeds [0, 1]" in table
    for plot in ("accuracy_vs_round", "accuracy_vs_bytes", "client_memory"):
        assert (out / f"{plot}.png").stat().st_size > 1000
    assert not (tmp_path / "work" / "smoke" / "fedcybgd-fo@dirichlet").exists()  # weights gone
    # the report is rebuilt from results.json alone, identically
    (out / "table.md").unlink()
    again = run_harness(*common, "--report-only")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "table.md").read_text() == table


def test_unknown_method_in_a_profile_is_named(tmp_path):
    # Prepare
    profile = (ROOT / "experiments" / "configs" / "smoke.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(profile.replace('movie = ["fedcybgd-fo"]', 'movie = ["fedcybgd-nope"]'))
    # Execute
    done = run_harness("--profile", str(bad), "--results", str(tmp_path))
    # Assert
    assert done.returncode != 0 and "fedcybgd-nope" in done.stderr


def fake_run(acc: float, initial: float, down: int, up: int, peak: float) -> dict:
    return {"partition": "dirichlet", "wire_bytes_down": down, "wire_bytes_up": up,
            "client_process_peak_mb": peak,
            "summary": {"final_eval_accuracy": acc, "initial_eval_accuracy": initial}}


def test_targets_read_pass_and_miss_at_their_boundaries():
    # Prepare: fo exactly 1 point (2 of 200 examples) below FedAvg-full, 50x less traffic,
    # exactly 2x less memory; LoRA cheaper than fo; lezo at 1.2x the floor
    sys.path.insert(0, str(ROOT / "experiments"))
    import run_experiments as harness

    results = {
        "fedavg-full@dirichlet": fake_run(157 / 200, 156 / 200, 50_000, 50_000, 4000.0),
        "fedcybgd-fo@dirichlet": fake_run(155 / 200, 156 / 200, 1_000, 1_000, 2000.0),
        "fedavg-lora@dirichlet": fake_run(150 / 200, 156 / 200, 100, 100, 1500.0),
        "fedcybgd-lezo@dirichlet": fake_run(156 / 200, 156 / 200, 10, 10, 1200.0),
    }
    # Execute
    lines = harness.targets(results, inference_mb=1000.0)
    # Assert
    text = "\n".join(lines)
    assert "final accuracy: PASS (-1.0 points" in text
    assert ">= 50x less total traffic than FedAvg-full: PASS (50.0x)" in text
    assert ">= 2x less peak client memory than FedAvg-full: PASS (2.00x)" in text
    assert "at equal or lower traffic: MISS" in text
    assert "within 1.1x of inference memory: MISS (1.200x" in text


@pytest.mark.slow
def test_sweep_runs_every_setting_and_marks_each_methods_best(tmp_path):
    # Prepare: the smoke sweep (tiny random model): fo over 2 lrs x 2 layouts on 2 partitions,
    # LoRA at one lr on one partition
    common = ["--sweep", "sweep-smoke", "--results", str(tmp_path / "results"),
              "--work", str(tmp_path / "work")]

    # Execute: in two pieces, LoRA first, then the rest resumed
    first = subprocess.run([sys.executable, "experiments/sweep.py", *common, "--only",
                            "fedavg-lora"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    done = subprocess.run([sys.executable, "experiments/sweep.py", *common, "--resume"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)

    # Assert
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done before, kept") == 1
    out = tmp_path / "results" / "sweep-smoke"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert len(runs) == 2 * 2 * 2 + 1
    parallel = runs["fo | lr=0.01 clients-per-block=1,parallel-damping=inverse | iid | seed 0"]
    assert parallel["config"]["clients-per-block"] == 1
    assert parallel["config"]["parallel-damping"] == "inverse"
    assert parallel["config"]["lr"] == 0.01 and parallel["config"]["partitioner"] == "iid"
    rounds = [r for r in parallel["records"] if r["round"] > 0]
    assert [len(r["blocks"]) for r in rounds] == [2, 2]  # two blocks a round, in parallel
    fo_dirichlet = {r["setting"]: r["summary"]["final_eval_loss"] for r in runs.values()
                    if r["method"] == "fo" and r["partition"] == "dirichlet"}
    best = min(fo_dirichlet, key=fo_dirichlet.__getitem__)
    table = (out / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith(f"| fo | {best} |"))
    assert row.split("|")[-3].strip().endswith("**best**")  # the dirichlet mean column
    assert "best on dirichlet: " in done.stdout and best in done.stdout
    assert (out / "curves.png").stat().st_size > 1000
    # the header names both pieces' commands, in order
    header = next(line for line in table.splitlines() if line.startswith("Commands: "))
    assert header.index("--only fedavg-lora") < header.index("--resume")
    assert header.count("`python experiments/sweep.py") == 2
    # the report is rebuilt from results.json alone, identically
    again = subprocess.run([sys.executable, "experiments/sweep.py", *common, "--report-only"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "table.md").read_text() == table


def payoff_run(method: str, seed: int, accuracies: list[float], mb: list[float],
               seconds: list[float], peak: float, partition: str = "dirichlet") -> dict:
    """A results.json run with evaluations at rounds 0.. (cumulative MB and seconds given)."""
    records, prev_mb, prev_s = [], 0.0, 0.0
    for i, (acc, m, s) in enumerate(zip(accuracies, mb, seconds, strict=True)):
        records.append({"round": i, "eval_accuracy": acc, "eval_loss": 1.0 - acc,
                        "bytes_down": (m - prev_mb) * 2**20, "bytes_up": 0,
                        "client_train_s": s - prev_s})
        prev_mb, prev_s = m, s
    return {"id": f"{method}@t@{partition}@seed{seed}", "method": method, "task": "t",
            "partition": partition, "seed": seed, "client_process_peak_mb": peak,
            "client_rounds": 4, "wall_s": 1.0, "records": records}


def test_payoff_names_each_budgets_winner_and_whether_it_beats_the_seed_spread():
    # Prepare: "cheap" reaches 0.80/0.82 with 1 MB, 10 s, 500 MB; "rich" 0.90/0.91 with
    # 100 MB, 50 s, 2,000 MB, and 0.70 halfway; a bound on one node
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed, (cheap, rich) in enumerate([(0.80, 0.90), (0.82, 0.91)]):
        for r in (payoff_run("cheap", seed, [0.5, cheap], [0, 1], [0, 10], 500.0),
                  payoff_run("rich", seed, [0.5, 0.70, rich], [0, 50, 100], [0, 25, 50], 2000.0),
                  payoff_run("bound", seed, [0.5, 0.95], [0, 0], [0, 60], 3000.0, "central")):
            runs[r["id"]] = r

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])
    text = payoff.report(runs, {"profile": "x"})

    # Assert
    def row(start: str) -> str:
        return next(r for r in rows if r.startswith(start))

    assert "| rich 0.905 [0.900-0.910]" in row("| (a) equal client-rounds")
    assert "+9.5 points | clear |" in row("| (a)")
    # with cheap's 1 MB, rich has only its round 0: cheap wins
    assert "| cheap 0.810" in row("| (b) bytes <= 1.00 MB (cheap's costliest seed)")
    assert "| rich 0.905" in row("| (b) bytes <= 100.00 MB (rich's costliest seed)")
    # at 500 MB only cheap fits; at 2,000 MB both do
    assert ("| cheap 0.810 [0.800-0.820], loss 0.190 | the untrained model 0.500 [0.500-0.500]"
            in row("| (c) client peak <= 500 MB"))
    assert "| rich 0.905" in row("| (c) client peak <= 2,000 MB")
    assert "| cheap 0.810" in row("| (d) client compute <= 10.00 s")
    assert [r[:5] for r in rows[2:]] == ["| (a)", "| (b)", "| (b)", "| (c)", "| (c)", "| (d)",
                                         "| (d)"]
    assert "| bound: bound | 2 | 0.500 | 0.950 [0.950-0.950]" in text  # listed, not competing
    assert "bound 0.95" not in "\n".join(rows)


def test_payoff_calls_overlapping_seeds_inside_the_spread():
    # Prepare: a 1-point lead whose seeds overlap
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed, (a, b) in enumerate([(0.80, 0.78), (0.78, 0.80), (0.82, 0.79)]):
        for r in (payoff_run("a", seed, [0.5, a], [0, 1], [0, 1], 1.0),
                  payoff_run("b", seed, [0.5, b], [0, 1], [0, 1], 1.0)):
            runs[r["id"]] = r

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])

    # Assert
    assert "| a 0.800 [0.780-0.820]" in rows[2] and "+1.0 points | inside the spread |" in rows[2]


def lm_run(method: str, seed: int, losses: list[float], mb: list[float],
           references: list[float], lora: bool = False) -> dict:
    """A language-modelling run of results.json: held-out and reference losses a round."""
    run = payoff_run(method, seed, [0.3] * len(losses), mb, [0.0] * len(losses), 100.0)
    for record, loss, reference in zip(run["records"], losses, references, strict=True):
        record.update(eval_loss=loss, eval_reference_loss=reference)
    run["config"] = {"task": "lm", **({"fedavg-params": "lora"} if lora else {})}
    return run


def test_payoff_of_language_modelling_ranks_by_held_out_loss_clear_by_005_nats():
    # Prepare: "full" ends at 3.30/3.32/3.31 nats, "lora" at 3.38/3.40/3.36 with the same
    # bytes: full's worst seed (3.32) beats lora's best (3.36) by 0.04, inside the 0.05 margin;
    # "wide" ends 0.1 above full's worst on every seed
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed, (full, lora) in enumerate([(3.30, 3.38), (3.32, 3.40), (3.31, 3.36)]):
        for r in (lm_run("full", seed, [4.8, full], [0, 10], [4.3, 4.5]),
                  lm_run("lora", seed, [4.8, lora], [0, 10], [4.3, 4.35], lora=True),
                  lm_run("wide", seed, [4.8, 3.42 + seed * 0.001], [0, 10], [4.3, 4.3])):
            runs[r["id"]] = r
    methods = payoff.groups(runs)[("t", "dirichlet")]

    # Execute
    rows = payoff.comparisons(methods)
    table = payoff.method_table(methods, {})
    near = payoff.comparisons({m: methods[m] for m in ("full", "lora")})
    far = payoff.comparisons({m: methods[m] for m in ("full", "wide")})

    # Assert: lower loss wins, the margin in nats, clear only by 0.05 beyond the seeds
    assert "winner: held-out loss (nats/token)" in rows[0]
    assert "| full loss 3.310 [3.300-3.320] | lora loss 3.380" in near[2]
    assert "-0.070 nats | inside the spread |" in near[2]
    assert "| full loss 3.310" in far[2] and "| clear |" in far[2]
    # the table shows the loss and the forgetting (reference loss before -> after)
    assert "| full | 3 | 4.800 | 3.310 [3.300-3.320] | 4.300 -> 4.500 (+0.200) |" in "\n".join(
        table)
    assert "| lora | 3 | 4.800 | 3.380 [3.360-3.400] | 4.300 -> 4.350 (+0.050) |" in "\n".join(
        table)


def test_payoff_plot_of_language_modelling_sets_the_loss_beside_the_forgetting(tmp_path):
    # Prepare: two methods, two seeds, each evaluated on the held-out and the reference text
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff
    from PIL import Image

    runs = {}
    for seed in (0, 1):
        for r in (lm_run("full", seed, [4.8, 3.3], [0, 10], [4.3, 4.5]),
                  lm_run("lora", seed, [4.8, 3.4], [0, 10], [4.3, 4.35], lora=True)):
            runs[r["id"]] = r
    # Execute
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    (with_reference,) = payoff.plot(runs, tmp_path / "a")
    del next(iter(runs.values()))["records"][-1]["eval_reference_loss"]
    (without,) = payoff.plot(runs, tmp_path / "b")
    # Assert: one panel more (5.5 in. at 110 dpi) where every run measured the reference text
    wide, narrow = Image.open(with_reference).size[0], Image.open(without).size[0]
    assert (wide, narrow) == (4 * 605, 3 * 605)


def test_payoff_learning_curve_names_the_leader_and_the_crossing_point(tmp_path):
    # Prepare: evaluations every 6 rounds of 2 nodes x 5 steps x batch 8 (80 examples a round,
    # 40 a client-round); LoRA leads at 12 and 24 client-rounds, full-parameter from 36 on,
    # clear of the seeds only at 48; a bound evaluated every 480 examples
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    fed = {"clients-per-round": 2, "local-steps": 5, "batch-size": 8}
    central = {"clients-per-round": 1, "local-steps": 60, "batch-size": 8}
    runs = {}
    for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
        full = [0.0, 0.40, 0.45, 0.55, 0.65]
        lora = [0.0, 0.50, 0.52, 0.53, 0.54]
        for name, accs, params in (("fo", full, "full"), ("lora", lora, "lora")):
            r = payoff_run(name, seed, [a + jitter if a else a for a in accs], [0] * 5,
                           [0] * 5, 1000.0)
            for i, rec in enumerate(r["records"]):
                rec["round"] = 6 * i
            r.update(client_rounds=48, config={**fed, "fedavg-params": params})
            runs[r["id"]] = r
        b = payoff_run("central-full", seed, [0.0, 0.5, 0.6, 0.7, 0.75], [0] * 5, [0] * 5,
                       2000.0, "central")
        b.update(client_rounds=4, config={**central, "fedavg-params": "full"})
        runs[b["id"]] = b

    # Execute
    grouped = payoff.groups(runs)
    lines = payoff.learning_curve(grouped[("t", "dirichlet")], grouped[("t", "central")])
    text = payoff.report(runs, {"profile": "x"})
    plots = payoff.plot(runs, tmp_path)

    # Assert
    table = "\n".join(lines)
    assert "| 12 (480) | 0.400 [0.390-0.410] | 0.500 [0.490-0.510] | 0.500 [0.500-0.500] " \
           "| lora | +10.0 points | clear |" in table
    assert "| 36 (1,440) | 0.550 [0.540-0.560] | 0.530 [0.520-0.540] | 0.700 [0.700-0.700] " \
           "| fo | +2.0 points | inside the spread |" in table
    assert "| 48 | fo 0.650 | lora 0.540 | +11.0 points | clear |" in table
    assert ("Crossing: full-parameter training is ahead from 36 client-rounds on, to the last "
            "evaluation. Clear of the seed spread from 48 client-rounds on.") in table
    assert "### Learning curve" in text
    assert [p.name for p in plots] == ["pareto_t_dirichlet.png"]


def test_payoff_learning_curve_needs_evaluations_along_the_way():
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {r["id"]: r for r in (payoff_run("a", 0, [0.5, 0.8], [0, 1], [0, 1], 1.0),)}
    runs["a@t@dirichlet@seed0"]["config"] = {"clients-per-round": 1, "local-steps": 1,
                                             "batch-size": 1}
    grouped = payoff.groups(runs)
    assert payoff.learning_curve(grouped[("t", "dirichlet")], {}) == []


@pytest.mark.slow
def test_payoff_smoke_profile_runs_tasks_seeds_and_bounds(payoff_smoke, tmp_path):
    # Prepare, Execute: FedCyBGD-fo and the centralized LoRA bound of the payoff smoke profile
    # (two tasks, two seeds, one partition), run once for this file
    done, common = payoff_smoke(tmp_path)

    # Assert
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "results" / "payoff-smoke"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert list(runs)[:2] == ["fedcybgd-fo@rotten-tomatoes@dirichlet",
                              "central-lora@rotten-tomatoes@central"]
    assert len(runs) == 2 * 2 * 2 and "central-lora@tomi@central@seed1" in runs
    bound = runs["central-lora@tomi@central@seed1"]
    assert bound["nodes"] == 1 and bound["config"]["partitioner"] == "iid"
    assert bound["config"]["dataset"] == "tomi" and bound["config"]["seed"] == 1
    assert bound["client_rounds"] == 1
    assert runs["fedcybgd-fo@tomi@dirichlet"]["config"]["max-seq-len"] == 96
    text = (out / "payoff.md").read_text()
    for section in ("## rotten-tomatoes / dirichlet", "## tomi / dirichlet"):
        assert section in text
    assert "| (a) equal client-rounds (4) | fedcybgd-fo" in text
    assert "| bound: central-lora | 2 |" in text
    for name in ("rotten-tomatoes_dirichlet", "tomi_dirichlet"):
        assert (out / f"pareto_{name}.png").stat().st_size > 1000
    # the report is rebuilt from results.json alone, identically
    (out / "payoff.md").unlink()
    again = run_harness(*common, "--report-only")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "payoff.md").read_text() == text


@pytest.mark.slow
def test_client_compute_measures_each_run_side_by_side_and_payoff_uses_it(payoff_smoke,
                                                                           tmp_path):
    # Prepare: FedCyBGD-fo and the centralized LoRA bound of the payoff smoke profile (run
    # once for this file), whose report is written first from the seconds the runs recorded
    done, common = payoff_smoke(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "results" / "payoff-smoke"
    assert "summed." in (out / "payoff.md").read_text()

    # Execute: two rounds of each, the list twice; then the report again
    measured = run_script("client_compute.py", *common, "--only", "fedcybgd-fo,central-lora",
                          "--rounds", "2", "--passes", "2")
    again = run_harness(*common, "--report-only")

    # Assert: a measurement per run id (no seed), each pass kept with its rounds
    assert measured.returncode == 0, measured.stderr[-3000:]
    saved = json.loads((out / "client_compute.json").read_text())
    assert sorted(saved["units"]) == ["central-lora@rotten-tomatoes@central",
                                      "central-lora@tomi@central",
                                      "fedcybgd-fo@rotten-tomatoes@dirichlet",
                                      "fedcybgd-fo@tomi@dirichlet"]
    fo = saved["units"]["fedcybgd-fo@tomi@dirichlet"]
    assert [len(p["rounds"]) for p in fo["passes"]] == [2, 2]
    assert len(saved["units"]["central-lora@tomi@central"]["passes"][0]["rounds"]) == 1
    assert fo["seconds_per_round"] > 0
    assert saved["meta"]["rounds"] == 2 and saved["meta"]["bound_rounds"] == 1
    # the report's compute budget is now the side-by-side one: 2 rounds x fo's seconds a round
    assert again.returncode == 0, again.stderr[-3000:]
    text = (out / "payoff.md").read_text()
    assert "measured side by side in one piece by `client_compute.py`" in text
    tomi = text[text.index("## tomi / dirichlet"):]  # rotten-tomatoes' table comes first
    row = next(r for r in tomi.splitlines() if r.startswith("| fedcybgd-fo | 2 |"))
    # (shown to 0.1 s: the tiny model's rounds take hundredths, so allow the display's rounding)
    assert abs(float(row.split("|")[7].strip().replace(",", "")) - 2 * fo["seconds_per_round"]) \
        <= 0.05 + 1e-9


def test_payoff_takes_client_compute_from_the_side_by_side_measurement():
    # Prepare: "a" recorded 10 s a round and "b" 20 s, in pieces at different machine speeds;
    # measured side by side, a round of "a" costs 30 s and one of "b" 15 s
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed in (0, 1):
        for r in (payoff_run("a", seed, [0.5, 0.6, 0.8], [0, 1, 2], [0, 10, 20], 1.0),
                  payoff_run("b", seed, [0.5, 0.7, 0.75], [0, 1, 2], [0, 20, 40], 1.0)):
            runs[r["id"]] = r
    compute: dict[str, Any] = {
        "meta": {"profile": "p", "rounds": 6, "bound_rounds": 1, "time": "then",
                 "commands": ["python experiments/client_compute.py --profile p"]},
        "units": {"a@t@dirichlet": {"seconds_per_round": 30.0},
                  "b@t@dirichlet": {"seconds_per_round": 15.0}}}

    # Execute
    recorded = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])
    methods = payoff.groups(runs, compute)[("t", "dirichlet")]
    measured = payoff.comparisons(methods)
    table = payoff.method_table(methods, {}, side_by_side=True)
    text = payoff.report(runs, {"profile": "p"}, compute)

    # Assert: the ladder of (d) follows the measured seconds, not the recorded ones
    assert [r.split(" s (")[0] for r in recorded if r.startswith("| (d)")] == [
        "| (d) client compute <= 20.00", "| (d) client compute <= 40.00"]
    assert [r.split(" s (")[0] for r in measured if r.startswith("| (d)")] == [
        "| (d) client compute <= 30.00", "| (d) client compute <= 60.00"]
    assert "| (d) client compute <= 30.00 s (b's costliest seed) | b 0.750" in "\n".join(measured)
    assert table[2].endswith("| 60.0 | 10.0-10.0 |")  # a: measured total, recorded a round
    assert "measured side by side in one piece by `client_compute.py`" in text
    # a run the measurement lacks is an error naming it and the command that fills it in
    del compute["units"]["b@t@dirichlet"]
    with pytest.raises(SystemExit, match=r"no measurement of b@t@dirichlet: run .*--only b"):
        payoff.groups(runs, compute)


def test_payoff_says_when_nothing_trained_within_a_budget_or_one_seed_cannot_judge():
    # Prepare: one seed each; the cheaper method's budget is below the other's first round
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {r["id"]: r for r in (payoff_run("a", 0, [0.5, 0.6], [0, 10], [0, 1], 1.0),
                                 payoff_run("b", 0, [0.5, 0.7], [0, 20], [0, 1], 1.0))}

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])

    # Assert
    assert "+10.0 points | one seed: no spread to judge by |" in rows[2]
    budget = next(r for r in rows if r.startswith("| (b) bytes <= 10.00 MB"))
    assert "| a 0.600" in budget  # a has trained; b is still at round 0
    # a budget (a mean over seeds) that no seed's first round fits: nothing to rank
    untrained = payoff.Point(0, 0.5, 1.0, 0.0, 0.0)
    start = payoff.Score(payoff.UNTRAINED, (untrained, untrained))
    assert payoff.verdict([payoff.Score("a", (untrained, untrained)),
                           payoff.Score("b", (untrained, untrained))], start).startswith("none: ")


def test_payoff_rungs_hold_every_seed_of_their_own_method():
    # Prepare: "a" moves 300 MB on seed 0 and 500 MB on seed 1 (its mean, 400 MB, would leave
    # seed 1 at round 0 on its own rung); "b" 1,000 MB
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed, mb in enumerate([300.0, 500.0]):
        for r in (payoff_run("a", seed, [0.5, 0.8], [0, mb], [0, 1], 1.0),
                  payoff_run("b", seed, [0.5, 0.9], [0, 1000], [0, 1], 1.0)):
            runs[r["id"]] = r

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])

    # Assert: a's rung is its costliest seed, 500 MB, where both its seeds have trained
    rung = next(r for r in rows if r.startswith("| (b) bytes <= 500.00 MB (a's costliest seed)"))
    assert "| a 0.800 [0.800-0.800]" in rung


def test_payoff_lets_the_untrained_model_win_when_training_lowered_accuracy():
    # Prepare: two seeds of two methods that both end below their round-0 accuracy
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed, (a, b) in enumerate([(0.70, 0.60), (0.72, 0.62)]):
        for r in (payoff_run("a", seed, [0.8, a], [0, 1], [0, 1], 1.0),
                  payoff_run("b", seed, [0.8, b], [0, 1], [0, 1], 1.0)):
            runs[r["id"]] = r

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])

    # Assert: doing nothing beats both, clearly; the best trained method is the runner-up
    assert ("| the untrained model 0.800 [0.800-0.800], loss 0.200 | a 0.710 [0.700-0.720], "
            "loss 0.290 | +9.0 points | clear |") in rows[2]


def test_privacy_report_keeps_runs_at_different_rates_in_separate_rows(tmp_path):
    # Prepare: lezo without DP (2 seeds) and at epsilon 8, one seed still at the old rate 1e-4
    # and two rerun at 1e-2: a rerun half done
    sys.path.insert(0, str(ROOT / "experiments"))
    import privacy_example_report as report

    def run(seed: int, lr: float, level: float | None, loss: float) -> dict:
        dp = {} if level is None else {"dp": "example", "dp-target-epsilon": level,
                                        "dp-noise-multiplier": 0.52}
        return {"seed": seed, "config": {"update-rule": "lezo", "lr": lr, **dp},
                "summary": {"dp_epsilon": None if level is None else 6.0,
                            "final_eval_accuracy": 0.0, "final_eval_loss": loss,
                            "initial_eval_loss": 2.5, "client_peak_mem_mb": 1500.0}}

    runs = [run(0, 3e-4, None, 2.2), run(1, 3e-4, None, 2.3), run(0, 1e-4, 8.0, 2.53),
            run(1, 1e-2, 8.0, 2.40), run(2, 1e-2, 8.0, 2.30)]
    (tmp_path / "results.json").write_text(json.dumps(
        {"meta": {}, "runs": {f"r{i}": r for i, r in enumerate(runs)}}))

    # Execute
    text = report.table(json.loads((tmp_path / "results.json").read_text()))
    report.plot(json.loads((tmp_path / "results.json").read_text()), tmp_path / "p.png")

    # Assert: one row per rate, each with its own seeds; nothing averaged across rates
    lines = [line for line in text.splitlines() if line.startswith("| lezo")]
    assert lines == [
        "| lezo | no DP | 0.0003 | - | - | 0.000 [0.000-0.000] | 2.250 [2.200-2.300] "
        "| 1500 [1500-1500] | 2 |",
        "| lezo | epsilon <= 8 | 0.0001 | 0.52 | 6.00 | 0.000 | 2.530 | 1500 | 1 |",
        "| lezo | epsilon <= 8 | 0.01 | 0.52 | 6.00 [6.00-6.00] | 0.000 [0.000-0.000] "
        "| 2.350 [2.300-2.400] | 1500 [1500-1500] | 2 |",
    ]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_sweep_report_marks_each_methods_best_rate_at_every_evaluation(monkeypatch):
    # Prepare: two rates of one method whose order flips along the way (the high rate ahead
    # early, the low one at the end), evaluated after 2 and 4 client-rounds
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import sweep

    def run(setting: str, losses: list[float]) -> dict:
        records = [{"round": 0, "clients": [], "eval_loss": 2.0, "eval_accuracy": 0.0}]
        for i, loss in enumerate(losses, start=1):
            records.append({"round": i, "clients": ["a", "b"], "eval_loss": loss,
                            "eval_accuracy": 1.0 - loss})
        return {"method": "fo", "setting": setting, "partition": "iid", "seed": 0,
                "records": records}

    results = {"high": run("lr=1e-4", [0.5, 0.4]), "low": run("lr=1e-5", [0.9, 0.3])}
    # Execute
    lines = sweep.along_the_way(results, "iid")
    # Assert: a column per evaluation after round 0; the best marked per column
    table = [line for line in lines if line.startswith("| fo |")]
    assert "2 client-rounds | 4 client-rounds | second half (4) |" in "\n".join(lines)
    assert table == [
        "| fo | lr=1e-4 | 0.500 / 0.500 **best** | 0.400 / 0.600 | 0.400 / 0.600 |",
        "| fo | lr=1e-5 | 0.900 / 0.100 | 0.300 / 0.700 **best** | 0.300 / 0.700 **best** |"]
    assert sweep.along_the_way(results, "dirichlet") == []  # nothing run there

    # A longer curve whose last point flatters the rate that is worse over the second half:
    # the second-half column (evaluations after 4 of 8 client-rounds) marks the steadier one
    results = {"steady": run("lr=1e-4", [0.9, 0.5, 0.2, 0.25]),
               "lucky": run("lr=3e-4", [0.9, 0.5, 0.4, 0.2])}
    lines = sweep.along_the_way(results, "iid")
    table = [line for line in lines if line.startswith("| fo |")]
    assert "| second half (6, 8) |" in "\n".join(lines)
    assert table[0].endswith("| 0.250 / 0.750 | 0.225 / 0.775 **best** |")
    assert table[1].endswith("| 0.200 / 0.800 **best** | 0.300 / 0.700 |")


def test_a_sweep_runs_each_grid_middle_first_with_the_methods_taking_turns(monkeypatch):
    # Prepare: one method over three rates, one over a 3 x 2 grid of bundles, one without a
    # grid, two seeds each; the file's order is the report's
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import sweep

    spec = {"sweep": {"partitions": ["iid"], "seeds": [0, 1]}, "base": {},
            "methods": {"fo": {"grid": {"lr": [1e-4, 3e-4, 1e-3]}},
                        "lora": {"grid": {"lr": [1e-3, 3e-3, 1e-2], "lora-rank": [8, 64]}},
                        "full": {"lr": 1e-4}}}
    runs = sweep.planned_runs(spec, None)
    # Execute
    order = [(r["method"], r["setting"], r["seed"]) for r in sweep.run_order(spec, runs)]
    # Assert: every run once; each method's middle first, its corners last, seeds together
    assert sorted(order) == sorted((r["method"], r["setting"], r["seed"]) for r in runs)
    assert order[:3] == [("fo", "lr=0.0003", 0), ("lora", "lr=0.003 lora-rank=8", 0),
                         ("full", "default", 0)]
    fo = [setting for method, setting, _ in order if method == "fo"]
    assert fo == ["lr=0.0003"] * 2 + ["lr=0.0001"] * 2 + ["lr=0.001"] * 2
    lora = [setting for method, setting, seed in order if method == "lora" and seed == 0]
    assert lora[:2] == ["lr=0.003 lora-rank=8", "lr=0.003 lora-rank=64"]
    assert set(lora[2:]) == {f"lr={lr} lora-rank={rank}" for lr in ("0.001", "0.01")
                             for rank in (8, 64)}
    assert [(r["method"], r["seed"]) for r in runs][:6] == [("fo", 0), ("fo", 1)] * 3


def test_a_results_files_commands_accumulate_once_each_in_the_order_first_run():
    # Prepare: a results file written before the list (one command), then two more invocations
    sys.path.insert(0, str(ROOT / "experiments"))
    from provenance import commands_line, with_command

    meta: dict[str, Any] = {"command": "python a.py --only x"}

    # Execute
    meta = {"commands": with_command(meta, "python a.py --only y")}
    meta = {"commands": with_command(meta, "python a.py --only x")}  # run again: kept once

    # Assert
    assert meta["commands"] == ["python a.py --only x", "python a.py --only y"]
    assert commands_line(meta) == "Commands: `python a.py --only x`, then `python a.py --only y`"
    assert commands_line({"command": "make experiments"}) == "Command: `make experiments`"
    assert commands_line({}) == "Command: `?`"


def test_payoff_crossing_names_lora_when_it_leads_throughout():
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    def score(method: str, accs: tuple[float, ...]) -> payoff.Score:
        return payoff.Score(method, tuple(payoff.Point(12, a, 0.1, 0.0, 0.0, 480)
                                          for a in accs))

    pairs = [(480 * k, score("fo", (0.40 + k / 10, 0.41 + k / 10)),
              score("lora", (0.50 + k / 10, 0.52 + k / 10))) for k in (1, 2)]
    text = payoff.crossing(pairs, 40)[-1]
    assert text == ("LoRA is ahead at every evaluation: no crossing. Clear of the seed spread "
                    "from 12 client-rounds on.")


def test_seeds_option_keeps_the_named_seeds_and_names_unknown_ones():
    # Prepare: the long payoff profile, 3 seeds, every method and bound
    sys.path.insert(0, str(ROOT / "experiments"))
    import run_experiments as harness

    profile = harness.load_profile("payoff-long")
    plan = harness.planned_runs(profile, {"fedavg-full"})

    # Execute
    kept = harness.only_seeds(plan, profile, "0")
    every = harness.only_seeds(plan, profile, "")

    # Assert: one run per partition at seed 0; nothing dropped without the option
    assert sorted(item["id"] for item in kept) == ["fedavg-full@tomi@dirichlet",
                                                   "fedavg-full@tomi@iid"]
    assert every == plan and len(plan) == 6
    with pytest.raises(SystemExit, match=r"runs seeds \[0, 1, 2\], not \[7\]"):
        harness.only_seeds(plan, profile, "0,7")
    with pytest.raises(SystemExit, match="comma-separated integers"):
        harness.only_seeds(plan, profile, "zero")


SWEEP_TOML = """
[sweep]
nodes = 8
partitions = ["movie"]
seeds = [0, 1]

[base]
model = "smollm2-135m"
task = "lm"
num-server-rounds = 16
local-steps = 20
eval-split = "validation"

[methods.fo-l1]
update-rule = "fo"
layers-per-block = 1
[methods.fo-l1.grid]
lr = [1e-4, 3e-4, 1e-3]

[methods.fo-l3]
update-rule = "fo"
layers-per-block = 3
[methods.fo-l3.grid]
lr = [1e-4, 3e-4, 1e-3]
"""

PROFILE_TOML = """
[profile]
nodes = 8
threads = 2
seeds = [0, 1, 2]

[profile.partitions]
movie = ["fedcybgd"]

[base]
model = "smollm2-135m"
task = "lm"
num-server-rounds = 16
local-steps = 20
eval-split = "test"
seed = 0

[methods.fedcybgd]
tuned-in = { sweep = "SWEEP", methods = ["fo-l1", "fo-l3"] }
"""


def swept(tmp_path: Path, losses: dict[tuple[str, str], float]) -> Path:
    """A sweep file and its results.json with the given final losses per (method, setting),
    each seed 0.01 apart; returns the sweep file."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import sweep

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "lm-sweep.toml"
    path.write_text(SWEEP_TOML)
    runs = {}
    for plan in sweep.planned_runs(sweep.load_sweep(str(path)), None):
        loss = losses.get((plan["method"], plan["setting"]))
        if loss is not None:
            runs[plan["id"]] = {**plan, "summary": {
                "final_eval_loss": loss + 0.01 * plan["seed"], "final_eval_accuracy": 0.3}}
    (tmp_path / "results" / "lm-sweep").mkdir(parents=True)
    (tmp_path / "results" / "lm-sweep" / "results.json").write_text(json.dumps({"runs": runs}))
    return path


def test_a_profile_method_takes_the_best_layout_and_rate_its_sweep_found(tmp_path):
    # Prepare: every setting of two layouts swept on two seeds; three layers at 3e-4 lowest
    sys.path.insert(0, str(ROOT / "experiments"))
    import run_experiments as harness

    losses = {(m, f"lr={lr}"): 4.5 for m in ("fo-l1", "fo-l3") for lr in ("0.0001", "0.0003",
                                                                            "0.001")}
    losses[("fo-l3", "lr=0.0003")] = 4.2
    sweep_file = swept(tmp_path, losses)
    profile_file = tmp_path / "lm-profile.toml"
    profile_file.write_text(PROFILE_TOML.replace("SWEEP", str(sweep_file)))

    # Execute
    profile = harness.load_profile(str(profile_file), tmp_path / "results")
    plan = harness.planned_runs(profile, None)

    # Assert: the sweep's keys for that setting, the profile's own over them, on every seed
    choice = profile["tuned"]["fedcybgd"]["movie"]
    assert (choice["method"], choice["setting"], choice["edge"]) == ("fo-l3", "lr=0.0003", False)
    assert choice["loss"] == pytest.approx(4.205)
    assert [item["seed"] for item in plan] == [0, 1, 2]
    for item in plan:
        assert {k: item["config"][k] for k in ("update-rule", "layers-per-block", "lr",
                                               "eval-split")} == {
            "update-rule": "fo", "layers-per-block": 3, "lr": 3e-4, "eval-split": "test"}

    # a best at the grid's edge says so
    losses[("fo-l1", "lr=0.001")] = 4.0
    swept(tmp_path / "edge", losses)
    (tmp_path / "edge" / "p.toml").write_text(
        PROFILE_TOML.replace("SWEEP", str(tmp_path / "edge" / "lm-sweep.toml")))
    edge = harness.load_profile(str(tmp_path / "edge" / "p.toml"), tmp_path / "edge" / "results")
    assert edge["tuned"]["fedcybgd"]["movie"]["setting"] == "lr=0.001"
    assert edge["tuned"]["fedcybgd"]["movie"]["edge"] is True


def test_a_profile_refuses_a_sweep_setting_not_yet_run_or_tuned_at_another_length(tmp_path):
    # Prepare: one setting of the sweep missing; then all run but the profile trains longer
    sys.path.insert(0, str(ROOT / "experiments"))
    import run_experiments as harness

    losses = {(m, f"lr={lr}"): 4.5 for m in ("fo-l1", "fo-l3") for lr in ("0.0001", "0.0003",
                                                                            "0.001")}
    del losses[("fo-l3", "lr=0.001")]
    sweep_file = swept(tmp_path, losses)
    profile_file = tmp_path / "lm-profile.toml"
    profile_file.write_text(PROFILE_TOML.replace("SWEEP", str(sweep_file)))

    # Execute / Assert: the missing runs and the command that makes them are named
    with pytest.raises(SystemExit, match=r"has not run \['fo-l3 \| lr=0.001 \| movie \| seed 0', "
                                         r"'fo-l3 \| lr=0.001 \| movie \| seed 1'\] yet: python "
                                         r"experiments/sweep.py --sweep lm-sweep --resume"):
        harness.load_profile(str(profile_file), tmp_path / "results")
    losses[("fo-l3", "lr=0.001")] = 4.5
    swept(tmp_path / "all", losses)
    longer = PROFILE_TOML.replace("SWEEP", str(tmp_path / "all" / "lm-sweep.toml")).replace(
        "num-server-rounds = 16", "num-server-rounds = 64")
    (tmp_path / "all" / "p.toml").write_text(longer)
    with pytest.raises(SystemExit, match=r"does not carry to this run: num-server-rounds = 64 "
                                         r"\(tuned at 16\)"):
        harness.load_profile(str(tmp_path / "all" / "p.toml"), tmp_path / "all" / "results")


def test_payoff_untrained_model_has_every_seed_any_method_ran():
    # Prepare: "one" ran seed 0 only, is listed first and fell below the untrained 0.5;
    # "multi" ran three seeds, all clear of it
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    r = payoff_run("one", 0, [0.5, 0.45], [0, 1], [0, 1], 1.0)
    runs[r["id"]] = r
    for seed, acc in enumerate((0.60, 0.61, 0.62)):
        r = payoff_run("multi", seed, [0.5, acc], [0, 1], [0, 1], 1.0)
        runs[r["id"]] = r

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])

    # Assert: the untrained model is judged on three seeds, so the lead over it is clear
    assert ("| multi 0.610 [0.600-0.620], loss 0.390 | the untrained model 0.500 [0.500-0.500], "
            "loss 0.500 | +11.0 points | clear |") in rows[2]


def test_payoff_budgets_within_one_percent_are_one_rung():
    # Prepare: "a" totals 100.0 MB, "b" 100.5 MB and is better only at its last evaluation
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    runs = {}
    for seed, jitter in enumerate((0.0, 0.01)):
        for r in (payoff_run("a", seed, [0.5, 0.70 + jitter], [0, 100.0], [0, 10], 1.0),
                  payoff_run("b", seed, [0.5, 0.60, 0.80 + jitter], [0, 50.0, 100.5],
                             [0, 5, 30], 1.0)):
            runs[r["id"]] = r

    # Execute
    rows = payoff.comparisons(payoff.groups(runs)[("t", "dirichlet")])

    # Assert: one bytes rung at 100.5 MB where b's last evaluation counts; compute rungs
    # (10 s and 30 s) stay apart
    byte_rows = [row for row in rows if row.startswith("| (b)")]
    assert len(byte_rows) == 1
    assert byte_rows[0].startswith("| (b) bytes <= 100.50 MB (a and b's costliest seeds, "
                                   "within 1%) | b 0.805")
    assert len([row for row in rows if row.startswith("| (d)")]) == 2


def test_payoff_crossing_ignores_a_one_seed_method_and_judges_the_final_stretch():
    # Prepare: fo and lora at 3 seeds (lora ahead at 12 client-rounds, fo from 24 on and clear
    # from 36); "lucky", full-parameter, one seed, best of all at 12 only
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    fed = {"clients-per-round": 2, "local-steps": 5, "batch-size": 8}
    curves = {"fo": ([0.0, 0.40, 0.53, 0.60, 0.65], "full", (0, 1, 2)),
              "lora": ([0.0, 0.50, 0.52, 0.53, 0.54], "lora", (0, 1, 2)),
              "lucky": ([0.0, 0.60, 0.30, 0.30, 0.30], "full", (0,))}
    runs = {}
    for name, (accs, params, seeds) in curves.items():
        for seed in seeds:
            jitter = 0.005 * (seed - 1)
            r = payoff_run(name, seed, [a + jitter if a else a for a in accs], [0] * 5, [0] * 5,
                           1000.0)
            for i, rec in enumerate(r["records"]):
                rec["round"] = 6 * i
            r.update(client_rounds=48, config={**fed, "fedavg-params": params})
            runs[r["id"]] = r

    # Execute
    grouped = payoff.groups(runs)
    table = "\n".join(payoff.learning_curve(grouped[("t", "dirichlet")], {}))

    # Assert: lucky leads the 12 row (one seed) but not the family comparison
    assert "| lucky | +9.5 points | one seed: no spread to judge by |" in table
    assert "| 12 | fo 0.400 | lora 0.500 | -10.0 points | clear |" in table
    assert ("Crossing: full-parameter training is ahead from 24 client-rounds on, to the last "
            "evaluation. Clear of the seed spread from 36 client-rounds on.") in table


def test_payoff_compute_sentence_says_how_many_pieces_measured_it():
    sys.path.insert(0, str(ROOT / "experiments"))
    import payoff

    one = payoff.compute_source({"meta": {"commands": ["python a"], "rounds": 6}})
    two = payoff.compute_source({"meta": {"commands": ["python a", "python b"], "rounds": 6}})

    assert "measured side by side in one piece by" in one
    assert "measured side by side, in 2 pieces, by" in two and "`python b`" in two


def test_results_page_is_current_and_check_names_a_stale_section(tmp_path, capsys):
    # Prepare: the page's copied tables, one of them edited by hand
    sys.path.insert(0, str(ROOT / "experiments"))
    import results_page

    text = (ROOT / "docs" / "results.md").read_text()
    first = results_page.parts(text)[0]
    lines = text.splitlines(keepends=True)
    lines[first.start] = "| a figure typed by hand |\n"
    stale = tmp_path / "results.md"
    stale.write_text("".join(lines))

    # Execute / Assert: the committed page matches its results files
    assert results_page.main(["--check"]) == 0, \
        "docs/results.md is not current: run `python experiments/results_page.py`"
    # ... the edited copy is named by its section, and rewritten back from the file
    assert results_page.main([str(stale), "--check"]) == 1
    assert f"section {first.heading!r} is stale" in capsys.readouterr().err
    assert results_page.main([str(stale)]) == 0
    assert stale.read_text() == text


def test_results_page_refuses_a_marker_it_cannot_resolve(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    import results_page

    page = tmp_path / "page.md"
    for spec in ('experiments/results/nothing.md',
                 'experiments/results/payoff/payoff.md section="no such section"',
                 'experiments/results/payoff/payoff.md table=99',
                 'experiments/results/payoff/payoff.md',  # would bring its headings in
                 'experiments/results/payoff/payoff.md rows=3'):
        page.write_text(f"# Page\n\n<!-- results: {spec} -->\n<!-- /results -->\n")
        assert results_page.main([str(page), "--check"]) == 2, spec
    page.write_text("<!-- results: experiments/results/demo_seeds.md -->\n")
    assert results_page.main([str(page)]) == 2  # never closed
