"""Block schedules and aggregators of the user's own: registered by a module named in
``plugin-modules``, selected by ``block-schedule`` / ``aggregate``, checked by the ServerApp at
start with a suggestion; the built-ins are the same functions as before; the registry's lazy
``"module:attr"`` entries."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, RecordDict

from fedcybgd.config import ConfigError, RunConfig, run_config_keys
from fedcybgd.strategies import (
    aggregator_names,
    build_aggregator,
    check_names,
    register_aggregator,
    register_schedule,
    schedule_names,
    unregister_aggregator,
    unregister_schedule,
)
from fedcybgd.strategies.aggregate import coordinate_median, trimmed_mean, weighted_mean

MODULE = "my_plugins"
# A user's plug-in module: one schedule that wants to hear how far blocks moved, and one
# aggregator. It records what it was asked, so the test can see the strategy used both.
SOURCE = '''\
from fedcybgd.strategies import register_aggregator, register_schedule

OBSERVED = []  # (block, update RMS) as the strategy reported them
MERGES = []  # number of uploads per merge


@register_schedule("top-down-watching")
class TopDownWatching:
    def __init__(self, *, blocks, seed):
        self.blocks, self.next, self.retry = list(reversed(blocks)), 0, []

    def take(self, count):
        chosen = self.retry[:count]
        while len(chosen) < min(count, len(self.blocks)):
            block = self.blocks[self.next % len(self.blocks)]
            self.next += 1
            if block not in chosen:
                chosen.append(block)
        self.retry = self.retry[len(chosen):]
        return chosen

    def requeue(self, block):
        self.retry.append(block)

    def observe(self, block, update_rms):
        OBSERVED.append((block, update_rms))

    def state(self):
        return {"next": self.next, "retry": self.retry}

    def load_state(self, state):
        self.next, self.retry = state["next"], list(state["retry"])


@register_aggregator("first-upload")
def first_upload(**settings):
    def merge(uploads):
        MERGES.append(len(uploads))
        return uploads[0][1]
    return merge
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plug-in module on sys.path (not yet imported); its names removed afterwards."""
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda: sys.modules[MODULE]
    sys.modules.pop(MODULE, None)
    if "top-down-watching" in schedule_names():
        unregister_schedule("top-down-watching")
    if "first-upload" in aggregator_names():
        unregister_aggregator("first-upload")


def _main(grid: Any, run_config: dict[str, Any]) -> None:
    """The ServerApp's main, keeping the test's logging as it was."""
    from fedcybgd.server.app import main

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=run_config)
    logger = logging.getLogger("fedcybgd")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        main(grid=grid, context=context)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


# -------------------------------------------------------------------------------- built-ins


def test_the_builtins_are_registered_under_their_config_names_as_the_same_functions():
    assert schedule_names()[:4] == ("ascending", "descending", "random", "spread")
    assert aggregator_names()[:6] == ("auto", "mean", "median", "trimmed-mean",
                                      "geometric-median", "centered-clip")
    assert build_aggregator("mean") is weighted_mean
    assert build_aggregator("median") is coordinate_median
    assert build_aggregator("auto") is coordinate_median  # the default: a robust merge
    # trimmed-mean is made per run with its trim-fraction: the same numbers as the function
    uploads = [(1.0, {"w": torch.tensor([float(i), -float(i)])}) for i in range(5)]
    assert torch.equal(build_aggregator("trimmed-mean", 0.2)(uploads)["w"],
                       trimmed_mean(0.2)(uploads)["w"])


def test_misspelt_names_stop_the_serverapp_at_start_with_the_closest_suggested():
    # Prepare: every default, as flwr run passes them; the grid is never reached
    config = run_config_keys()
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"block-schedule = 'ascnding': unknown block "
                                          r"schedule 'ascnding'; did you mean 'ascending'\?"):
        _main(None, dict(config, **{"block-schedule": "ascnding"}))
    with pytest.raises(ConfigError, match=r"aggregate = 'trimmed_mean': .*did you mean "
                                          r"'trimmed-mean'\?.*plugin-modules"):
        _main(None, dict(config, **{"aggregate": "trimmed_mean"}))
    check_names("spread", "median")  # known names pass


