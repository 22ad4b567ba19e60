"""One source of defaults: a FedCyBGD built in code runs what the run config describes.

A user's own ServerApp that builds ``FedCyBGD(block_map=..., weights=...)`` gets the app's
algorithm, setting for setting, as ``FedCyBGD.from_config`` builds it from the run config's
defaults and as ``flwr run`` runs it; any run config builds the same strategy both ways.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedcybgd.config import RunConfig
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import build_strategy
from fedcybgd.strategies import FedCyBGD


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model("tiny-llama")


def test_a_strategy_built_with_no_settings_is_the_run_config_s_default(model):
    # Prepare
    blocks = BlockMap(model, RunConfig().layers_per_block)
    weights = dict(model.named_parameters())
    # Execute
    plain = FedCyBGD(block_map=blocks, weights=weights).settings()
    configured = FedCyBGD.from_config(RunConfig(), blocks, weights).settings()
    # Assert: every setting equal; the client lr is the nodes' own run-config lr (None, sent
    # as nothing) in one and the constant schedule of that same lr in the other
    lr = RunConfig().lr
    assert plain.pop("client-lr") is None and configured.pop("client-lr") == [lr, lr, lr]
    assert plain == configured
    # the settings that once differed between the constructor and the run config
    assert plain["block-schedule"] == RunConfig().block_schedule == "descending"
    assert plain["upload-codec"] == plain["download-codec"] == "delta+int2+zstd"
    assert plain["install-codec"] != "none" and plain["self-sync"] is False  # 4 nodes a block
    assert plain["clients-per-block"] == RunConfig().per_block
    assert plain["local-steps"] == RunConfig().local_steps


@pytest.mark.parametrize("overrides", [
    {},
    {"clients-per-block": 1, "block-schedule": "ascending", "upload-codec": "fp32",
     "download-codec": "delta+fp16+zstd", "install-codec": "none", "aggregate": "median",
     "lr-schedule": "cosine", "num-server-rounds": 10, "server-optimizer": "adam",
     "train-head": True, "max-update-ratio": 0.1, "local-steps": 3, "batch-size": 2},
    {"update-rule": "lezo", "upload-codec": "seedlog", "download-codec": "seedlog",
     "traffic-budget-mb": 5.0, "download-fraction": 0.5, "max-staleness": 2},
])
def test_the_app_s_strategy_is_from_config_s(model, overrides):
    # Prepare
    run = RunConfig.from_run_config({"model": "tiny-llama", **overrides})
    blocks = BlockMap(model, run.layers_per_block)
    weights = dict(model.named_parameters())
    # Execute: the ServerApp's builder and the public constructor from the same run config
    app = build_strategy(run, blocks, weights, "lineage", "hash").settings()
    own = FedCyBGD.from_config(run, blocks, weights).settings()
    # Assert
    assert app == own
    assert app["upload-codec"] == run.upload_codec
    assert app["clients-per-block"] == run.per_block


def test_the_node_wait_is_a_run_config_key_every_runner_and_the_strategy_take(model, tmp_path):
    from fedcybgd.config import ConfigError
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import RUNNERS

    # the strategy waits node-wait for a node's first answer
    run = RunConfig.from_run_config({"model": "tiny-llama", "node-wait": 7.0})
    blocks = BlockMap(model, run.layers_per_block)
    weights = dict(model.named_parameters())
    assert RunConfig().node_wait == 300.0
    assert FedCyBGD.from_config(run, blocks, weights).node_wait_s == 7.0
    # every runner waits node-wait for its nodes to connect, then names the key
    for strategy, key in (("fedcybgd", "clients-per-round"), ("fedavg", "clients-per-round"),
                          ("pipeline", "pipeline-stages")):
        config = {"model": "tiny-llama", "strategy": strategy, "node-wait": 0.5,
                  "clients-per-round": 3, "pipeline-stages": 3,
                  "output-dir": str(tmp_path / strategy)}
        grid = LoopbackGrid(None, 2, config)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=rf"{key} = 3, but only 2 nodes are connected "
                                              r"after 0.5 s \(node-wait\)"):
            RUNNERS[strategy](grid, RunConfig.from_run_config(config))
        assert not (tmp_path / strategy).exists()  # a failed start leaves no folder


def test_every_section_key_set_in_the_run_config_reaches_the_strategy(model):
    # Prepare: every key the strategy's parts take, set away from its default
    changed = {"clients-per-round": 6, "clients-per-block": 2, "block-schedule": "ascending",
               "update-rule": "lezo", "seed": 7, "local-steps": 3,
               "upload-codec": "delta+int8+zstd", "download-codec": "delta+fp16+zstd",
               "seedlog-fallback": "delta+fp16+zstd", "seedlog-max-replay": 8.0,
               "download-fraction": 0.5, "max-staleness": 2, "traffic-budget-mb": 5.0,
               "install-codec": "none", "version-history": 3, "install-chain": 4,
               "self-sync": False, "aggregate": "trimmed-mean", "trim-fraction": 0.1,
               "max-update-norm": 2.0, "outlier-factor": 4.0, "max-update-ratio": 0.2}
    run = RunConfig.from_run_config({"model": "tiny-llama", "batch-size": 2, **changed})
    assert all(RunConfig().to_run_config()[key] != value for key, value in changed.items())
    # Execute
    settings = FedCyBGD.from_config(run, BlockMap(model, run.layers_per_block),
                                    dict(model.named_parameters())).settings()
    # Assert: each key as the part holding it has it, by its run-config name
    assert {key: settings[key] for key in changed} == changed
    assert settings["max-examples"] == 3 * 2  # local-steps x batch-size bound a reply
