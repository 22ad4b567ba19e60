"""User-level differential privacy: the accountant against independent computations, the clip
bounding each node's influence, the noise's scale and distribution, the budget the run enforces.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy import optimize, stats

from fedcybgd.protocol.dp import (
    NoiseKey,
    adaptive_noise,
    add_noise,
    clip_delta,
    delta_norm,
    epsilon,
)
from fedcybgd.strategies.privacy import AdaptiveClip, PrivacyLedger


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of a Gaussian mechanism of sensitivity 1 and deviation ``sigma`` at
    ``delta`` (Balle and Wang's analytic formula, solved for epsilon)."""
    def gap(eps: float) -> float:
        return (stats.norm.cdf(-eps * sigma + 1 / (2 * sigma))
                - math.exp(eps) * stats.norm.cdf(-eps * sigma - 1 / (2 * sigma)) - delta)
    return float(optimize.brentq(gap, 0.0, 500.0))


@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (2.0, 10), (4.0, 50), (0.8, 3)])
def test_full_participation_epsilon_bounds_the_exact_gaussian_and_stays_close(z, rounds):
    # T Gaussian rounds of multiplier z compose exactly into one of multiplier z / sqrt(T)
    exact = exact_gaussian_epsilon(z / math.sqrt(rounds), 1e-5)
    # Execute
    ours = epsilon([(1.0, rounds)], z, 1e-5)
    # Assert: RDP is an upper bound, and not a loose one
    assert exact <= ours <= 1.35 * exact + 0.05, (exact, ours)


@pytest.mark.parametrize(("q", "z", "rounds"), [(0.1, 1.0, 100), (0.04, 0.8, 300),
                                                 (0.01, 1.1, 1000)])
def test_subsampled_epsilon_bounds_the_pld_accountant(q, z, rounds):
    # Prepare: dp-accounting's privacy-loss-distribution accountant (a different method,
    # near exact) on the same mechanism
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    pld = PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    tight = pld.get_epsilon(1e-5)
    # Execute
    ours = epsilon([(q, rounds)], z, 1e-5)
    # Assert
    assert tight <= ours <= 1.3 * tight, (tight, ours)


def test_subsampling_amplifies_and_more_rounds_cost_more():
    assert epsilon([(0.05, 100)], 1.0, 1e-5) < epsilon([(1.0, 100)], 1.0, 1e-5)
    assert epsilon([(0.05, 100)], 1.0, 1e-5) < epsilon([(0.05, 200)], 1.0, 1e-5)
    assert epsilon([(0.05, 100)], 2.0, 1e-5) < epsilon([(0.05, 100)], 1.0, 1e-5)
    assert epsilon([(0.05, 100)], 0.0, 1e-5) == math.inf


# ---------------------------------------------------------------------------- the ledger
def test_the_ledger_refuses_the_round_that_would_exceed_the_target():
    # Prepare
    ledger = PrivacyLedger("central", noise_multiplier=1.0, delta=1e-5, target_epsilon=3.0)
    # Execute: record rounds while allowed
    ran = 0
    while True:
        ok, after = ledger.allows(0.1)
        if not ok:
            break
        ledger.record(0.1)
        ran += 1
    # Assert: the spent epsilon is within the target; one more round would pass it
    assert 0 < ledger.spent() <= 3.0 < after
    assert ran == sum(ledger.rates.values()) >= 3


def test_local_dp_counts_the_node_that_took_part_most_without_amplification():
    ledger = PrivacyLedger("local", noise_multiplier=2.0, delta=1e-5)
    for nodes in (["a", "b"], ["a", "c"], ["a", "b"]):
        ledger.record(0.1, nodes)
    assert ledger.spent() == pytest.approx(epsilon([(1.0, 3)], 2.0, 1e-5))


def test_the_ledger_survives_its_checkpoint_state():
    ledger = PrivacyLedger("central", 1.0, 1e-5)
    for rate in (0.1, 0.1, 0.2):
        ledger.record(rate)
    again = PrivacyLedger("central", 1.0, 1e-5)
    again.load_state(ledger.state())
    assert again.spent() == ledger.spent()


