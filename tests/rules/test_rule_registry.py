"""Update rules from outside the package: registered, selected by run config, validated on the
server at start (without the client package), options parsed by the shared parser, memory
estimate used for budgets, and trained in a loopback run of the real ServerApp and ClientApp."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedcybgd import rules
from fedcybgd.client.updates import get_rule, step_log_of
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.core.fields import normalize, setting
from fedcybgd.memory.estimate import (
    ACT_FLOATS_PER_TOKEN_PER_LAYER,
    MB,
    RUNTIME_MB,
    ModelShape,
    estimate_peak_mb,
    fitting_rule,
    memory_needs,
)
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.rules import MemoryNeeds, RuleOptions, TrainOutcome, TrainTask, builtin

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_MODULE = "signsgd_rule"
# The one file a user writes for a rule of their own: the example's. It imports only neutral
# modules, so the server can import it to validate the run without the client package.
PLUGIN_DIR = ROOT / "examples" / "signsgd_rule"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The one-file plug-in on sys.path (not yet imported); removed again afterwards, so no
    other test sees its rule or its option key."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    yield PLUGIN_MODULE
    sys.modules.pop(PLUGIN_MODULE, None)
    if "signsgd" in rules.rule_names():
        rules.unregister_rule("signsgd")


@dataclass(frozen=True)
class GreedyOptions(RuleOptions):
    """A rule defined in this test file: its one option."""

    rank: int = setting(4, key="greedy-rank", ge=1)

    def __post_init__(self) -> None:
        normalize(self)


class Greedy:
    """Needs more memory than any node has; never trains (a budget always moves it away)."""

    name = "greedy"

    def train(self, task: TrainTask) -> TrainOutcome:
        raise AssertionError("greedy fits no budget and must never train")


def greedy_memory(needs: MemoryNeeds) -> float:
    return 1e6 + needs.block_mb


@pytest.fixture
def greedy() -> Iterator[None]:
    """``greedy`` registered with the decorator, from this file; unregistered afterwards."""
    rules.register_rule("greedy", options=GreedyOptions, memory=greedy_memory)(Greedy)
    yield
    rules.unregister_rule("greedy")


def _plugin_class(name: str) -> Any:
    return getattr(sys.modules[PLUGIN_MODULE], name)


def _main(grid: Any, run_config: dict[str, Any]) -> None:
    """The ServerApp's main, keeping the test's logging as it was."""
    from fedcybgd.server.app import main

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=run_config)
    logger = logging.getLogger("fedcybgd")  # main() sets up its logging
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        main(grid=grid, context=context)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


# --------------------------------------------------------------------------- built-in rules


def test_builtin_rules_are_declared_for_both_sides():
    specs = {s.name: s for s in rules.rule_specs()}
    assert list(specs)[:4] == ["fo", "zerolock", "lezo", "mezo"]
    options = {"fo": builtin.FoOptions, "zerolock": builtin.ZeroLockOptions,
               "lezo": builtin.LezoOptions, "mezo": builtin.MezoOptions}
    for name, cls in options.items():
        assert specs[name].options is cls
        assert specs[name].implementation is None  # the server imports no client code
        assert get_rule(name).name == name
    assert [n for n, s in specs.items() if s.step_log] == ["lezo", "mezo"]


@pytest.mark.parametrize("scored", [None, 100, 600])
def test_builtin_estimates_match_their_written_out_form(scored):
    # Each built-in rule's estimate written out (gradients and kept activations count as the
    # larger of the two; the logits are those of the scored positions, one a row unless given,
    # in the copies the loss keeps, zerolock's at most zerolock-slice = 256 rows at a time;
    # the zeroth-order step cache, z and starting values of the perturbed share, 64 MB at
    # most, else the sparse restore's 5% of the block).
    from fedcybgd.rules.builtin import BACKWARD_LOGIT_COPIES, FORWARD_LOGIT_COPIES

    model = load_model("tiny-llama")
    blocks = BlockMap(model, layers_per_block=2)
    shape = ModelShape.of(model, blocks)
    batch, seq = 4, 48
    rows = batch if scored is None else scored
    for block in blocks.names:
        info = blocks.info(block)
        block_bytes = info.numel * 4
        acts = batch * seq * shape.hidden_size * ACT_FLOATS_PER_TOKEN_PER_LAYER * 4 / MB
        logits = rows * shape.vocab_size * 4 / MB
        optimizer = 3 * block_bytes / MB + (block_bytes / MB if shape.bytes_per_param != 4 else 0)
        if info.layers is None:
            lowest = 0 if block == "embed" else shape.num_layers
            own = 0
        else:
            lowest, own = info.layers[0], info.layers[1] - info.layers[0] + 1
        grads = block_bytes / MB  # produced as backward frees activations: the larger counts
        back, forward = BACKWARD_LOGIT_COPIES * logits, FORWARD_LOGIT_COPIES * logits
        extra = {
            "fo": optimizer - grads + max(grads, (shape.num_layers - lowest) * acts) + back,
            "zerolock": optimizer - grads + max(grads, max(own, 1) * acts)
            + back * min(1.0, 256 / rows),
            "lezo": 20.0 + 2 * 0.25 * block_bytes / MB + acts + forward,
            "mezo": 20.0 + 2 * 1.0 * block_bytes / MB + acts + forward,
            "inference": acts + logits,
        }
        for rule, added in extra.items():
            expected = RUNTIME_MB + shape.param_bytes / MB + added
            got = estimate_peak_mb(shape, blocks, rule, block, batch, seq, scored_tokens=scored)
            assert got == pytest.approx(expected, rel=1e-12), rule
        # without the step cache: the sparse restore's saved elements
        for rule in ("lezo", "mezo"):
            expected = (RUNTIME_MB + shape.param_bytes / MB + 20.0 + 0.05 * block_bytes / MB
                        + acts + forward)
            got = estimate_peak_mb(shape, blocks, rule, block, batch, seq, scored_tokens=scored,
                                   options={"zo-step-cache-mb": 0.0})
            assert got == pytest.approx(expected, rel=1e-12), rule


def test_a_budget_between_the_step_cache_and_the_sparse_restore_takes_lezo_without_the_cache():
    # Prepare: a block of the tiny Llama, lezo's estimate with and without the step cache
    from fedcybgd.memory.estimate import fitting_rule_options

    model = load_model("tiny-llama")
    blocks = BlockMap(model, layers_per_block=2)
    shape = ModelShape.of(model, blocks)
    block = blocks.names[1]
    cached = estimate_peak_mb(shape, blocks, "lezo", block, 4, 48)
    lean = estimate_peak_mb(shape, blocks, "lezo", block, 4, 48,
                            options={"zo-step-cache-mb": 0.0})
    # Execute / Assert: between the two, lezo fits without the cache; above, with it; below
    # both, nothing fits
    assert lean < cached
    assert fitting_rule_options(shape, blocks, block, (lean + cached) / 2, 4, 48, "lezo") == \
        ("lezo", {"zo-step-cache-mb": 0.0})
    assert fitting_rule_options(shape, blocks, block, cached + 1, 4, 48, "lezo") == ("lezo", {})
    assert fitting_rule_options(shape, blocks, block, lean - 1, 4, 48, "lezo") is None


# --------------------------------------------------------------------- selecting a plug-in


def test_a_plugin_rule_is_selected_by_run_config_and_its_options_parsed(plugin):
    # Execute: the run config names the module, the rule and the rule's option
    run = RunConfig.from_run_config({"plugin-modules": plugin, "update-rule": "signsgd",
                                     "signsgd-momentum": 0.5})
    # Assert: registered from outside the package, typed options through the shared parser
    options_class = _plugin_class("SignSGDOptions")
    assert rules.rule_spec("signsgd").implementation is _plugin_class("SignSGD")
    assert run.update_rule == "signsgd"
    assert run.rule_options("signsgd") == options_class(momentum=0.5)
    assert rules.parse_options("signsgd", run.options) == options_class(momentum=0.5)
    assert options_class.from_options(run.options) == options_class(momentum=0.5)
    assert run.options["signsgd-momentum"] == 0.5
    assert run.options["zo-eps"] == 1e-3  # the built-ins' options are all still there
    assert RunConfig.from_run_config(run.to_run_config()) == run
    # ... and the client makes it
    assert isinstance(get_rule("signsgd"), _plugin_class("SignSGD"))


def test_a_plugin_rules_options_are_checked_at_start_whatever_the_rule(plugin):
    base = {"plugin-modules": plugin, "update-rule": "fo"}
    with pytest.raises(ConfigError, match=r"signsgd-momentum must be in \[0, 1\), got 1.5"):
        RunConfig.from_run_config({**base, "signsgd-momentum": 1.5})
    with pytest.raises(ConfigError, match="did you mean 'signsgd-momentum'"):
        RunConfig.from_run_config({**base, "signsgd-momentun": 0.5})
    with pytest.raises(ConfigError, match="signsgd-momentum must be a number"):
        RunConfig.from_run_config({**base, "signsgd-momentum": "fast"})


def test_a_plugin_option_is_unknown_without_its_module(plugin):
    with pytest.raises(ConfigError, match="unknown key 'signsgd-momentum'"):
        RunConfig.from_run_config({"signsgd-momentum": 0.5})


def test_the_serverapp_refuses_an_unregistered_rule_at_start_with_a_suggestion(plugin):
    # Prepare: a run config that flwr run would pass (every default), and a grid never reached
    from fedcybgd.config import run_config_keys

    config = dict(run_config_keys(), **{"plugin-modules": plugin})
    # Execute / Assert: a misspelt plug-in rule
    with pytest.raises(ConfigError, match=r"update-rule = 'signsdg'.*did you mean 'signsgd'"):
        _main(None, dict(config, **{"update-rule": "signsdg"}))
    # ... a plug-in rule whose module is not named says where modules go
    rules.unregister_rule("signsgd")
    sys.modules.pop(plugin)
    with pytest.raises(ConfigError, match=r"update-rule = 'signsgd'.*plugin-modules"):
        _main(None, dict(config, **{"update-rule": "signsgd", "plugin-modules": ""}))


def test_plugin_modules_that_cannot_be_loaded_stop_the_run_at_start(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="plugin-modules: importing 'no_such_rules' failed: "
                                          "ModuleNotFoundError"):
        RunConfig.from_run_config({"plugin-modules": "no_such_rules"})
    bad_name = re.escape("plugin-modules: '../rules.py' is not a module name")
    with pytest.raises(ConfigError, match=bad_name):
        RunConfig.from_run_config({"plugin-modules": "../rules.py"})
    (tmp_path / "broken_rules.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'broken_rules' failed: RuntimeError: no GPU"):
        RunConfig.from_run_config({"plugin-modules": "broken_rules"})
    sys.modules.pop("broken_rules", None)


def test_the_server_validates_a_plugin_rule_without_importing_the_client_package(plugin):
    # A fresh process, as the ServerApp's: validate, estimate a budget, list client modules.
    code = textwrap.dedent(f"""
        import sys, json
        import fedcybgd.server.app
        from fedcybgd.model.blocks import BlockMap
        from fedcybgd.config import RunConfig
        from fedcybgd.memory.estimate import ModelShape, fitting_rule
        from fedcybgd.model.loading import load_model
        run = RunConfig.from_run_config({{"plugin-modules": {plugin!r}, "update-rule": "signsgd",
                                         "signsgd-momentum": 0.5}})
        model = load_model("tiny-llama")
        blocks = BlockMap(model, 1)
        rule = fitting_rule(ModelShape.of(model, blocks), blocks, "layer.0", 50000.0, 4, 48,
                            run.update_rule)
        print(json.dumps([rule, sorted(m for m in sys.modules
                                       if m.startswith("fedcybgd.client"))]))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT, env=env)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["signsgd", []]