def test_registries_refuse_malformed_and_taken_names():
    with pytest.raises(ValueError, match="already registered"):
        register_aggregator("mean")(lambda **_: weighted_mean)
    with pytest.raises(ValueError, match="must match"):
        register_schedule("Top Down")(object)
    with pytest.raises(ConfigError, match="block-schedule must name a registered one"):
        RunConfig(block_schedule="../x")
    assert build_aggregator("mean") is weighted_mean  # the refused one changed nothing


# --------------------------------------------------------------------------------- plug-ins


def test_plugin_modules_loads_a_plugin_and_one_key_names_it(plugin):
    assert RunConfig.from_run_config({"plugin-modules": MODULE}).plugin_modules == MODULE
    assert "top-down-watching" in schedule_names() and "first-upload" in aggregator_names()
    with pytest.raises(ConfigError, match="unknown key 'rule-modules'; did you mean "
                                          "'plugin-modules'"):
        RunConfig.from_run_config({"rule-modules": MODULE})
    with pytest.raises(ConfigError, match="plugin-modules: importing 'no_such_plugin' failed"):
        RunConfig.from_run_config({"plugin-modules": "no_such_plugin"})


def test_a_loopback_run_uses_the_plugin_schedule_and_aggregator(plugin, tiny_run_config,
                                                                tmp_path):
    # Prepare: two nodes share one block per round, so every merge has two uploads
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid

    config = dict(tiny_run_config, **{"plugin-modules": MODULE,
                                      "block-schedule": "top-down-watching",
                                      "aggregate": "first-upload", "clients-per-block": 2,
                                      "num-server-rounds": 3, "eval-every": 0})
    cache = tmp_path / "cache"
    grid = LoopbackGrid(client_app, 2, config, node_config=lambda i: {"cache-dir": str(cache)})
    # Execute: the real ServerApp main and ClientApp
    _main(grid, config)
    # Assert: the blocks came top-down from the plug-in schedule, each merge from the plug-in
    # aggregator, and the schedule heard each installed block's step size
    out = Path(config["output-dir"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["blocks"] for r in rows] == [["layer.3"], ["layer.2"], ["layer.1"]]
    module = plugin()
    assert module.MERGES == [2, 2, 2]
    assert [b for b, _ in module.OBSERVED] == ["layer.3", "layer.2", "layer.1"]
    assert all(math.isfinite(rms) and rms > 0 for _, rms in module.OBSERVED)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_config"]["block-schedule"] == "top-down-watching"


def test_a_plugin_name_without_its_module_says_where_modules_go(plugin):
    with pytest.raises(ConfigError, match=r"unknown block schedule 'top-down-watching'.*"
                                          r"name its module in plugin-modules"):
        check_names("top-down-watching", "mean")



def test_a_registry_s_lazy_entries_import_on_first_use_only(tmp_path, monkeypatch):
    from fedcybgd.core.registry import Registry

    # Prepare: a module that registers its own entry when imported, and one that does not
    registry: Registry[Any] = Registry("widget", "widget")
    monkeypatch.setitem(sys.modules, "widget_registry", type(sys)("widget_registry"))
    sys.modules["widget_registry"].REGISTRY = registry  # type: ignore[attr-defined]
    (tmp_path / "lazy_plain.py").write_text("def make():\n    return 'plain'\n")
    (tmp_path / "lazy_self.py").write_text(
        "from widget_registry import REGISTRY\n"
        "@REGISTRY.register('self')\n"
        "def make():\n    return 'self'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.add_lazy("plain", "lazy_plain:make")
    registry.add_lazy("self", "lazy_self:make")
    registry.add_lazy("gone", "no_such_widget_module:make")
    # Execute / Assert: nothing imported until asked; then the named object, or what the
    # module registered itself; an unimportable entry can still be removed
    assert "lazy_plain" not in sys.modules and registry.names() == ("plain", "self", "gone")
    assert registry.get("plain")() == "plain" and registry.get("self")() == "self"
    assert registry.unregister("gone") == "no_such_widget_module:make"
    with pytest.raises(ValueError, match="is not 'module:attr'"):
        registry.add_lazy("bad", "not a target")
    monkeypatch.delitem(sys.modules, "lazy_plain")
    monkeypatch.delitem(sys.modules, "lazy_self")
