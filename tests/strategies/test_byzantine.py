"""Several hostile nodes over several rounds: the screen cannot be ratcheted, a minority of
colluders cannot stop learning, uploads are bound to what the round asked for, and nothing a
node sends can make an install end the run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Message

from fedcybgd.compression import decode, encode, read_header
from fedcybgd.harness.byzantine import Colluders, Federation
from fedcybgd.harness.faults import set_upload, upload_of
from fedcybgd.strategies.aggregate import register_aggregator, trimmed_mean, unregister_aggregator


def shared_block(tiny_run_config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Four nodes a round, all on one block (one block a round)."""
    return dict(tiny_run_config, **{"clients-per-round": 4, "clients-per-block": 4,
                                    "eval-examples": 64, "eval-batch-size": 32, **extra})


def learn(config: dict[str, Any], tmp_path: Path, colluders: int, rounds: int = 5) -> float:
    """Eval loss after ``rounds`` with the first ``colluders`` nodes pushing (adaptive)."""
    fed = Federation(config, tmp_path)
    attack = Colluders(set(fed.node_ids()[:colluders])) if colluders else None
    for server_round in range(1, rounds + 1):
        fed.play(server_round, attack)
    assert attack is None or attack.forged == colluders * rounds
    return fed.eval_loss()


# ------------------------------------------------------------------------ colluders, learning
_HONEST: dict[str, tuple[float, float]] = {}


@pytest.fixture
def honest(tiny_run_config: dict[str, Any], tmp_path: Path) -> tuple[float, float]:
    """(eval loss before, after 5 honest rounds) of the shared-block federation, computed once
    (``output-dir``, the only per-test key, plays no part in it)."""
    if not _HONEST:
        config = shared_block(tiny_run_config)
        before = Federation(config, tmp_path / "before").eval_loss()
        _HONEST["mean"] = (before, learn(config, tmp_path / "honest", colluders=0))
    return _HONEST["mean"]


def test_one_pusher_of_four_stalls_a_plain_mean(honest, tiny_run_config, tmp_path):
    # The attack has teeth: under `mean` one node of four just under the screen's bounds
    # undoes most of the honest nodes' progress.
    before, after = honest
    attacked = learn(shared_block(tiny_run_config, aggregate="mean"), tmp_path, colluders=1)
    assert attacked > after + 0.3 * (before - after), (before, after, attacked)


@pytest.mark.parametrize("aggregate", ["median", "trimmed-mean", "centered-clip",
                                       "geometric-median"])
def test_one_pusher_of_four_cannot_stop_learning(aggregate, honest, tiny_run_config, tmp_path):
    # Prepare: the same federation, one node of four pushing along one direction every round
    before, after = honest
    # Execute
    attacked = learn(shared_block(tiny_run_config, aggregate=aggregate), tmp_path, colluders=1)
    # Assert: the model learns as the honest federation does (within 5% of its progress)
    assert attacked < after + 0.05 * (before - after), (before, after, attacked)


def test_two_colluders_of_four_cannot_ratchet_the_screen(tiny_run_config, tmp_path):
    # Prepare: the adaptive pushers, half of each block's nodes, under `median`
    fed = Federation(shared_block(tiny_run_config, aggregate="median"), tmp_path)
    attack = Colluders(set(fed.node_ids()[:2]))
    own = {b: fed.block_rms(b) for b in fed.strategy.cycle}
    # Execute: three visits of every block
    for server_round in range(1, 3 * len(fed.strategy.cycle) + 1):
        entry = fed.play(server_round, attack)
        assert not entry.failed_blocks, entry.dropped  # they are accepted...
    # Assert: ...but the reference the screen compares with stays below the block-relative
    # bound (it comes only from installs), so it does not grow visit after visit, and no block
    # is more than a small multiple of its own size away from where it started
    ratio = fed.strategy.screen.max_ratio
    for block in fed.strategy.cycle:
        ref = fed.strategy.screen.reference(block)
        assert ref is not None and ref <= ratio * own[block] * 1.01, (block, ref, own[block])
        names = fed.strategy.block_map.info(block).param_names
        moved = math.sqrt(sum(float((fed.strategy.weights[n].detach().double()
                                     - fed.pretrained[n].double()).square().sum())
                              for n in names)) / math.sqrt(sum(fed.pretrained[n].numel()
                                                               for n in names))
        assert moved < 3 * ratio * own[block], (block, moved, own[block])


def test_trimmed_mean_trims_one_of_four():
    honest = [(1.0, {"w": torch.full((8,), float(i))}) for i in range(3)]
    hostile = (1.0, {"w": torch.full((8,), 1e6)})
    merged = trimmed_mean(0.2)([*honest, hostile])["w"]  # floor(0.2 x 4) = 0, yet one is cut
    assert torch.equal(merged, torch.full((8,), 1.5))