def test_a_rule_declared_without_code_must_be_built_in_and_text_code_is_imported_by_the_client():
    from fedcybgd.choices import BUILTIN_RULES
    from fedcybgd.client.updates.base import BUILTIN_IMPLEMENTATIONS

    # the client binds exactly the built-ins
    assert set(BUILTIN_IMPLEMENTATIONS) == set(BUILTIN_RULES) == {
        s.name for s in rules.rule_specs() if s.implementation is None}
    # a plug-in rule with no code is refused at declaration (not on the clients, later)
    with pytest.raises(ValueError, match="'codeless': implementation is required"):
        rules.declare_rule("codeless", options=None, memory=greedy_memory,
                           implementation=None)
    with pytest.raises(ValueError, match="is not 'module:attr'"):
        rules.declare_rule("codeless", options=None, memory=greedy_memory,
                           implementation="not a target")
    # "module:attr": the server keeps the text; a client imports it when it makes the rule
    rules.declare_rule("greedy", options=GreedyOptions, memory=greedy_memory,
                       implementation=f"{__name__}:Greedy")
    try:
        assert rules.rule_spec("greedy").implementation == f"{__name__}:Greedy"
        assert isinstance(get_rule("greedy"), Greedy)
    finally:
        rules.unregister_rule("greedy")
    assert "codeless" not in rules.rule_names()


