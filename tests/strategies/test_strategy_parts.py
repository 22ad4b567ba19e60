"""The FedCyBGD strategy's parts, one at a time: schedules, matching, versions, downloads, the
reply reader, the round record; and a user's own schedule and aggregator in a short run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from fedcybgd import protocol
from fedcybgd.compression import decode, encode, payload_from_array, payload_to_array, read_header
from fedcybgd.config import RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.protocol import Holding
from fedcybgd.strategies import FedCyBGD, RoundRecord, Schedule, Upload, run_totals
from fedcybgd.strategies.aggregate import weighted_mean
from fedcybgd.strategies.downloads import DownloadPlanner, stale_blocks
from fedcybgd.strategies.installing import BlockInstaller
from fedcybgd.strategies.matching import Assignment, match
from fedcybgd.strategies.reader import BlockUpload, NodeBook, ReplyReader
from fedcybgd.strategies.record import RoundInFlight
from fedcybgd.strategies.replies import BAD_PAYLOAD, NON_FINITE, NOT_TRAINED, DropLog, Dropped
from fedcybgd.strategies.schedule import (
    ORDERS,
    BlockSchedule,
    build_schedule,
    register_schedule,
    schedule_names,
    unregister_schedule,
)
from fedcybgd.strategies.screen import UpdateScreen
from fedcybgd.strategies.server_step import ServerStep
from fedcybgd.strategies.versions import BlockVersions

LAYERS = ["layer.0", "layer.1", "layer.2", "layer.3"]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, BlockMap]:
    """The 4-layer tiny Llama, one layer per block (embed, layer.0-3, head)."""
    model = load_model("tiny-llama")
    return model, BlockMap(model, 1)


def fresh(tiny: tuple[Any, BlockMap], history: int = 2) -> BlockVersions:
    """Block versions over a private copy of the tiny model's weights."""
    model, blocks = tiny
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return BlockVersions(blocks, weights, history=history)


def moved(versions: BlockVersions, block: str, by: float) -> dict[str, torch.Tensor]:
    """``block``'s current tensors shifted by ``by``."""
    return {k: v + by for k, v in versions.tensors(block).items()}


# ----------------------------------------------------------------------------- schedules
def test_builtin_orders_are_registered_by_their_config_names():
    assert set(ORDERS) <= set(schedule_names())
    for name in ORDERS:
        assert isinstance(build_schedule(name, LAYERS, seed=1), Schedule)


@pytest.mark.parametrize(("order", "first_cycle"), [
    ("ascending", LAYERS),
    ("descending", LAYERS[::-1]),
])
def test_fixed_orders_cycle_through_every_block(order, first_cycle):
    # Prepare
    schedule = build_schedule(order, LAYERS)
    # Execute: two cycles, two blocks a round
    taken = [schedule.take(2) for _ in range(4)]
    # Assert
    assert taken[0] + taken[1] == first_cycle
    assert taken[2] + taken[3] == first_cycle


def test_random_order_is_a_seeded_permutation_per_cycle():
    # Prepare
    a, b, c = (build_schedule("random", LAYERS, seed=s) for s in (3, 3, 4))
    # Execute
    cycles_a = [a.take(4) for _ in range(3)]
    cycles_b = [b.take(4) for _ in range(3)]
    cycles_c = [c.take(4) for _ in range(3)]
    # Assert: every cycle holds each block once; same seed, same order; another seed differs
    assert all(sorted(cycle) == LAYERS for cycle in cycles_a)
    assert cycles_a == cycles_b
    assert cycles_a != cycles_c


def test_spread_order_takes_blocks_far_apart():
    # Prepare
    blocks = [f"layer.{i}" for i in range(8)]
    schedule = build_schedule("spread", blocks)
    # Execute
    first, second = schedule.take(2), schedule.take(2)
    # Assert: evenly spaced through what is left of the cycle
    assert first == ["layer.0", "layer.4"]
    assert second == ["layer.1", "layer.5"]


def test_requeued_block_comes_first_once_and_never_twice_in_a_round():
    # Prepare
    schedule = build_schedule("ascending", LAYERS)
    assert schedule.take(2) == ["layer.0", "layer.1"]
    # Execute
    schedule.requeue("layer.1")
    schedule.requeue("layer.1")  # a second report of the same failure
    again = schedule.take(2)
    # Assert: the failed block first, then the cycle goes on
    assert again == ["layer.1", "layer.2"]
    assert schedule.take(2) == ["layer.3", "layer.0"]