# ------------------------------------------------------------------- clip and noise
def test_clipping_bounds_an_adversarially_large_update():
    start = {"w": torch.zeros(50, 40), "b": torch.zeros(7)}
    huge = {"w": torch.full((50, 40), 1e30), "b": torch.full((7,), -1e30)}
    clipped, norm = clip_delta(huge, start, 0.5)
    assert norm > 1e30 and delta_norm(clipped, start) == pytest.approx(0.5, rel=1e-6)
    small = {"w": torch.full((50, 40), 1e-4), "b": torch.zeros(7)}
    kept, _ = clip_delta(small, start, 0.5)
    assert torch.equal(kept["w"], small["w"])  # within the bound: unchanged


def test_clipping_refuses_a_non_finite_update():
    with pytest.raises(ValueError, match="not finite"):
        clip_delta({"w": torch.tensor([math.nan])}, {"w": torch.tensor([0.0])}, 1.0)


def test_noise_has_the_asked_scale_and_is_gaussian():
    # Execute: noise on 200,000 zeros
    zeros = {"a": torch.zeros(100_000), "b": torch.zeros(100_000)}
    key = NoiseKey()
    noised = add_noise(zeros, std=0.3, key=key, label="merge/1")
    values = torch.cat([noised["a"], noised["b"]]).double().numpy()
    # Assert: mean ~0, deviation 0.3 (chi-square interval), normal by Kolmogorov-Smirnov,
    # keyed (same key and label, same noise; another label or another key, other noise)
    n = values.size
    assert abs(values.mean()) < 4 * 0.3 / math.sqrt(n)
    low, high = (math.sqrt(stats.chi2.ppf(p, n) / n) * 0.3 for p in (1e-6, 1 - 1e-6))
    assert low < values.std() < high
    assert stats.kstest(values / 0.3, "norm").pvalue > 1e-4
    assert torch.equal(add_noise(zeros, 0.3, key, "merge/1")["a"], noised["a"])
    assert torch.equal(add_noise(zeros, 0.3, NoiseKey.from_hex(key.hex()), "merge/1")["a"],
                       noised["a"])
    assert not torch.equal(add_noise(zeros, 0.3, key, "merge/2")["a"], noised["a"])
    assert not torch.equal(add_noise(zeros, 0.3, NoiseKey(), "merge/1")["a"], noised["a"])
    # the two tensors' noises are independent draws, not one draw repeated
    assert abs(float(torch.corrcoef(torch.stack([noised["a"], noised["b"]]))[0, 1])) < 0.02


# ------------------------------------------------------------------ merged at the server
def test_the_dp_mean_adds_noise_of_multiplier_times_clip_over_n():
    from fedcybgd.strategies.privacy import DpMean

    # Prepare: 4 uploads that did not move a 200,000-weight block
    start = {"w": torch.zeros(200_000)}
    merge = DpMean(noise_std=0.5 * 2.0, key=NoiseKey())  # multiplier 0.5, clip 2.0
    # Execute
    merged = merge([(1.0, start), (5.0, start), (1.0, start), (2.0, start)])
    # Assert: the noise on the mean has deviation 0.5 x 2.0 / 4, examples do not weigh
    values = merged["w"].double().numpy()
    n = values.size
    low, high = (math.sqrt(stats.chi2.ppf(p, n) / n) * 0.25 for p in (1e-6, 1 - 1e-6))
    assert low < values.std() < high and abs(values.mean()) < 4 * 0.25 / math.sqrt(n)
    plain = DpMean(noise_std=0.0, key=NoiseKey())([(1.0, {"w": torch.ones(3)}),
                                          (9.0, {"w": torch.zeros(3)})])
    assert torch.equal(plain["w"], torch.full((3,), 0.5))


