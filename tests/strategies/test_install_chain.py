"""Install-delta chains: a node that missed several installs of a block is sent their deltas.

Loopback runs of the real ServerApp strategy and ClientApp on a tiny random Llama, 8 nodes, 2 a
round, two blocks, in two layouts. One node per block (self-sync): each install is what its
node's upload decodes to, so that upload is the delta that makes the block's previous version
into it, for every node holding that version. Two nodes on one block (the long payoff
profile's layout): the server installs their merge rounded to one delta (`install-codec`), and
that delta is the one kept. A node behind several
installs is sent them one after another (record ``download-chain``) and holds the block
exactly, at fewer bytes than the whole block; a chain broken in transit is a resync, never a
wrong block; a node refuses chains beyond its ``max-chain-mb``; the kept deltas survive a
checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import torch
from flwr.app import Message
from flwr.common.serde import message_from_proto, message_to_proto

from fedcybgd import protocol
from fedcybgd.compression import payload_from_array
from fedcybgd.core.checksum import content_checksum
from fedcybgd.strategies.checkpoint_entries import INSTALL_PAYLOAD
from fedcybgd.strategies.replies import NOT_TRAINED
from fedcybgd.strategies.versions import BlockVersions
from tests.client.test_traffic import node_store, play, setup

ROUNDS = 12


def layout(tiny_run_config: dict[str, Any], tmp_path: Path, chain: int,
           per_block: int = 1) -> dict[str, Any]:
    """2 of 8 nodes a round on the tiny model's 2 blocks, the default int2 codecs: with
    ``per_block`` 1 one node on each block (self-sync), with 2 both on one block (the long
    payoff profile's layout: rounded installs)."""
    return dict(tiny_run_config, **{"layers-per-block": 2, "num-server-rounds": ROUNDS,
                                    "clients-per-block": per_block,
                                    "install-chain": chain, "eval-every": 0,
                                    "output-dir": str(tmp_path / f"out-{chain}")})


def chained_blocks(message: Message) -> dict[str, int]:
    """Block -> chain length of a train instruction's ``download-chain`` record."""
    record = message.content.array_records.get(protocol.DOWNLOAD_CHAIN)
    return protocol.read_chain_keys(record.keys()) if record is not None else {}


def run(config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """Play every round; what was sent, each block version's server checksum, the bytes."""
    grid, strategy = setup(config, tmp_path, nodes=8)
    truth: dict[tuple[str, int], str] = {}
    chains: list[tuple[int, int, str]] = []  # (round, node, block) of every chain sent
    for server_round in range(1, ROUNDS + 1):
        sent = play(strategy, grid, server_round)
        for message in sent:
            for block in chained_blocks(message):
                chains.append((server_round, message.metadata.dst_node_id, block))
        for block, version in strategy.versions.items():
            truth[(block, version)] = strategy.checksums.get(block, "")
        if chains and chains[-1][0] == server_round:
            # Assert (each round): a node sent a chain holds that block exactly (the version
            # it trained from, or the one it then self-synced)
            for _, node, block in [c for c in chains if c[0] == server_round]:
                held = node_store(tmp_path, strategy, node).holdings[block]
                assert truth[(block, held.version)] == held.checksum, (server_round, node)
    lossy = sum(truth.get((block, held.version)) != held.checksum
                for holdings in strategy.holdings.values()
                for block, held in holdings.items())
    return {"strategy": strategy, "grid": grid, "chains": chains, "lossy": lossy,
            "down": sum(h.bytes_down for h in strategy.history)}


@pytest.mark.parametrize("per_block", [1, 2], ids=["self-synced", "rounded-installs"])
def test_nodes_behind_several_installs_get_their_deltas_and_hold_blocks_exactly(
        tiny_run_config, tmp_path, per_block):
    # Prepare / Execute: the same seeded run keeping the last install's delta or the last 8
    one = run(layout(tiny_run_config, tmp_path, 1, per_block), tmp_path / "one")
    eight = run(layout(tiny_run_config, tmp_path, 8, per_block), tmp_path / "eight")
    # Assert: nothing was dropped or resynced in either run
    for result in (one, eight):
        assert all(h.dropped == {} and h.failed_blocks == [] for h in result["strategy"].history)
    # ... chains went only where kept deltas allow them, and each left its block exact
    assert not one["chains"] and len(eight["chains"]) >= 5, eight["chains"]
    # ... so fewer copies are lossy and fewer bytes went down
    assert eight["lossy"] < one["lossy"], (eight["lossy"], one["lossy"])
    assert eight["down"] < 0.75 * one["down"], (eight["down"], one["down"])


def test_a_self_synced_upload_is_kept_as_the_install_delta_only_when_it_makes_the_install(
        tiny_run_config, tmp_path):
    # Prepare: a server step of size 1 installs what the upload decodes to; of size 0.5 not
    kept = {}
    for server_lr in (1.0, 0.5):
        config = dict(layout(tiny_run_config, tmp_path, 8), **{"server-lr": server_lr})
        grid, strategy = setup(config, tmp_path / str(server_lr), nodes=8)
        # Execute
        for server_round in range(1, 5):
            play(strategy, grid, server_round)
        assert all(h.dropped == {} for h in strategy.history)
        kept[server_lr] = strategy.blocks.install_payloads()
    # Assert: every install of size 1 kept its upload (both blocks each round: 4 apiece); at
    # size 0.5 none could serve
    assert [len(v) for v in kept[1.0].values()] == [4, 4], kept[1.0]
    assert kept[0.5] == {}


def test_a_chain_crosses_the_wire_as_flower_protobuf_unchanged(tiny_run_config, tmp_path):
    # Prepare: play until a round sends a chain
    grid, strategy = setup(layout(tiny_run_config, tmp_path, 8), tmp_path, nodes=8)
    chained: list[Message] = []
    for server_round in range(1, ROUNDS + 1):
        chained = [m for m in play(strategy, grid, server_round) if chained_blocks(m)]
        if chained:
            break
    assert chained, "no round sent a chain"
    message = chained[0]
    message.metadata.__dict__["_message_id"] = str(uuid4())
    # Execute: the bytes a SuperLink would carry, and back
    proto = message_to_proto(message).SerializeToString()
    back = message_from_proto(type(message_to_proto(message)).FromString(proto))
    # Assert: the same chain keys, each delta byte for byte
    assert chained_blocks(back) == chained_blocks(message)
    sent = message.content.array_records[protocol.DOWNLOAD_CHAIN]
    got = back.content.array_records[protocol.DOWNLOAD_CHAIN]
    assert all(payload_from_array(got[k]) == payload_from_array(sent[k]) for k in sent)


def tamper_first_chain(how: str) -> Any:
    def tamper(messages: list[Message]) -> None:
        for message in messages:
            lengths = chained_blocks(message)
            block = next((b for b, n in lengths.items() if n >= 2), None)
            if block is None:
                continue
            record = message.content.array_records[protocol.DOWNLOAD_CHAIN]
            first, second = protocol.chain_key(block, 0), protocol.chain_key(block, 1)
            if how == "gap":
                del record[second]
            elif how == "swap":
                record[first], record[second] = record[second], record[first]
            elif how == "bad-key":
                record[f"{block}#x"] = record[first]
            tampered.append((message.metadata.dst_node_id, block))
            return
    tampered: list[tuple[int, str]] = []
    tamper.tampered = tampered  # type: ignore[attr-defined]
    return tamper


@pytest.mark.parametrize("how", ["gap", "swap", "bad-key"])
def test_a_broken_chain_is_a_resync_never_a_wrong_block(tiny_run_config, tmp_path, how):
    # Prepare: play until a round sends a chain, damaging its first chain in transit
    grid, strategy = setup(layout(tiny_run_config, tmp_path, 8), tmp_path, nodes=8)
    tamper = tamper_first_chain(how)
    replies: list[Message] = []
    server_round = 0
    while not tamper.tampered and server_round < ROUNDS:
        server_round += 1
        before = {n: dict(h) for n, h in strategy.holdings.items()}
        # Execute
        play(strategy, grid, server_round, tamper_sent=tamper, tamper_replies=replies.extend)
    assert tamper.tampered, "no round sent a chain"
    node, block = tamper.tampered[0]
    # Assert: the node trained nothing and said why; the server dropped its upload and
    # forgot what it holds (a full resync follows); its cache holds no wrong block
    reply = next(r for r in replies if r.metadata.src_node_id == node
                 and int(r.metadata.group_id) == server_round)
    state = reply.content.config_records[protocol.STATE]
    assert state[protocol.STATUS] == protocol.RESYNC, state
    assert strategy.history[-1].dropped.get(NOT_TRAINED) == 1
    store = node_store(tmp_path, strategy, node)
    held = store.holdings.get(block)
    assert held is None or held == before.get(node, {}).get(block) or \
        held.version < strategy.versions[block]
    # ... and the run goes on: the next rounds train with nothing dropped
    for later in range(server_round + 1, server_round + 3):
        play(strategy, grid, later)
        assert strategy.history[-1].failed_blocks == []


def test_chains_beyond_the_nodes_max_chain_mb_are_refused(tiny_run_config, tmp_path):
    # Prepare: every node lets one round's chains decode to at most 0.5 MB (a chain of the
    # tiny model's blocks decodes to 0.28 MB a delta)
    config = layout(tiny_run_config, tmp_path, 8)
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid

    _, strategy = setup(config, tmp_path, nodes=8)
    grid = LoopbackGrid(client_app, 8, config, node_config=lambda i: {
        "cache-dir": str(tmp_path / "cache"), "max-chain-mb": 0.5})
    replies: list[Message] = []
    refused = []
    # Execute
    for server_round in range(1, ROUNDS + 1):
        sent = play(strategy, grid, server_round, tamper_replies=replies.extend)
        long = {m.metadata.dst_node_id for m in sent
                if sum(chained_blocks(m).values()) >= 2}
        for reply in replies:
            state = reply.content.config_records[protocol.STATE]
            if reply.metadata.src_node_id in long and int(reply.metadata.group_id) == \
                    server_round:
                refused.append((state[protocol.STATUS], state[protocol.REASON]))
    # Assert: every node sent two or more deltas refused them, naming the limit
    assert refused, "no chain was sent"
    for status, reason in refused:
        assert status == protocol.REFUSED and "max-chain-mb" in str(reason), reason


@pytest.mark.parametrize("key", ["layer.0-1", "layer.0-1#", "#0", "layer.0-1#01",
                                 "layer.0-1#-1", "layer.0-1#9999"])
def test_chain_keys_name_a_block_and_an_index(key):
    # Prepare / Execute / Assert
    with pytest.raises(ValueError, match="download-chain"):
        protocol.read_chain_keys(["layer.0-1#0", key] if key != "layer.0-1#9999" else [key],
                                 max_length=100)


def test_chain_keys_run_from_zero_without_a_gap():
    # Prepare / Execute / Assert
    assert protocol.read_chain_keys(["a#1", "a#0", "b.c#0"]) == {"a": 2, "b.c": 1}
    with pytest.raises(ValueError, match="do not run 0, 1"):
        protocol.read_chain_keys(["a#0", "a#2"])
    with pytest.raises(ValueError, match="do not run 0, 1"):
        protocol.read_chain_keys(["a#1"])


def test_kept_install_deltas_survive_a_checkpoint_in_order(tiny_run_config, tmp_path):
    # Prepare: a run that kept deltas, and a fresh strategy of the same run
    config = layout(tiny_run_config, tmp_path, 8)
    grid, strategy = setup(config, tmp_path, nodes=8)
    for server_round in range(1, 5):
        play(strategy, grid, server_round)
    saved = strategy.checkpoint_tensors()
    _, fresh = setup(dict(config, **{"output-dir": str(tmp_path / "fresh")}),
                     tmp_path / "fresh", nodes=8)
    # Execute
    for name, (_, tensors) in saved.items():
        fresh.install_checkpoint(name, tensors)
    fresh.blocks.load_state(strategy.blocks.state())
    # Assert: the same deltas, in the same order; a node at version 1 gets the same chain
    assert fresh.blocks.install_payloads() == strategy.blocks.install_payloads()
    block = next(iter(strategy.blocks.install_payloads()))
    start = strategy.blocks._installed_via[block][0].start
    assert fresh.blocks.install_chain(block, start) == strategy.blocks.install_chain(block, start)
    # ... and deltas out of order are refused, naming the block
    entry = saved[INSTALL_PAYLOAD + block][1]
    swapped = {"payload.0": entry["payload.1"], "payload.1": entry["payload.0"]}
    with pytest.raises(ValueError, match="do not follow each other"):
        fresh.install_checkpoint(INSTALL_PAYLOAD + block, swapped)


def test_a_payload_that_does_not_make_the_install_is_not_kept(tiny_run_config, tmp_path):
    # Prepare: a run that kept a delta for a block, and that block's tensors changed a little
    grid, strategy = setup(layout(tiny_run_config, tmp_path, 8), tmp_path, nodes=8)
    play(strategy, grid, 1)
    blocks: BlockVersions = strategy.blocks
    block, payloads = next(iter(blocks.install_payloads().items()))
    other = {n: t.clone() + 1e-3 for n, t in blocks.tensors(block).items()}
    # Execute: install tensors the kept delta does not decode to, with that delta
    blocks.install(block, other, 2, payloads[-1])
    # Assert: the delta is not kept and nobody is offered a chain to the new version
    assert block not in blocks.install_payloads()
    assert blocks.install_chain(block, None) is None
    assert blocks.checksums[block] == content_checksum(other)
    assert all(torch.equal(blocks.tensors(block)[n], t) for n, t in other.items())