def test_schedule_state_round_trips_through_json():
    # Prepare: a schedule in the middle of a random cycle, with a retry pending
    schedule = build_schedule("random", LAYERS, seed=9)
    schedule.take(3)
    schedule.requeue("layer.2")
    # Execute
    restored = build_schedule("random", LAYERS, seed=9)
    restored.load_state(json.loads(json.dumps(schedule.state())))
    # Assert: both hand out the same blocks from here on
    assert [restored.take(2) for _ in range(5)] == [schedule.take(2) for _ in range(5)]


class LargestFirst:
    """A user's schedule: blocks by a score, highest first (no base class needed)."""

    def __init__(self, blocks: Sequence[str], seed: int = 0) -> None:
        self.score = {b: float(i) for i, b in enumerate(blocks)}
        self.retry: list[str] = []

    def take(self, count: int) -> list[str]:
        ranked = sorted(self.score, key=lambda b: -self.score[b])
        chosen = [b for b in self.retry if b in self.score][:count]
        chosen += [b for b in ranked if b not in chosen][: count - len(chosen)]
        self.retry = [b for b in self.retry if b not in chosen]
        for b in chosen:
            self.score[b] -= 10.0
        return chosen

    def requeue(self, block: str) -> None:
        self.retry.append(block)

    def state(self) -> dict[str, Any]:
        return {"score": dict(self.score), "retry": list(self.retry)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.score, self.retry = dict(state["score"]), list(state["retry"])


def test_custom_schedule_registers_by_name_and_plugs_in(tiny):
    # Prepare
    model, blocks = tiny
    register_schedule("test-largest-first")(LargestFirst)
    # Execute
    try:
        by_name = FedCyBGD(block_map=blocks, weights=dict(model.named_parameters()),
                           cycle=LAYERS, config=RunConfig.from_run_config(
                               {"block-schedule": "test-largest-first"}))
        names = schedule_names()
    finally:
        unregister_schedule("test-largest-first")
    by_object = FedCyBGD(block_map=blocks, weights=dict(model.named_parameters()),
                         schedule=LargestFirst(LAYERS))
    # Assert
    assert isinstance(by_name.schedule, LargestFirst)
    assert by_name.schedule.take(2) == ["layer.3", "layer.2"]
    assert by_object.schedule.take(1) == ["layer.3"]
    assert "test-largest-first" in names and "test-largest-first" not in schedule_names()


def test_schedule_registry_refuses_a_taken_name_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        register_schedule("ascending")(LargestFirst)
    with pytest.raises(ValueError, match="unknown block schedule 'sideways'"):
        build_schedule("sideways", LAYERS)


def test_strategy_refuses_a_schedule_without_the_protocol(tiny):
    model, blocks = tiny

    class TakeOnly:
        def take(self, count: int) -> list[str]:
            return []

    with pytest.raises(TypeError, match="requeue"):
        FedCyBGD(block_map=blocks, weights=dict(model.named_parameters()),
                 schedule=TakeOnly())  # type: ignore[arg-type]


def test_block_schedule_class_still_takes_an_order_name():
    assert BlockSchedule(LAYERS, "descending").take(1) == ["layer.3"]
    with pytest.raises(ValueError, match="block-schedule"):
        BlockSchedule(LAYERS, "sideways")


# ------------------------------------------------------------------------------ matching
def test_without_budgets_nodes_take_blocks_in_sampling_order():
    # Execute
    pairs = match([7, 3, 9, 1], ["layer.2", "layer.0"], per_block=2, rule="fo")
    # Assert
    assert pairs == [Assignment(7, "layer.2", "fo"), Assignment(3, "layer.2", "fo"),
                     Assignment(9, "layer.0", "fo"), Assignment(1, "layer.0", "fo")]


def test_budgets_are_ignored_without_a_rule_picker():
    pairs = match([1, 2], ["layer.0", "layer.1"], per_block=1, rule="fo", budgets={1: 10.0})
    assert pairs == [Assignment(1, "layer.0", "fo"), Assignment(2, "layer.1", "fo")]


def test_with_budgets_roomy_nodes_take_low_blocks_and_tight_ones_sit_out():
    # Prepare: fo fits at >= 100 MB per layer above the block; lezo at >= 10 MB
    def rule_for_budget(preferred: str, block: str, budget: float) -> str | None:
        above = 4 - int(block.split(".")[1])
        if budget >= 100 * above:
            return preferred
        return "lezo" if budget >= 10 else None

    budgets = {1: 50.0, 2: 1000.0, 3: 1.0}  # node 4 declared nothing: room for anything
    # Execute
    pairs = match([1, 2, 3, 4], ["layer.3", "layer.1", "layer.0", "layer.2"], per_block=1,
                  rule="fo", budgets=budgets, rule_for_budget=rule_for_budget,
                  lowest_layer_of=lambda b: int(b.split(".")[1]))
    # Assert: by room, lowest layer first; node 3 fits nothing and is left out
    assert pairs == [Assignment(4, "layer.0", "fo"), Assignment(2, "layer.1", "fo"),
                     Assignment(1, "layer.2", "lezo")]


# ------------------------------------------------------------------------------ versions
def test_install_sets_version_and_checksum_and_keeps_the_pretrained_block(tiny):
    # Prepare
    versions = fresh(tiny)
    before = {k: v.clone() for k, v in versions.tensors("layer.1").items()}
    # Execute
    versions.install("layer.1", moved(versions, "layer.1", 0.5), version=3)
    # Assert
    assert versions.versions["layer.1"] == 3
    assert versions.current("layer.1") == Holding(3, content_checksum(versions.tensors("layer.1")))
    assert versions.current("layer.0") is None
    pretrained = versions.pretrained("layer.1")
    assert all(torch.equal(pretrained[k], before[k]) for k in before)


def test_replaced_versions_are_kept_as_delta_bases_up_to_the_history(tiny):
    # Prepare
    versions = fresh(tiny, history=1)
    versions.install("layer.0", moved(versions, "layer.0", 1.0), version=1)
    v1 = versions.current("layer.0")
    v1_tensors = {k: v.clone() for k, v in versions.tensors("layer.0").items()}
    versions.install("layer.0", moved(versions, "layer.0", 1.0), version=2)
    v2 = versions.current("layer.0")
    # Execute
    base_v1 = versions.base_for("layer.0", v1)
    base_v2 = versions.base_for("layer.0", v2)
    versions.install("layer.0", moved(versions, "layer.0", 1.0), version=3)
    after_trim = versions.base_for("layer.0", v1)
    # Assert: an exactly held version is the base while kept; then back to v0
    assert base_v1[0] == 1 and all(torch.equal(base_v1[1][k], v1_tensors[k]) for k in v1_tensors)
    assert base_v2[0] == 2
    assert after_trim[0] == 0
    assert versions.base_for("layer.0", Holding(2, "not-the-checksum"))[0] == 0


def test_install_checkpoint_and_state_restore_a_block(tiny):
    # Prepare: a server that installed layer.2 at round 4
    source = fresh(tiny)
    source.install("layer.2", moved(source, "layer.2", 0.25), version=4)
    # Execute: a new server puts the checkpointed tensors back, then the state
    target = fresh(tiny)
    original = {k: v.clone() for k, v in target.tensors("layer.2").items()}
    target.install_checkpoint("layer.2", source.tensors("layer.2"))
    target.load_state(json.loads(json.dumps(source.state())))
    # Assert
    assert target.current("layer.2") == source.current("layer.2")
    pretrained = target.pretrained("layer.2")
    assert all(torch.equal(pretrained[k], original[k]) for k in original)
    with pytest.raises(ValueError, match="tensors"):
        target.install_checkpoint("layer.2", {"nope": torch.zeros(1)})


def test_load_weights_needs_every_parameter(tiny):
    versions = fresh(tiny)
    with pytest.raises(ValueError, match="lack parameters"):
        versions.load_weights({})


# ----------------------------------------------------------------------------- downloads
def planner(versions: BlockVersions, fraction: float = 1.0) -> DownloadPlanner:
    return DownloadPlanner(versions, exact_codec="xor+zstd", download_codec="int8+zstd",
                           fraction=fraction, seed=5)


def test_a_pretrained_model_needs_no_download(tiny):
    # Execute
    down = planner(fresh(tiny)).plan(1, node=1, assigned="layer.0", held={})
    # Assert
    assert list(down.arrays.keys()) == [] and down.expect == {} and down.bytes == 0


def test_trained_block_is_sent_exact_and_frozen_blocks_lossy(tiny):
    # Prepare: layer.0 and layer.1 moved in round 1
    versions = fresh(tiny)
    for block in ("layer.0", "layer.1"):
        versions.install(block, moved(versions, block, 0.01), version=1)
    # Execute
    down = planner(versions).plan(2, node=1, assigned="layer.0", held={})
    # Assert: layer.0 exact (checksum of the global block), layer.1 approximate
    assert sorted(down.arrays.keys()) == ["layer.0", "layer.1"]
    assert down.expect["layer.0"] == versions.current("layer.0")
    assert down.expect["layer.1"].version == 1
    assert down.expect["layer.1"] != versions.current("layer.1")
    payload = payload_from_array(down.arrays["layer.0"])
    exact = decode(payload, base=versions.pretrained("layer.0"), max_bytes=len(payload)).tensors
    assert all(torch.equal(exact[k], v) for k, v in versions.tensors("layer.0").items())
    assert down.bytes == sum(len(payload_from_array(a)) for a in down.arrays.values())
    assert down.raw_bytes > down.bytes


def test_approximate_copies_are_kept_frozen_but_replaced_for_training(tiny):
    # Prepare: the node holds an approximate copy of layer.1's current version
    versions = fresh(tiny)
    versions.install("layer.1", moved(versions, "layer.1", 0.01), version=1)
    approx = Holding(1, "0" * 64)
    # Execute
    frozen = stale_blocks(versions, {"layer.1": approx}, assigned="layer.0")
    trained = stale_blocks(versions, {"layer.1": approx}, assigned="layer.1")
    exact = stale_blocks(versions, {"layer.1": versions.current("layer.1")}, assigned="layer.1")
    # Assert
    assert frozen == ([], [])
    assert trained == (["layer.1"], [])
    assert exact == ([], [])


def test_delta_is_taken_against_the_version_the_node_holds(tiny):
    # Prepare: the node holds v1 exactly; the block is now v2
    versions = fresh(tiny)
    versions.install("layer.2", moved(versions, "layer.2", 0.01), version=1)
    held = {"layer.2": versions.current("layer.2")}
    versions.install("layer.2", moved(versions, "layer.2", 0.01), version=2)
    # Execute
    down = planner(versions).plan(3, node=1, assigned="layer.2", held=held)
    # Assert
    payload = payload_from_array(down.arrays["layer.2"])
    header = read_header(payload, max_bytes=len(payload))
    assert (header.base_version, header.target_version) == (1, 2)
    assert down.expect == {"layer.2": versions.current("layer.2")}


def test_random_dropping_sends_a_seeded_share_of_stale_frozen_blocks(tiny):
    # Prepare: four blocks moved; the node trains a fifth
    versions = fresh(tiny)
    for block in LAYERS:
        versions.install(block, moved(versions, block, 0.01), version=1)
    half = planner(versions, fraction=0.5)
    # Execute
    first = half.plan(2, node=1, assigned="embed", held={})
    again = half.plan(2, node=1, assigned="embed", held={})
    other = [sorted(half.plan(2, node=n, assigned="embed", held={}).arrays.keys())
             for n in range(2, 12)]
    with_own = half.plan(2, node=1, assigned="layer.3", held={})
    # Assert: ceil(0.5 * 4) blocks, the same for the same node and round, not for all nodes
    assert len(first.arrays) == 2 and sorted(first.arrays.keys()) == sorted(again.arrays.keys())
    assert any(keys != sorted(first.arrays.keys()) for keys in other)
    assert "layer.3" in with_own.arrays  # the node's own block is never dropped


def test_nodes_needing_the_same_payload_share_one_encoding(tiny):
    # Prepare
    versions = fresh(tiny)
    versions.install("layer.1", moved(versions, "layer.1", 0.01), version=1)
    plan, cache = planner(versions), {}
    # Execute
    a = plan.plan(2, node=1, assigned="layer.0", held={}, payloads=cache)
    b = plan.plan(2, node=2, assigned="layer.0", held={}, payloads=cache)
    # Assert
    assert len(cache) == 1 and a.bytes == b.bytes


# ----------------------------------------------------------------------------- installing
def installer_round(versions: BlockVersions, blocks: list[str]) -> tuple[BlockInstaller,
                                                                          RoundInFlight]:
    """An installer over ``versions`` and round 3 in flight on ``blocks``, nodes 1, 2, 3..."""
    schedule = BlockSchedule(list(versions.versions), "ascending")
    installer = BlockInstaller(versions, schedule, UpdateScreen(), ServerStep(), weighted_mean)
    record = RoundRecord.training(3, "fo")
    record.blocks = list(blocks)
    pairs = [Assignment(i + 1, b, "fo") for i, b in enumerate(blocks)]
    live = RoundInFlight(record, pairs, seeds={a.node: 100 + a.node for a in pairs})
    live.sent = [Message(RecordDict(), dst_node_id=a.node, message_type=MessageType.TRAIN)
                 for a in pairs]
    return installer, live


def upload(tensors: dict[str, torch.Tensor], examples: float, loss: float) -> BlockUpload:
    return BlockUpload(examples, tensors, {"train_loss": loss, "peak_mem_mb": 10.0,
                                           "train_s": 1.0}, "fo")


def test_installer_installs_finite_merges_and_requeues_the_rest(tiny):
    # Prepare: layer.0 gets an upload, layer.1 none, layer.2 a non-finite one
    versions = fresh(tiny)
    installer, live = installer_round(versions, ["layer.0", "layer.1", "layer.2"])
    good = moved(versions, "layer.0", 0.5)
    bad = {k: torch.full_like(v, float("nan")) for k, v in versions.tensors("layer.2").items()}
    arrived = [("layer.2", (3, upload(bad, 8, 9.0), 1.0)),
               ("layer.0", (1, upload(good, 8, 1.0), 1.0))]
    drops = DropLog(3)
    # Execute
    installer.close(live, arrived, drops)
    # Assert
    record = live.record
    assert versions.versions["layer.0"] == 3 and versions.versions["layer.1"] == 0
    assert all(torch.equal(versions.tensors("layer.0")[k], v) for k, v in good.items())
    assert record.accepted == {"layer.0": [1]}
    assert record.failed_blocks == ["layer.1", "layer.2"]
    assert record.dropped == {NON_FINITE: 1}
    assert installer.retry_seeds == {"layer.1": 102, "layer.2": 103}
    assert installer.schedule.take(2) == ["layer.1", "layer.2"]  # re-queued first
    assert record.train_loss == pytest.approx(5.0)  # both losses, weighted by examples


def test_installer_merges_in_the_order_instructions_went_out(tiny):
    # Prepare: two nodes share layer.0 and their replies arrive in reverse order
    versions = fresh(tiny)
    installer, live = installer_round(versions, ["layer.0", "layer.0"])
    live.record.blocks = ["layer.0"]
    a, b = moved(versions, "layer.0", 0.1), moved(versions, "layer.0", 0.3)
    arrived = [("layer.0", (2, upload(b, 2, 1.0), 1.0)), ("layer.0", (1, upload(a, 6, 1.0), 1.0))]
    # Execute
    installer.close(live, arrived, DropLog(3))
    # Assert: the accepted list follows the instructions; the merge is the weighted mean
    assert live.record.accepted == {"layer.0": [1, 2]}
    for k, v in versions.tensors("layer.0").items():
        assert torch.allclose(v, 0.75 * a[k] + 0.25 * b[k], atol=1e-6)


# -------------------------------------------------------------------------------- reader
def reply_with(block: str, payload: bytes, *, status: str = protocol.OK, examples: int = 8,
               reason: str = "") -> Message:
    """A node's reply to a train instruction for ``block``."""
    instruction = Message(RecordDict(), dst_node_id=7, message_type=MessageType.TRAIN)
    state = ConfigRecord({protocol.STATUS: status, protocol.HOLDINGS: "{}",
                          protocol.REASON: reason, protocol.RULE: "fo",
                          protocol.MEMORY_BUDGET: 512.0})
    content = RecordDict({protocol.STATE: state})
    if status == protocol.OK:
        content[protocol.METRICS] = MetricRecord({protocol.NUM_EXAMPLES: examples,
                                                  "train_loss": 1.5})
        content[protocol.UPLOAD] = ArrayRecord({block: payload_to_array(payload)})
    return Message(content, reply_to=instruction)


def reader_for(versions: BlockVersions, **limits: Any) -> ReplyReader:
    options = {"upload_codec": "delta+fp16+zstd", "seedlog_fallback": "delta+int8+zstd",
               "max_steps": 2, "max_examples": 8,
               "max_payload_bytes": 2**31, **limits}
    return ReplyReader(versions, NodeBook(), **options)


def test_reader_decodes_an_upload_and_notes_the_node(tiny):
    # Prepare
    versions = fresh(tiny)
    trained = moved(versions, "layer.1", 0.125)
    payload = encode(trained, "delta+fp16+zstd", block="layer.1", target_version=1,
                     base_version=0, base=versions.tensors("layer.1"))
    reader, record = reader_for(versions), RoundRecord.training(1, "fo")
    # Execute
    got = reader.read(reply_with("layer.1", payload, examples=50), 7, "layer.1", record)
    # Assert: examples capped; the block decoded against the start; budget and bytes noted
    assert got.weight == 8 and got.rule == "fo" and got.metrics["train_loss"] == 1.5
    assert all(torch.allclose(got.tensors[k], v, atol=1e-3) for k, v in trained.items())
    assert reader.nodes.budgets == {7: 512.0} and reader.nodes.holdings == {7: {}}
    assert record.bytes_up == len(payload)


def test_reader_excludes_a_node_that_rejects_and_counts_oversized_uploads(tiny):
    # Prepare
    versions = fresh(tiny)
    payload = encode(versions.tensors("layer.0"), "fp32", block="layer.0", target_version=1)
    reader, record = reader_for(versions, max_payload_bytes=100), RoundRecord.training(1, "fo")
    # Execute
    with pytest.raises(Dropped) as rejected:
        reader.read(reply_with("layer.0", b"", status=protocol.REJECTED, reason="no room"),
                    7, "layer.0", record)
    with pytest.raises(Dropped) as oversized:
        reader.read(reply_with("layer.0", payload), 8, "layer.0", record)
    # Assert: the rejecting node sits out; the big upload crossed the wire, so it counts
    assert rejected.value.reason == NOT_TRAINED and reader.nodes.excluded == {7: "no room"}
    assert oversized.value.reason == BAD_PAYLOAD and record.bytes_up == len(payload)
    assert reader.payload_limit("layer.0") == 100


# -------------------------------------------------------------------------------- record
FEDCYBGD_ROW = {
    "round": 2, "blocks": ["layer.1"], "clients": ["1001", "1002"], "update_rule": ["fo"],
    "failed_blocks": [], "bytes_down": 10, "bytes_up": 4, "bytes_down_raw": 40,
    "bytes_up_raw": 16, "wire_bytes_down": 900, "wire_bytes_up": 600, "train_loss": None,
    "client_peak_mem_mb": 512.0,
    "client_train_s": 0.5, "examples": 16, "dropped": {"no-reply": 1},
    "accepted": {"layer.1": ["1001"]}, "eval_loss": 2.0, "eval_accuracy": 0.5, "eval_s": 0.1,
    "round_s": 1.0,
}
FEDAVG_ROW = {
    "round": 1, "clients": ["5"], "update_rule": ["fedavg-full"], "dropped_uploads": 0,
    "dropped": {}, "bytes_down": 100, "bytes_up": 100, "bytes_down_raw": 100,
    "bytes_up_raw": 100, "wire_bytes_down": 700, "wire_bytes_up": 400,
    "client_peak_mem_mb": 900.0, "client_train_s": 2.0, "examples": 8,
    "train_loss": 1.25, "eval_s": 0.0, "round_s": 3.0,
}


def test_record_row_has_the_metrics_contract_keys():
    # Prepare: a round as the strategy and the server fill it
    record = RoundRecord.training(3, "zerolock")
    record.blocks, record.clients = ["layer.0", "layer.1"], [1001, 1002]
    record.count_upload(8, 400, "fo", 300.0, 1.5)
    record.accepted = {"layer.0": [1001]}
    record.failed_blocks = ["layer.1"]
    record.round_s = 2.0
    # Execute
    row = record.to_json()
    zero = RoundRecord(0, eval_loss=1.0, eval_accuracy=0.5, eval_examples=16).to_json()
    # Assert: docs/outputs.md's keys, node ids as text, the rule set
    assert list(row) == ["round", "blocks", "clients", "update_rule", "failed_blocks",
                         "bytes_down", "bytes_up", "bytes_down_raw", "bytes_up_raw",
                         "wire_bytes_down", "wire_bytes_up",
                         "train_loss", "client_peak_mem_mb", "client_train_s", "examples",
                         "dropped", "accepted", "round_s"]
    assert row["clients"] == ["1001", "1002"] and row["accepted"] == {"layer.0": ["1001"]}
    assert row["update_rule"] == ["fo"] and row["train_loss"] is None
    assert RoundRecord.training(4, "zerolock").to_json()["update_rule"] == ["zerolock"]
    assert zero == {"round": 0, "eval_loss": 1.0, "eval_accuracy": 0.5, "eval_examples": 16}


@pytest.mark.parametrize("row", [FEDCYBGD_ROW, FEDAVG_ROW, {"round": 0, "eval_loss": 3.0,
                                                             "eval_accuracy": 0.25,
                                                             "other_tool": 1}])
def test_rows_round_trip_through_the_record(row):
    assert RoundRecord.from_json(row).to_json() == row


def test_metric_record_and_totals_come_from_the_record():
    # Prepare
    record = RoundRecord.from_json(FEDCYBGD_ROW)
    record.train_loss = 1.75
    # Execute
    metrics = record.to_metric_record()
    totals = run_totals([{"round": 0, "eval_loss": 3.0, "eval_accuracy": 0.25},
                         FEDCYBGD_ROW, record])
    # Assert
    assert dict(metrics) == {"blocks_trained": 1, "blocks_failed": 0, "bytes_down": 10,
                             "bytes_up": 4, "bytes_down_raw": 40, "bytes_up_raw": 16,
                             "wire_bytes_down": 900, "wire_bytes_up": 600,
                             "client_peak_mem_mb": 512.0, "dropped": 1, "train_loss": 1.75}
    assert totals["bytes_down"] == 20 and totals["dropped"] == {"no-reply": 2}
    assert totals["wire_bytes_down"] == 1800 and totals["wire_bytes_up"] == 1200
    assert totals["initial_eval_accuracy"] == 0.25 and totals["final_eval_loss"] == 2.0
    assert totals["best_eval_accuracy"] == 0.5 and totals["mean_round_s"] == 1.0
    assert run_totals([])["mean_round_s"] is None


# ------------------------------------------------------- a user's schedule and aggregator
def test_a_users_schedule_and_aggregator_run_a_round(tiny_run_config, tmp_path: Path):
    # Prepare: two nodes share one block; the aggregator keeps the first upload only
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid

    config = dict(tiny_run_config, **{"clients-per-block": 2})
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model("tiny-llama")
    seen: list[int] = []

    def first_only(uploads: Sequence[Upload]) -> dict[str, torch.Tensor]:
        seen.append(len(uploads))
        return uploads[0][1]

    weights = dict(model.named_parameters())
    strategy = FedCyBGD(block_map=BlockMap(model, 1), weights=weights,
                        base_hash=content_checksum(weights), schedule=LargestFirst(LAYERS),
                        aggregate=first_only, config=RunConfig.from_run_config(
                            {"clients-per-round": 2, "clients-per-block": 2, "local-steps": 2,
                             "batch-size": 4, "upload-codec": "delta+fp16+zstd",
                             "node-wait": 0.0}))
    # Execute
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    in_flight = strategy.round
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    # Assert: the round in flight held both nodes on the schedule's block; it installed
    assert in_flight is not None and sorted(in_flight.seeds) == sorted(grid.contexts)
    assert {a.block for a in in_flight.pairs} == {"layer.3"} and not in_flight.awaiting
    assert seen == [2]
    assert strategy.history[-1].accepted == {"layer.3": [a.node for a in in_flight.pairs]}
    assert strategy.versions["layer.3"] == 1
    assert math.isfinite(strategy.history[-1].train_loss or math.nan)