def _dp_run(tiny_run_config, tmp_path, node_config=None, **overrides):
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    config = dict(tiny_run_config, **{"clients-per-round": 4, "clients-per-block": 2,
                                      "num-server-rounds": 4, "eval-every": 0, **overrides})
    grid = LoopbackGrid(client_app, 8, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}"),
                                               **(node_config or {})})
    run = RunConfig.from_run_config(config)
    if run.strategy == "fedavg":
        from fedcybgd.server.baselines import run_fedavg

        summary = run_fedavg(grid, run)
    else:
        summary = run_server(grid, run, node_wait_s=5)
    out = Path(config["output-dir"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, out


def test_a_central_dp_run_accounts_every_round(tiny_run_config, tmp_path):
    # Execute: 8 nodes, 4 sampled a round (q = 0.5), noise multiplier 1, clip 0.05
    summary, rows, out = _dp_run(tiny_run_config, tmp_path, **{
        "dp": "central", "dp-clip-norm": 0.05, "dp-noise-multiplier": 1.0})
    # Assert: each round's epsilon is the accountant's after that many rounds at q = 0.5
    spent = [r["dp_epsilon"] for r in rows[1:]]
    assert spent == pytest.approx([epsilon([(0.5, k)], 1.0, 1e-5) for k in (1, 2, 3, 4)])
    assert summary["dp_epsilon"] == pytest.approx(spent[-1]) and summary["dp_stop"] is None
    assert summary["status"] == "completed" and all(r["accepted"] for r in rows[1:])
    card = json.loads((out / "final" / "privacy.json").read_text())
    assert card["dp"] == "central" and card["dp_epsilon"] == pytest.approx(spent[-1])
    # the model card beside the weights says what the model is and what privacy it has
    readme = (out / "final" / "README.md").read_text()
    assert "`tiny-llama`" in readme and "update rule `fo`" in readme
    assert f"`central`: epsilon {spent[-1]:.4g} at delta 1e-05" in readme


def test_a_run_stops_before_the_round_that_would_exceed_its_budget(tiny_run_config, tmp_path):
    # Prepare: a budget two rounds fit in and three do not
    two, three = (epsilon([(0.5, k)], 1.0, 1e-5) for k in (2, 3))
    # Execute
    summary, rows, out = _dp_run(tiny_run_config, tmp_path, **{
        "dp": "central", "dp-clip-norm": 0.05, "dp-target-epsilon": (two + three) / 2})
    # Assert: two rounds ran, the third was not started; the run completed, saying why
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert summary["dp_epsilon"] == pytest.approx(two)
    assert summary["dp_epsilon"] < summary["dp_target_epsilon"]
    assert "round 3 would take epsilon" in summary["dp_stop"]
    assert summary["status"] == "completed" and (out / "final" / "privacy.json").exists()


def test_central_dp_clips_every_upload_at_the_server_and_turns_self_sync_off(tiny_run_config):
    from fedcybgd.config import RunConfig
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.loading import load_model
    from fedcybgd.strategies import FedCyBGD

    model = load_model("tiny-llama")
    run = RunConfig.from_run_config({**tiny_run_config, "dp": "central", "dp-clip-norm": 0.3,
                                     "clients-per-block": 1, "self-sync": True})
    strategy = FedCyBGD.from_config(run, BlockMap(model, 1), dict(model.named_parameters()))
    assert strategy.screen.max_norm == 0.3 and strategy.self_sync is False
    # a hostile node's upload far above the bound (within the screen's other limits) leaves
    # the screen clipped to it
    start = strategy.block_tensors("layer.0")
    direction = {k: torch.randn_like(v) for k, v in start.items()}
    scale = 2.0 / delta_norm(direction, {k: torch.zeros_like(v) for k, v in start.items()})
    large = {k: v + direction[k] * scale for k, v in start.items()}  # a delta of norm 2.0
    admitted, _ = strategy.screen.admit("layer.0", start, large)
    assert delta_norm(admitted, start) == pytest.approx(0.3, rel=1e-4)


def test_local_dp_noise_comes_from_the_node_not_the_server():
    from fedcybgd.client.app import private_update
    from fedcybgd.config import RunConfig

    run = RunConfig.from_run_config({"dp": "local", "dp-clip-norm": 0.1,
                                     "dp-noise-multiplier": 2.0})
    start = {"w": torch.zeros(10_000)}
    trained = {"w": torch.full((10_000,), 5.0)}
    # Execute: the same update, twice
    (one, _), (two, _) = private_update(run, trained, start), private_update(run, trained, start)
    # Assert: clipped to 0.1 then noised at 0.2 a coordinate, with fresh noise each time
    assert not torch.equal(one["w"], two["w"])
    assert float(one["w"].std()) == pytest.approx(0.2, rel=0.05)
    assert float(one["w"].mean()) == pytest.approx(0.1 / 100, abs=4 * 0.2 / 100)


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"aggregate": "median"}, "use 'auto' or 'mean'"),
    ({"upload-codec": "seedlog", "download-codec": "fp32"}, "not a clipped delta"),
    ({"dp-noise-multiplier": 0.0}, "adds no noise"),
    ({"strategy": "fedavg", "dp": "local"}, "only dp = 'central'"),
    ({"dp": "local", "dp-adaptive-clip": True}, "only dp = 'central'"),
    ({"dp-adaptive-clip": True, "dp-clip-count-stddev": 0.4}, "above dp-noise-multiplier"),
])
def test_dp_settings_that_would_not_be_private_are_refused_at_start(overrides, fragment):
    from fedcybgd.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        RunConfig.from_run_config({"dp": "central", **overrides})