def test_registration_refuses_conflicts():
    with pytest.raises(ValueError, match="'fo' is already registered"):
        rules.register_rule("fo", memory=greedy_memory)(Greedy)
    with pytest.raises(ValueError, match="must match"):
        rules.register_rule("Greedy Rule", memory=greedy_memory)(Greedy)
    with pytest.raises(ValueError, match="must match"):
        rules.register_rule("inference", memory=greedy_memory)(Greedy)
    with pytest.raises(ValueError, match="memory must be a function"):
        rules.register_rule("greedy", memory=1.0)(Greedy)  # type: ignore[arg-type]

    @dataclass(frozen=True)
    class OtherEps(RuleOptions):
        eps: float = setting(1e-2, key="zo-eps", gt=0)  # lezo's key, another default

    with pytest.raises(ValueError, match="option 'zo-eps' is declared differently"):
        rules.register_rule("othereps", options=OtherEps, memory=greedy_memory)(Greedy)
    assert "othereps" not in rules.rule_names() and "greedy" not in rules.rule_names()


def test_an_option_named_like_a_run_config_key_is_refused():
    @dataclass(frozen=True)
    class ShadowsLr(RuleOptions):
        lr: float = setting(1.0, key="lr", gt=0)

    rules.register_rule("shadow", options=ShadowsLr, memory=greedy_memory)(Greedy)
    try:
        with pytest.raises(ConfigError, match=r"\['shadow'\] declare option\(s\) \['lr'\]"):
            RunConfig()
    finally:
        rules.unregister_rule("shadow")