# ------------------------------------------------------------------------------ round one
def test_round_one_wipe_is_refused(tiny_run_config, tmp_path):
    # Prepare: exact uploads, no history yet
    fed = Federation(dict(tiny_run_config, **{"upload-codec": "fp32"}), tmp_path, nodes=2)
    before = {n: p.detach().clone() for n, p in fed.model.named_parameters()}

    def wipe(strategy: Any, replies: list[Message]) -> None:
        for reply in replies:
            block, payload = upload_of(reply)
            header = read_header(payload, max_bytes=len(payload))
            start = strategy.block_tensors(block)
            set_upload(reply, encode({k: 0.001 * v for k, v in start.items()}, "fp32",
                                     block=block, target_version=header.target_version,
                                     base_version=header.base_version))
    # Execute
    entry = fed.play(1, wipe)
    # Assert: both wipes refused by name, nothing moved, the blocks wait for another visit
    assert entry.dropped == {"outlier": 2} and sorted(entry.failed_blocks) == sorted(entry.blocks)
    for name, param in fed.model.named_parameters():
        assert torch.equal(param, before[name]), name


# ------------------------------------------------------------------- bound to the instruction
def _resend(fed: Federation, make: Any) -> Any:
    """A round in which every node sends ``make(strategy, block, header)`` instead."""

    def tamper(strategy: Any, replies: list[Message]) -> None:
        for reply in replies:
            block, payload = upload_of(reply)
            set_upload(reply, make(strategy, block, read_header(payload, max_bytes=len(payload))))
    return tamper


def test_rollback_to_pretrained_with_stale_versions_is_a_mismatch(tiny_run_config, tmp_path):
    # Prepare: a lossy-delta run trains every block once
    fed = Federation(tiny_run_config, tmp_path, nodes=2)
    for server_round in (1, 2):
        assert not fed.play(server_round).failed_blocks
    versions = dict(fed.strategy.versions)
    before = {n: p.detach().clone() for n, p in fed.model.named_parameters()}
    pretrained = fed.pretrained

    def rollback(strategy: Any, block: str, header: Any) -> bytes:
        names = strategy.block_map.info(block).param_names
        return encode({n: pretrained[n] for n in names}, "fp32", block=block,
                      target_version=header.target_version - 2, base_version=0)
    # Execute
    entry = fed.play(3, _resend(fed, rollback))
    # Assert: dropped as a mismatch; no block rolled back, no version moved
    assert entry.dropped == {"mismatch": 2}, entry.dropped
    for name, param in fed.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert {b: v for b, v in fed.strategy.versions.items() if b not in entry.blocks} == {
        b: v for b, v in versions.items() if b not in entry.blocks}


@pytest.mark.parametrize("case", ["codec", "stale base", "future target", "float64",
                                  "bfloat16"])
def test_upload_not_what_was_asked_is_a_mismatch(case, tiny_run_config, tmp_path):
    # Prepare: an exact-upload run, so each forged payload is otherwise acceptable
    fed = Federation(dict(tiny_run_config, **{"upload-codec": "fp32"}), tmp_path, nodes=2)

    def forged(strategy: Any, block: str, header: Any) -> bytes:
        start = strategy.block_tensors(block)
        spec, base_version, target = "fp32", header.base_version, header.target_version
        tensors = {k: v.detach().clone() for k, v in start.items()}
        if case == "codec":
            spec = "fp16"
        elif case == "stale base":
            base_version += 1
        elif case == "future target":
            target += 1
        else:
            tensors = {k: v.to(getattr(torch, case)) for k, v in tensors.items()}
        return encode(tensors, spec, block=block, target_version=target,
                      base_version=base_version)
    # Execute
    entry = fed.play(1, _resend(fed, forged))
    # Assert
    assert entry.dropped == {"mismatch": 2}, entry.dropped


# ------------------------------------------------------------------- installs end no run
def test_install_whose_rounding_overflows_cannot_end_the_run(tiny_run_config, tmp_path):
    # Prepare: the screen off entirely, exact uploads and a quantized install; two nodes share
    # a block, and
    # the block carries a rounding residual of 3e38 in one coordinate (what an earlier spike
    # can leave behind), so the next spike's install target is +inf in that coordinate
    config = shared_block(tiny_run_config, **{
        "clients-per-round": 2, "clients-per-block": 2, "outlier-factor": 0,
        "max-update-ratio": 0, "install-codec": "delta+int8+zstd", "upload-codec": "fp32"})
    fed = Federation(config, tmp_path, nodes=2)
    block = fed.strategy.cycle[0]
    start = fed.strategy.block_tensors(block)
    first = next(iter(start))
    residual = {k: torch.zeros_like(v) for k, v in start.items()}
    residual[first].view(-1)[0] = 3e38
    fed.strategy.step.moments[block] = {"r": residual}
    before = {n: p.detach().clone() for n, p in fed.model.named_parameters()}

    def spike(strategy: Any, block: str, header: Any) -> bytes:
        base = strategy.block_tensors(block)
        tensors = {k: v.detach().clone() for k, v in base.items()}
        tensors[first].view(-1)[0] = 3e38
        return encode(tensors, "fp32", block=block, target_version=header.target_version,
                      base_version=header.base_version)
    # Execute: the round closes (no exception)
    entry = fed.play(1, _resend(fed, spike))
    # Assert: both uploads dropped by name, nothing installed, the block re-queued
    assert entry.failed_blocks == [block] and entry.dropped == {"non-finite": 2}, entry.dropped
    for name, param in fed.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert fed.strategy.schedule.take(1) == [block]