@pytest.mark.slow
def test_dp_through_flwr_run_as_the_docs_show(tmp_path):
    # Prepare: docs/privacy.md's adaptive-clipping command (its first command and these keys)
    # with a tiny model, a private Flower home and ports
    import os
    import socket
    import subprocess
    import sys

    from fedcybgd.cli.demo import stop_local_superlink

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    home, out = tmp_path / "flwr-home", tmp_path / "out"
    env = {**os.environ, "FLWR_HOME": str(home),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    command = [str(Path(sys.executable).with_name("fedcybgd")), "run", ".", "local",
               "--run-config", "dp='central' dp-clip-norm=0.05 dp-noise-multiplier=1.0 "
               "dp-target-epsilon=8 clients-per-round=4 dp-adaptive-clip=true "
               "dp-clip-quantile=0.5",
               "--run-config", f"model='tiny-llama' layers-per-block=1 num-server-rounds=2 "
               f"local-steps=2 batch-size=4 max-seq-len=48 eval-examples=16 "
               f"output-dir='{out}'",
               "--federation-config", "num-supernodes=8 client-resources-num-cpus=1"]
    # Execute
    try:
        done = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], env=env,
                              capture_output=True, text=True, timeout=900, check=False)
    finally:
        stop_local_superlink(home)
    # Assert: completed, every round accounted at q = 4 / 8, the clip adapted from 0.05 on
    # the nodes' votes (through real ClientApps)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["dp_epsilon"] for r in rows[1:]] == pytest.approx(
        [epsilon([(0.5, k)], 1.0, 1e-5) for k in (1, 2)])
    assert rows[1]["dp_clip_norm"] == pytest.approx(0.05)
    assert rows[2]["dp_clip_norm"] == pytest.approx(rows[1]["dp_clip_next"]) != 0.05
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dp"] == "central" and summary["run_config"]["dp-target-epsilon"] == 8.0


def test_fedavg_runs_under_flowers_dp_wrapper_and_stops_at_its_budget(tiny_run_config,
                                                                      tmp_path):
    from transformers import AutoModelForCausalLM

    from fedcybgd.model.loading import load_model

    # Prepare: FedAvg over the whole model, 4 of 8 nodes a round, a clip far below the
    # nodes' updates, a budget two rounds fit in and three do not
    two, three = (epsilon([(0.5, k)], 1.0, 1e-5) for k in (2, 3))
    summary, rows, out = _dp_run(tiny_run_config, tmp_path, **{
        "strategy": "fedavg", "dp": "central", "dp-clip-norm": 1e-3,
        "dp-noise-multiplier": 1.0, "dp-target-epsilon": (two + three) / 2})
    # Assert: two rounds ran and were accounted
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert summary["rounds"] == 2 and summary["dp_epsilon"] == pytest.approx(two)
    assert "DifferentialPrivacyServerSideFixedClipping" in summary["dp_accounting"]
    readme = (out / "final" / "README.md").read_text()
    assert "FedAvg over full parameters" in readme and f"epsilon {two:.4g}" in readme
    # ... and Flower's wrapper bounded the model's move: two averages of clipped updates plus
    # noise of 1 x 1e-3 / 4 a coordinate and round
    start = {k: v.detach() for k, v in load_model("tiny-llama").named_parameters()}
    final = {k: v.detach() for k, v in
             AutoModelForCausalLM.from_pretrained(out / "final").named_parameters()}
    moved = math.sqrt(sum(float((final[k].double() - start[k].double()).pow(2).sum())
                          for k in start))
    size = sum(v.numel() for v in start.values())
    noise = math.sqrt(2 * size) * 1e-3 / 4
    assert moved == pytest.approx(noise, rel=0.1)  # the clipped updates are tiny beside it