def test_a_declared_step_log_must_be_returned():
    outcome = TrainOutcome(loss=0.0, steps=1, examples=4)
    assert step_log_of("fo", outcome) is None  # fo keeps none: the client uploads weights
    with pytest.raises(RuntimeError, match="'lezo' declares a step log"):
        step_log_of("lezo", outcome)


# ------------------------------------------------------------------------------- memory


def test_a_plugin_rules_memory_estimate_is_used_for_budgets(plugin, greedy):
    # Prepare
    RunConfig.from_run_config({"plugin-modules": plugin})
    model = load_model("tiny-llama")
    blocks = BlockMap(model, layers_per_block=1)
    shape = ModelShape.of(model, blocks)
    needs = memory_needs(shape, blocks, "layer.1", 4, 48)
    # Assert: the estimate is the rule's own on top of runtime + weights
    expected = RUNTIME_MB + needs.weights_mb + _plugin_class("signsgd_memory")(needs)
    assert estimate_peak_mb(shape, blocks, "signsgd", "layer.1", 4, 48) == expected
    # ... a budget it fits keeps it; one it does not moves the node to the first built-in that fits
    assert fitting_rule(shape, blocks, "layer.1", expected, 4, 48, "signsgd") == "signsgd"
    assert fitting_rule(shape, blocks, "layer.1", 50_000.0, 4, 48, "greedy") == "fo"
    # ... and when no built-in fits either, nothing does
    least = min(estimate_peak_mb(shape, blocks, r, "layer.1", 4, 48)
                for r in ("fo", "zerolock", "lezo"))
    assert fitting_rule(shape, blocks, "layer.1", least - 1, 4, 48, "greedy") is None


def test_a_broken_memory_estimate_is_named(greedy):
    rules.register_rule("nanmem", memory=lambda needs: math.nan)(Greedy)
    try:
        assert rules.parse_options("nanmem", {"zo-eps": 0.1}) == rules.NoOptions()  # none
        model = load_model("tiny-llama")
        blocks = BlockMap(model, layers_per_block=1)
        with pytest.raises(ValueError, match="'nanmem': memory estimate nan"):
            estimate_peak_mb(ModelShape.of(model, blocks), blocks, "nanmem", "layer.0", 4, 48)
    finally:
        rules.unregister_rule("nanmem")


