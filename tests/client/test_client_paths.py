"""Client path safety: names the server sends never make the client write or remove anything
outside its cache-dir (``..``, absolute paths, symlinks); a bad instruction gets a clear reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedcybgd import protocol
from fedcybgd.client.app import app as client_app
from fedcybgd.client.paths import UnsafeName, block_name, inside, lineage_name, node_dirs
from fedcybgd.client.store import BlockStore
from fedcybgd.client.updates.zerolock import heads_path
from fedcybgd.compression import payload_to_array
from fedcybgd.config import RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import build_strategy


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def one_round(config: dict[str, Any], cache: Path, lineage: str,
              tamper: Callable[[list[Message]], None] | None = None) -> tuple[Any, Message]:
    """Round 1 with one node and a server of ``lineage``; the strategy and the node's reply."""
    run = RunConfig.from_run_config(config)
    grid = LoopbackGrid(client_app, 1, config, node_config=lambda i: {"cache-dir": str(cache)})
    model = load_model(run.model)
    weights = dict(model.named_parameters())
    strategy = build_strategy(run, BlockMap(model, run.layers_per_block), weights, lineage,
                              content_checksum(weights))
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    if tamper is not None:
        tamper(messages)
    replies = list(grid.send_and_receive(messages))
    strategy.aggregate_train(1, replies)
    return strategy, replies[0]


def assert_refused(reply: Message, fragment: str) -> None:
    assert not reply.has_error(), reply.error.reason  # an answer, not a crash
    state = reply.content.config_records[protocol.STATE]
    assert state[protocol.STATUS] == protocol.REFUSED
    assert fragment in str(state[protocol.REASON])


@pytest.fixture
def config(tiny_run_config: dict[str, Any]) -> dict[str, Any]:
    return dict(tiny_run_config, **{"clients-per-round": 1})


def bad_download(messages: list[Message]) -> None:
    """Round 1 carries no download; add a corrupt one (the client then clears its store)."""
    messages[0].content[protocol.DOWNLOAD] = ArrayRecord(
        {"layer.1": payload_to_array(b"not a payload")})


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_hostile_lineage_touches_nothing_outside_the_cache(config, tmp_path, kind):
    # Prepare: a folder outside the cache where a hostile lineage would lead the node's store
    cache = tmp_path / "cache"
    victim = tmp_path / "x" / "node-1001"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    lineage = {"dotdot": "../../x", "absolute": str(tmp_path / "x"), "symlink": "evil"}[kind]
    if kind == "symlink":
        (cache / "clients").mkdir(parents=True)
        (cache / "clients" / "evil").symlink_to(tmp_path / "x")
    outside_before = {k: v for k, v in files_under(tmp_path).items()
                      if not k.startswith("cache")}
    # Execute: an instruction whose download is bad, so the old client cleared its store
    strategy, reply = one_round(config, cache, lineage, tamper=bad_download)
    # Assert: the outside folder exactly as it was; refused with a reason; the round went on
    outside_after = {k: v for k, v in files_under(tmp_path).items() if not k.startswith("cache")}
    assert outside_after == outside_before
    assert sorted(p.name for p in (tmp_path / "x").rglob("*")) == ["node-1001", "precious.txt"]
    assert_refused(reply, "lineage" if kind != "symlink" else "outside the cache folder")
    assert strategy.history[0].failed_blocks == ["layer.0"]


@pytest.mark.parametrize(
    ("tamper", "fragment"),
    [
        (lambda m: m[0].content[protocol.CONFIG].__setitem__(protocol.BLOCK, "../../evil"),
         "block name '../../evil'"),
        (lambda m: m[0].content[protocol.CONFIG].__setitem__(protocol.BLOCK, "/tmp/evil"),
         "block name '/tmp/evil'"),
        (lambda m: m[0].content[protocol.CONFIG].__setitem__(protocol.BLOCK, "layer.99"),
         "block 'layer.99' is not one of this model's"),
        (lambda m: m[0].content.__setitem__(protocol.DOWNLOAD, ArrayRecord(
            {"../../evil": payload_to_array(b"x")})), "block name '../../evil'"),
    ],
    ids=["train-dotdot", "train-absolute", "train-unknown", "download-dotdot"],
)
def test_bad_block_names_get_a_refusal_not_a_crash(config, tmp_path, tamper, fragment):
    # Execute
    _, reply = one_round(config, tmp_path / "cache", "lineage0", tamper=tamper)
    # Assert: nothing written anywhere but the cache folder
    assert_refused(reply, fragment)
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", "out"}
    assert not list(tmp_path.rglob("*evil*"))


def test_a_cache_dir_reached_through_a_symlink_still_works(config, tmp_path):
    # Prepare: the configured cache-dir is itself a symlink (e.g. ~/.cache -> /data/cache)
    (tmp_path / "real-cache").mkdir()
    (tmp_path / "cache").symlink_to(tmp_path / "real-cache")
    # Execute
    strategy, reply = one_round(config, tmp_path / "cache", "lineage0")
    # Assert
    assert reply.content.config_records[protocol.STATE][protocol.STATUS] == protocol.OK
    assert strategy.history[0].blocks == ["layer.0"] and not strategy.history[0].failed_blocks
    assert (tmp_path / "real-cache" / "clients" / "lineage0" / "node-1001").is_dir()


def test_manifest_naming_a_file_outside_the_store_is_discarded(tmp_path):
    # Prepare: a manifest (tampered with on disk) pointing a block at a file outside the cache
    root = tmp_path / "cache" / "clients" / "l" / "node-1"
    root.mkdir(parents=True)
    precious = tmp_path / "precious.safetensors"
    precious.write_text("keep me")
    (root / "manifest.json").write_text(json.dumps({"base_hash": "h", "blocks": {
        "layer.0": {"version": 1, "checksum": "c", "file": "../../../../precious.safetensors"}}}))
    # Execute
    store = BlockStore(root, "h")
    store.drop("layer.0")
    # Assert: the manifest was not trusted, and nothing outside the store was removed
    assert store.holdings == {}
    assert precious.read_text() == "keep me"


@pytest.mark.parametrize("value", ["", ".", "..", "../x", "a/b", "/abs", "a\\b", "a\x00b",
                                   "x" * 65, "-rf", "a b"])
def test_lineage_names_are_plain(value):
    with pytest.raises(UnsafeName, match="lineage"):
        lineage_name(value)


@pytest.mark.parametrize("value", ["", "..", "layer..0", "../layer.0", "layer.0/x", "/abs",
                                   ".hidden", "x" * 129])
def test_block_names_are_plain(value):
    with pytest.raises(UnsafeName, match="block name"):
        block_name(value)


def test_plain_names_pass_and_paths_stay_inside(tmp_path):
    # Prepare / Execute
    dirs = node_dirs(tmp_path, "0123456789abcdef", 7)
    # Assert
    assert [block_name(b) for b in ("embed", "head", "layer.3", "layer.0-7")]
    assert dirs.store == tmp_path / "clients" / "0123456789abcdef" / "node-7"
    assert dirs.rule_state.parent == dirs.store.parent
    (tmp_path / "out").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "out")
    assert inside(tmp_path, tmp_path / "link" / "f", "a file")
    with pytest.raises(UnsafeName, match="outside the cache folder"):
        inside(tmp_path / "out", tmp_path / "out" / ".." / "f", "a file")


def test_zerolock_state_file_refuses_a_path_for_a_block(tmp_path):
    with pytest.raises(UnsafeName):
        heads_path(tmp_path, "../../evil")