# ------------------------------------------------------------------------ adaptive clipping


def test_adaptive_noise_is_flowers_and_accounts_at_the_asked_multiplier():
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    for z, m, stddev in [(1.0, 20, 1.0), (3.3, 20, 3.3), (0.5, 100, 5.0)]:
        z_update = adaptive_noise(z, stddev)
        assert z_update == pytest.approx(compute_adaptive_noise_params(z, m, stddev)[1])
        # the update (sensitivity: the clip) and the centred count (sensitivity 1/2) together
        # are one Gaussian mechanism of multiplier z
        assert (z_update ** -2 + (2 * stddev) ** -2) ** -0.5 == pytest.approx(z)
        assert z_update > z
    with pytest.raises(ValueError, match="above dp-noise-multiplier"):
        adaptive_noise(2.0, 1.0)


def _norms(rounds: int, nodes: int, seed: int) -> torch.Tensor:
    """Honest nodes' delta norms, round by round: log-normal around 0.3."""
    generator = torch.Generator().manual_seed(seed)
    return 0.3 * torch.exp(0.5 * torch.randn((rounds, nodes), generator=generator))


@pytest.mark.parametrize("quantile", [0.5, 0.8])
def test_the_adaptive_clip_settles_at_the_asked_quantile_of_the_norms(quantile):
    # Prepare: a clip far too small, 20 nodes a round, the count noised at deviation 1
    clip = AdaptiveClip(clip=0.01, quantile=quantile, lr=0.2, count_stddev=1.0,
                        key=NoiseKey(bytes(32)))
    norms = _norms(400, 20, seed=0)
    # Execute: each round the nodes vote whether their norm was within the clip
    trace = [clip.update((row <= clip.clip).tolist()) for row in norms]
    # Assert: over the last 200 rounds the clip left about `quantile` of the norms unclipped
    late = torch.tensor(trace[199:399])
    share = float((norms[200:] <= late[:, None]).double().mean())
    assert share == pytest.approx(quantile, abs=0.05)


@pytest.mark.parametrize(("vote", "low", "high"), [(True, 0.28, 0.47), (False, 0.53, 0.72)])
def test_colluding_nodes_lying_about_their_norms_move_the_clip_only_by_their_share(vote, low,
                                                                                   high):
    # Prepare: 4 of every 20 nodes always vote the same way, whatever their norms (a shrink or
    # a growth attack on the clip), against the median
    clip = AdaptiveClip(clip=0.3, quantile=0.5, lr=0.2, count_stddev=1.0,
                        key=NoiseKey(bytes([4]) * 32))
    honest = _norms(400, 16, seed=1)
    # Execute
    trace = [clip.update([*(row <= clip.clip).tolist(), *[vote] * 4]) for row in honest]
    # Assert: the clip settles where the honest share within it is (0.5 - 4/20) / (16/20) =
    # 0.375 (liars say within) or 0.5 / (16/20) = 0.625 (liars say above): it neither
    # collapses to zero nor runs away, round after round
    late = torch.tensor(trace[199:399])
    share = float((honest[200:] <= late[:, None]).double().mean())
    assert low < share < high
    assert float(late.min()) > 0.05 and float(late.max()) < 2.0