# ------------------------------------------------------------------------------ loopback


def _grid(run_config: dict[str, Any], tmp_path: Path, nodes: int,
          node_config: dict[str, Any] | None = None) -> Any:
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid

    cache = tmp_path / "client-cache"
    return LoopbackGrid(client_app, nodes, run_config,
                        node_config=lambda i: {"cache-dir": str(cache), **(node_config or {})})


def _records(run_config: dict[str, Any]) -> list[dict[str, Any]]:
    out = Path(run_config["output-dir"])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_loopback_run_trains_with_a_plugin_rule(plugin, tiny_run_config, tmp_path):
    # Prepare: the run config names the plug-in; exact uploads, so a step shows in the model
    config = dict(tiny_run_config, **{"plugin-modules": plugin, "update-rule": "signsgd",
                                      "signsgd-momentum": 0.5, "upload-codec": "fp32",
                                      "num-server-rounds": 2})
    RunConfig.from_run_config(config)  # loads the module, so its train can be counted
    rule_class = _plugin_class("SignSGD")
    calls: list[str] = []
    original = rule_class.train

    def counted(self: Any, task: TrainTask) -> TrainOutcome:
        calls.append(task.block)
        assert task.options["signsgd-momentum"] == 0.5
        return original(self, task)

    rule_class.train = counted
    # Execute: the real ServerApp main (config validated at start) and ClientApp
    _main(_grid(config, tmp_path, nodes=2), config)
    # Assert: every assignment trained by the plug-in, and the blocks moved
    records = [r for r in _records(config) if r["round"] > 0]
    assert [r["update_rule"] for r in records] == [["signsgd"], ["signsgd"]]
    assert sorted(calls) == sorted(b for r in records for b in r["blocks"])
    assert len(calls) == 4
    assert all(math.isfinite(r["train_loss"]) and r["bytes_up"] > 0 for r in records)
    summary = json.loads((Path(config["output-dir"]) / "summary.json").read_text())
    assert summary["run_config"]["plugin-modules"] == plugin  # the run records its plug-ins


def test_a_node_budget_moves_a_plugin_rule_to_one_that_fits(greedy, tiny_run_config, tmp_path):
    # Prepare: every node declares a budget greedy's estimate exceeds and fo's fits
    config = dict(tiny_run_config, **{"update-rule": "greedy", "num-server-rounds": 2})
    grid = _grid(config, tmp_path, nodes=2, node_config={"memory-budget-mb": 50_000.0})
    # Execute
    _main(grid, config)
    # Assert: no node ever trained greedy (its train raises), fo did the work
    records = [r for r in _records(config) if r["round"] > 0]
    assert [r["update_rule"] for r in records] == [["fo"], ["fo"]]
    assert all(len(r["blocks"]) == 2 and not r["failed_blocks"] for r in records)


def test_a_budget_falls_back_only_to_the_rules_a_node_can_run():
    # Prepare: a budget below fo's estimate that zerolock's and lezo's fit (tiny Llama, one
    # block of two layers, batches of 32 x 512 tokens), and a node that runs fo, lezo and mezo
    # only (an ExecuTorch node)
    from fedcybgd.memory.estimate import fitting_rule_options

    model = load_model("tiny-llama")
    blocks = BlockMap(model, layers_per_block=2)
    shape = ModelShape.of(model, blocks)
    block = blocks.names[1]
    fo, zerolock = (estimate_peak_mb(shape, blocks, rule, block, 32, 512)
                    for rule in ("fo", "zerolock"))
    lezo = estimate_peak_mb(shape, blocks, "lezo", block, 32, 512,
                            options={"zo-step-cache-mb": 0.0})  # its leanest
    assert max(zerolock, lezo) < fo
    budget = (max(zerolock, lezo) + fo) / 2
    # Execute
    any_rule = fitting_rule_options(shape, blocks, block, budget, 32, 512, "fo")
    programs = fitting_rule_options(shape, blocks, block, budget, 32, 512, "fo",
                                    allowed=("fo", "lezo", "mezo"))
    # Assert: zerolock for a node that runs every rule; lezo for the other
    assert any_rule is not None and any_rule[0] == "zerolock"
    assert programs is not None and programs[0] == "lezo"