def test_huge_coordinate_is_refused_by_the_block_bound_without_rounding(tiny_run_config,
                                                                          tmp_path):
    # With install-codec = none nothing would catch 3e38 but the block-relative bound
    fed = Federation(dict(tiny_run_config, **{"install-codec": "none", "upload-codec": "fp32",
                                              "outlier-factor": 0}), tmp_path, nodes=2)

    def spike(strategy: Any, block: str, header: Any) -> bytes:
        tensors = {k: v.detach().clone() for k, v in strategy.block_tensors(block).items()}
        tensors[next(iter(tensors))].view(-1)[0] = 3e38
        return encode(tensors, "fp32", block=block, target_version=header.target_version,
                      base_version=header.base_version)
    entry = fed.play(1, _resend(fed, spike))
    assert entry.dropped == {"outlier": 2}, entry.dropped
    assert all(float(p.detach().abs().max()) < 1e30 for p in fed.model.parameters())


def test_an_aggregator_that_raises_is_a_named_drop(tiny_run_config, tmp_path):
    # Prepare: a plug-in aggregator that fails on every merge
    @register_aggregator("always-fails")
    def _factory(**_: Any) -> Any:
        def merge(uploads: Any) -> Any:
            raise RuntimeError("this aggregator always fails")
        return merge

    try:
        fed = Federation(shared_block(tiny_run_config, **{"clients-per-round": 2,
                                                          "clients-per-block": 2,
                                                          "aggregate": "always-fails"}),
                         tmp_path, nodes=2)
        # Execute
        entry = fed.play(1)
    finally:
        unregister_aggregator("always-fails")
    # Assert: the round closed, both uploads counted as dropped, the block re-queued
    assert entry.failed_blocks == entry.blocks and sum(entry.dropped.values()) == 2, entry
    assert fed.strategy.schedule.take(1) == entry.blocks


def test_decoded_forged_upload_keeps_the_honest_header(tiny_run_config, tmp_path):
    # The harness's forgeries are what the round asked for: only the screen and the
    # aggregator stand in their way (otherwise the tests above would prove nothing)
    fed = Federation(shared_block(tiny_run_config), tmp_path)
    replies = fed.replies(1)
    honest = [read_header(upload_of(r)[1], max_bytes=1 << 30) for r in replies]
    Colluders(set(fed.node_ids()))(fed.strategy, replies)
    for reply, was in zip(replies, honest, strict=True):
        block, payload = upload_of(reply)
        now = read_header(payload, max_bytes=len(payload))
        assert (now.spec, now.block, now.base_version, now.target_version) == (
            was.spec, was.block, was.base_version, was.target_version)
        start = fed.strategy.block_tensors(block)
        decode(payload, base=start, expect_block=block, max_bytes=len(payload))


# --------------------------------------------------------- the default bounds a minority
@pytest.mark.parametrize("kind", ["push", "flip"])
def test_with_the_defaults_two_colluders_of_five_stay_near_the_honest_drift(
        kind, tiny_run_config, tmp_path):
    # Prepare: five nodes on each round's block, `aggregate` left at its default; two of them
    # collude every round (push: just under the screen's bounds along one direction; flip:
    # their honest update reversed, 4x), from every block's first visit on
    config = shared_block(tiny_run_config, **{"clients-per-round": 5, "clients-per-block": 5})
    rounds = 2 * 4  # two visits of each of the 4 layer blocks

    def drifts(colluders: int, where: str) -> tuple[list[float], float, float]:
        fed = Federation(config, tmp_path / where, nodes=5)
        attack = Colluders(set(fed.node_ids()[:colluders]), kind=kind) if colluders else None
        before, out = fed.eval_loss(), []
        for server_round in range(1, rounds + 1):
            fed.play(server_round, attack)
            out.append(fed.drift())
        assert attack is None or attack.forged == colluders * rounds
        return out, before, fed.eval_loss()

    # Execute
    (honest, before, after), (attacked, _, attacked_after) = (drifts(0, "honest"),
                                                              drifts(2, "attacked"))
    # Assert: in every round, first visits included, the attacked model is within 3x of the
    # honest run's distance from the pretrained one, and it learned as the honest run did
    # (under `mean` the pushers drift it ~9x as far and the flippers undo all of the learning)
    ratios = [a / h for a, h in zip(attacked, honest, strict=True)]
    assert max(ratios) <= 3.0, ratios
    assert before - attacked_after >= 0.9 * (before - after), (before, after, attacked_after)