def test_the_node_clips_to_the_rounds_clip_and_votes_on_it():
    from fedcybgd.client.app import private_update
    from fedcybgd.config import RunConfig

    run = RunConfig.from_run_config({"dp": "central", "dp-clip-norm": 1.0,
                                     "dp-adaptive-clip": True})
    start = {"w": torch.zeros(100)}
    trained = {"w": torch.full((100,), 0.05)}  # a delta of norm 0.5
    # Execute: the round's clip above, then below the delta's norm; and no clip sent
    within, above = (private_update(run, trained, start, clip) for clip in (0.8, 0.2))
    default = private_update(run, trained, start)
    # Assert
    assert within[1] is True and delta_norm(within[0], start) == pytest.approx(0.5)
    assert above[1] is False and delta_norm(above[0], start) == pytest.approx(0.2)
    assert default[1] is None and delta_norm(default[0], start) == pytest.approx(0.5)


def test_an_adaptive_clip_run_moves_the_clip_accounts_alike_and_resumes_it(tiny_run_config,
                                                                          tmp_path):
    # Prepare: a clip far below the nodes' deltas, so every node votes "above" and it grows
    adaptive = {"dp": "central", "dp-clip-norm": 0.01, "dp-noise-multiplier": 1.0,
                "dp-adaptive-clip": True}
    # Execute: 4 rounds at once; 2 rounds, then resumed to 4
    _, rows, _ = _dp_run(tiny_run_config, tmp_path / "once", **adaptive,
                         **{"output-dir": str(tmp_path / "once" / "out")})
    _dp_run(tiny_run_config, tmp_path / "split", **adaptive, **{
        "num-server-rounds": 2, "output-dir": str(tmp_path / "split" / "out")})
    summary, resumed, _ = _dp_run(tiny_run_config, tmp_path / "split", **adaptive, **{
        "resume": True, "output-dir": str(tmp_path / "split" / "out")})
    # Assert: each round used the clip the previous one set, and it grew from 0.01; epsilon is
    # the fixed clip's at the same multiplier (the count is inside it)
    clips = [r["dp_clip_norm"] for r in rows[1:]]
    assert clips[0] == pytest.approx(0.01)
    assert clips[1:] == pytest.approx([r["dp_clip_next"] for r in rows[1:-1]])
    assert clips[-1] > 0.01 * 1.1
    assert [r["dp_epsilon"] for r in rows[1:]] == pytest.approx(
        [epsilon([(0.5, k)], 1.0, 1e-5) for k in (1, 2, 3, 4)])
    # the resumed run went on from the checkpointed clip, across the resume too
    split = [r["dp_clip_norm"] for r in resumed[1:]]
    assert split[0] == pytest.approx(0.01)
    assert split[1:] == pytest.approx([r["dp_clip_next"] for r in resumed[1:-1]], rel=1e-12)
    # the count noise is the run's own secret's, not the shared seed's: same seed, other draws
    assert split[1:] != pytest.approx(clips[1:], rel=1e-9)
    assert summary["status"] == "completed"


def test_fedavg_takes_flowers_adaptive_clipping_wrapper(tiny_run_config, tmp_path):
    summary, rows, _ = _dp_run(tiny_run_config, tmp_path, **{
        "strategy": "fedavg", "dp": "central", "dp-clip-norm": 0.01, "dp-noise-multiplier": 1.0,
        "dp-adaptive-clip": True, "num-server-rounds": 2})
    assert summary["status"] == "completed" and [r["round"] for r in rows] == [0, 1, 2]
    assert "DifferentialPrivacyServerSideAdaptiveClipping" in summary["dp_accounting"]
    assert summary["dp_epsilon"] == pytest.approx(epsilon([(0.5, 2)], 1.0, 1e-5))


# ------------------------------------------------------------ draws nobody else can make
def _config_seeded_noise(tensors, std, seed):
    """Noise as an attacker holding the run config would regenerate it, were it drawn from a
    generator seeded by the run's ``seed`` and the merge's index (a CPU generator, float64, the
    tensors in sorted name order)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(tensors[name].shape, generator=generator, dtype=torch.float64) * std
            for name in sorted(tensors)}


def test_central_noise_cannot_be_regenerated_from_the_run_config(tiny_run_config, tmp_path):
    from fedcybgd.harness.byzantine import Federation

    # Prepare: central DP, exact installs (the easiest case for the attacker: each install is
    # the clipped mean plus the noise), four nodes on one block a round
    clip, multiplier, nodes = 0.05, 1.0, 4
    fed = Federation(dict(tiny_run_config, **{
        "dp": "central", "dp-clip-norm": clip, "dp-noise-multiplier": multiplier,
        "install-codec": "none", "clients-per-round": nodes, "clients-per-block": nodes,
        "eval-every": 0}), tmp_path, nodes=nodes)
    std = multiplier * clip / nodes
    seed = fed.run.seed
    for server_round in range(1, 5):
        starts = {b: {k: v.detach().double().clone()
                      for k, v in fed.strategy.block_tensors(b).items()}
                  for b in fed.strategy.cycle}
        # Execute: a round, then both attacks on every install it made
        entry = fed.play(server_round)
        assert entry.blocks and not entry.failed_blocks, entry.dropped
        merge = fed.strategy.aggregate.merges
        for block in entry.blocks:
            start = starts[block]
            step = {k: v.detach().double() - start[k]
                    for k, v in fed.strategy.block_tensors(block).items()}
            guessed = _config_seeded_noise(step, std, (seed * 1_000_003 + merge) % 2**63)
            keyed = {k: torch.from_numpy(fed.strategy.noise_key.normal(
                v.numel(), f"merge/{merge}/{k}")).reshape(v.shape) * std
                for k, v in step.items()}
            from_config = delta_norm({k: v - guessed[k] for k, v in step.items()},
                                     {k: torch.zeros_like(v) for k, v in step.items()})
            with_key = delta_norm({k: v - keyed[k] for k, v in step.items()},
                                  {k: torch.zeros_like(v) for k, v in step.items()})
            noise = std * math.sqrt(sum(v.numel() for v in step.values()))
            # Assert: the server's own key removes the noise and leaves the clipped mean (norm
            # at most the clip); the run config's seed removes nothing, every round
            assert with_key <= clip * 1.001, (server_round, block, with_key)
            assert from_config > 1.2 * noise, (server_round, block, from_config, noise)


def test_central_dp_samples_nodes_from_its_secret_and_resumes_with_it(tiny_run_config,
                                                                     tmp_path):
    from fedcybgd.harness.byzantine import Federation

    # Prepare: two central-DP runs with the same seed, 8 nodes, 2 sampled a round; and the same
    # without DP
    def sampled(dp: str, where: str) -> tuple[list[list[str]], Federation]:
        fed = Federation(dict(tiny_run_config, **{
            "dp": dp, "dp-clip-norm": 0.05, "clients-per-round": 2, "eval-every": 0}),
            tmp_path / where, nodes=8)
        rounds = []
        for server_round in range(1, 7):
            fed.play(server_round)
            rounds.append(sorted(fed.strategy.sampler.keys.ident(n)
                                 for n in fed.strategy.history[-1].clients))
        return rounds, fed

    # Execute
    one, fed = sampled("central", "a")
    two, _ = sampled("central", "b")
    plain_one, _ = sampled("off", "c")
    plain_two, _ = sampled("off", "d")
    # Assert: without DP the seed gives the run (same nodes every round); with central DP the
    # sample is not predictable from the seed (6 rounds of 2 of 8 alike by chance: 28**-6)
    assert plain_one == plain_two
    assert one != two
    # the key is in the strategy's checkpointed state and nowhere a node or a reader of the
    # run's files outside the checkpoint sees it; restored, it draws the same
    state = json.loads(json.dumps(fed.strategy.state()))
    secret = state["privacy"]["noise_key"]
    assert len(secret) == 64 and repr(fed.strategy.noise_key) == "NoiseKey(<secret>)"
    _, twin = sampled("central", "e")
    assert twin.strategy.noise_key.normal(8, "merge/9").tolist() != \
        fed.strategy.noise_key.normal(8, "merge/9").tolist()
    twin.strategy.load_state(state)
    assert twin.strategy.noise_key.normal(8, "merge/9").tolist() == \
        fed.strategy.noise_key.normal(8, "merge/9").tolist()
    with pytest.raises(ValueError, match="noise key"):
        twin.strategy.load_state({**state, "privacy": {k: v for k, v in state["privacy"].items()
                                                       if k != "noise_key"}})


# ------------------------------------------------------------- local DP: the node's own floor
def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    text = (tmp_path / "out" / "metrics.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


@pytest.mark.parametrize(("run_dp", "node", "fragment"), [
    ({"dp": "local", "dp-noise-multiplier": 1e-9, "dp-clip-norm": 1000.0},
     {"dp-min-noise-multiplier": 0.5}, "dp-noise-multiplier' = 1e-09 is below this node's "
                                       "dp-min-noise-multiplier = 0.5"),
    ({"dp": "local", "dp-noise-multiplier": 1.0, "dp-clip-norm": 1000.0},
     {"dp-max-clip-norm": 1.0}, "dp-clip-norm' = 1000 is beyond this node's limit "
                                "dp-max-clip-norm = 1"),
    ({"dp": "off"}, {"dp-min-noise-multiplier": 0.5}, "leaves this node's upload without its "
                                                      "own noise"),
    ({"dp": "central", "dp-clip-norm": 0.05}, {"dp-min-noise-multiplier": 0.5},
     "leaves this node's upload without its own noise"),
])
def test_a_node_refuses_weaker_privacy_than_its_own_floor_every_round(
        run_dp, node, fragment, tiny_run_config, tmp_path, caplog):
    from fedcybgd.server.verdict import RunFailed

    # Execute: a hostile run config over three rounds, every node with its own floor
    with pytest.raises(RunFailed, match="no block was installed in 3 rounds"):
        _dp_run(tiny_run_config, tmp_path, node_config=node,
                **{**run_dp, "num-server-rounds": 3})
    # Assert: no round took an upload, each node said why, naming the key; the run ended
    # saying that nothing was installed
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(not r["accepted"] for r in rows[1:]), rows
    assert fragment in caplog.text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "failed"


def test_a_node_accounts_local_dp_itself_against_its_own_epsilon_limit(tiny_run_config,
                                                                      tmp_path, caplog):
    from fedcybgd.server.verdict import RunFailed

    # Execute: a run config asking almost no noise; the nodes set only an epsilon limit
    with pytest.raises(RunFailed, match="no block was installed in 2 rounds"):
        _dp_run(tiny_run_config, tmp_path, node_config={"max-dp-epsilon": 8.0},
                **{"dp": "local", "dp-noise-multiplier": 1e-6, "dp-clip-norm": 1000.0,
                   "num-server-rounds": 2})
    # Assert: every node declines (its epsilon would be astronomical) and takes no further
    # part, so nothing is installed in either round (all 8 nodes asked)
    assert all(not r["accepted"] for r in _rows(tmp_path)[1:])
    assert "above its max-dp-epsilon = 8" in caplog.text


def test_a_node_within_its_limits_spends_local_dp_in_its_own_ledger(tiny_run_config, tmp_path):
    # Execute: honest local DP within the floor and the epsilon limit
    _, rows, _ = _dp_run(tiny_run_config, tmp_path,
                               node_config={"dp-min-noise-multiplier": 0.5,
                                            "max-dp-epsilon": 1000.0},
                               **{"dp": "local", "dp-noise-multiplier": 1.0,
                                  "dp-clip-norm": 0.001, "num-server-rounds": 2})
    # Assert: rounds were taken, and each node that trained wrote one rate-1 mechanism a round
    assert all(r["accepted"] for r in rows[1:]), rows
    ledgers = sorted(tmp_path.glob("cache-*/privacy/dp-ledger-*.json"))
    assert ledgers
    for ledger in ledgers:
        runs = json.loads(ledger.read_text())["runs"]
        entries = [e for es in runs.values() for e in es]
        assert entries and all(e == [1.0, 1.0, 1] for e in entries)
