"""Strict run config: known keys only, finite numbers in range, rule options checked at start,
docs/configuration.md / RunConfig / ``[tool.flwr.app.config]`` in step, and ``flwr run`` with
rule options."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from fedcybgd.config import ConfigError, NodeConfig, RunConfig, run_config_keys
from fedcybgd.core.fields import Setting, settings
from fedcybgd.rules import builtin, parse_options, registry
from fedcybgd.strategies import aggregator_names

BUILTIN_RULES = ("fo", "zerolock", "lezo", "mezo")  # the update rules that ship
BUILTIN_OPTIONS = (builtin.FoOptions, builtin.ZeroLockOptions, builtin.LezoOptions,
                   builtin.MezoOptions)

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FLWR_CONFIG: dict[str, Any] = PYPROJECT["tool"]["flwr"]["app"]["config"]
FLWR_NO_DEPS = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"


# ------------------------------------------------------ docs/configuration.md and pyproject


def _readme_tables() -> tuple[dict[str, Any], dict[str, Any]]:
    """The configuration reference's tables (docs/configuration.md), read as a user reads
    them: (run-config key -> default, node-config key -> default)."""
    section = (ROOT / "docs" / "configuration.md").read_text()
    run: dict[str, Any] = {}
    node: dict[str, Any] = {}
    table, columns = run, []
    for line in section.splitlines():
        if line.startswith("## "):
            table = node if "Node config" in line else run
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| key |"):
            columns = cells
        elif (match := re.match(r"^`([a-z0-9-]+)`$", cells[0])) and line.startswith("|"):
            key = match.group(1)
            assert key not in table, f"docs/configuration.md lists {key} twice"
            table[key] = _readme_value(cells[columns.index("default")])
    return run, node


def _readme_value(cell: str) -> Any:
    if cell.startswith("`") and cell.endswith("`"):
        inner = cell[1:-1].replace("\\n", "\n")  # a newline is written \n in the table
        return "" if inner == '""' else inner
    if cell in ("true", "false"):
        return cell == "true"
    try:
        return int(cell)
    except ValueError:
        return float(cell)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def test_readme_pyproject_and_run_config_list_the_same_keys_and_defaults():
    # Prepare
    readme, _ = _readme_tables()
    typed = run_config_keys()
    # Assert: the same keys, both directions, in all three
    assert set(readme) - set(typed) == set(), "the docs list keys RunConfig does not know"
    assert set(typed) - set(readme) == set(), "RunConfig keys missing from the docs' tables"
    assert set(FLWR_CONFIG) - set(typed) == set(), "pyproject keys RunConfig does not know"
    assert set(typed) - set(FLWR_CONFIG) == set(), "keys missing from [tool.flwr.app.config]"
    # ... and the same defaults, with the same types
    for key, value in typed.items():
        assert _same(FLWR_CONFIG[key], value), (key, FLWR_CONFIG[key], value)
        assert _same(readme[key], value), (key, readme[key], value)
    assert RunConfig.from_run_config(FLWR_CONFIG) == RunConfig()


def test_configuration_reference_is_generated_from_the_fields_and_current():
    from fedcybgd.cli import reference

    # every key of every table has its meaning declared on its field
    for cls in (RunConfig, NodeConfig, *(s.options for s in registry.rule_specs() if s.options)):
        assert all(s.doc for s in settings(cls).values()), cls
    assert reference.write(ROOT / "docs" / "configuration.md", check=True), \
        "docs/configuration.md is not current: run `fedcybgd config-docs`"


def test_configuration_reference_refuses_a_missing_or_unknown_table():
    from fedcybgd.cli import reference

    text = (ROOT / "docs" / "configuration.md").read_text()
    with pytest.raises(reference.ReferenceError, match="no marker for the table"):
        reference.render(text.replace('<!-- generated: node-config -->', "", 1))
    with pytest.raises(reference.ReferenceError, match="names no table"):
        reference.render(text.replace('generated: node-config', "generated: node-konfig"))


def test_config_docs_command_rewrites_a_stale_table(tmp_path):
    from fedcybgd.cli import main

    stale = tmp_path / "configuration.md"
    text = (ROOT / "docs" / "configuration.md").read_text()
    stale.write_text(text.replace("| `max-lr` | 1.0 |", "| `max-lr` | 2.0 |"))
    assert main(["config-docs", str(stale), "--check"]) == 1
    assert main(["config-docs", str(stale)]) == 0
    assert stale.read_text() == text


def test_readme_node_config_table_matches_node_config():
    _, readme = _readme_tables()
    typed = {key: s.default for key, s in settings(NodeConfig).items()}
    assert readme.keys() == typed.keys()
    assert all(_same(readme[k], v) for k, v in typed.items()), (readme, typed)


def test_every_rule_has_an_option_class_and_the_rules_use_the_shared_one():
    from fedcybgd.client.updates import available_rules
    from fedcybgd.client.updates.zerolock import ZeroLockOptions

    builtin_specs = [s for s in registry.rule_specs()
                     if s.options and s.options.__module__ == "fedcybgd.rules.builtin"]
    assert tuple(s.name for s in builtin_specs) == BUILTIN_RULES
    assert set(BUILTIN_RULES) <= set(available_rules())
    assert ZeroLockOptions is builtin.ZeroLockOptions
    assert {k for s in builtin_specs for k in settings(s.options)} <= set(FLWR_CONFIG)


def test_config_modules_never_import_the_client_package():
    code = ("import sys, fedcybgd.config, fedcybgd.rules.builtin; "
            "print([m for m in sys.modules if m.startswith('fedcybgd.client')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ unknown keys


@pytest.mark.parametrize(("key", "suggestion"), [
    ("num-server-round", "num-server-rounds"),
    ("lezo-densty", "lezo-density"),
    ("zerolock-chunk", "zerolock-chunks"),
    ("weight_decay", "weight-decay"),
    ("max-update-nrom", "max-update-norm"),
])
def test_unknown_key_is_refused_with_the_closest_known_key(key, suggestion):
    with pytest.raises(ConfigError, match=f"unknown key '{key}'; did you mean '{suggestion}'"):
        RunConfig.from_run_config({key: 1})


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'xyzzy'; known keys: .*num-server-rounds"):
        RunConfig.from_run_config({"xyzzy": 1})


def test_node_config_ignores_other_keys_and_warns_about_likely_typos(caplog):
    node = NodeConfig.from_node_config({"partition-id": 1, "num-partitions": 2,
                                        "memory-budget": 500, "other-app-key": 1})
    assert node == NodeConfig(partition_id=1, num_partitions=2)
    assert "did you mean 'memory-budget-mb'" in caplog.text
    assert "other-app-key" not in caplog.text


# ---------------------------------------------------------------------- types and finiteness


@pytest.mark.parametrize(("key", "value", "message"), [
    ("weight-decay", math.nan, "weight-decay must be a finite number"),
    ("num-server-rounds", math.inf, "num-server-rounds must be a finite integer"),
    ("lr", -math.inf, "lr must be a finite number"),
    ("max-payload-mb", 10**400, "max-payload-mb must be a finite number"),
    ("max-update-norm", math.inf, "max-update-norm must be a finite number"),
    ("zo-eps", math.nan, "zo-eps must be a finite number"),
    ("zerolock-cache-mb", math.inf, "zerolock-cache-mb must be a finite number"),
    ("local-steps", 2.5, "local-steps must be a finite integer"),
    ("local-steps", True, "local-steps must be an integer"),
    ("lr", "1e-3", "lr must be a number"),
    ("overwrite", "yes", "overwrite must be true or false"),
    ("model", 3, "model must be a string"),
])
def test_wrong_types_and_non_finite_numbers_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig.from_run_config({key: value})


def _numeric(cls: type) -> list[Setting]:
    return [s for s in settings(cls).values() if s.kind in (int, float)]


def _outside(s: Setting) -> list[Any]:
    """Values just outside each declared bound of ``s``."""
    b = s.bounds
    step = 1 if s.kind is int else 1e-9
    values = []
    if b.ge is not None:
        values.append(b.ge - step)
    if b.gt is not None:
        values.append(b.gt)
    if b.le is not None:
        values.append(b.le + step)
    if b.lt is not None:
        values.append(b.lt)
    return [s.kind(v) for v in values]


RANGED = [(s.key, v) for cls in (RunConfig, *BUILTIN_OPTIONS) for s in _numeric(cls)
          for v in _outside(s)]


@pytest.mark.parametrize(("key", "value"), RANGED)
def test_every_bound_is_enforced_and_named(key, value):
    with pytest.raises(ConfigError, match=re.escape(key)):
        RunConfig.from_run_config({key: value})


def test_every_number_except_a_few_has_a_declared_range():
    # checkpoint-every: any integer is meaningful (< 0 = off); the rest are bounded below
    unbounded = {s.key for cls in (RunConfig, *BUILTIN_OPTIONS)
                 for s in _numeric(cls) if s.bounds.describe() == ""}
    assert unbounded == {"zerolock-checkpoint-every"}


def test_numbers_on_their_bounds_are_accepted():
    run = RunConfig.from_run_config({
        "weight-decay": 0, "eval-every": 0, "version-history": 0, "download-fraction": 1,
        "max-update-norm": 0, "outlier-factor": 0, "trim-fraction": 0, "seed": 2**32 - 1,
        "lezo-density": 1, "zerolock-head-rank": 0, "zerolock-cache-mb": 0, "max-seq-len": 8,
    })
    assert run.download_fraction == 1.0 and isinstance(run.download_fraction, float)
    assert run.options["lezo-density"] == 1.0 and run.options["zerolock-cache-mb"] == 0.0


def test_integral_floats_become_integers_and_integers_floats():
    run = RunConfig.from_run_config({"num-server-rounds": 3.0, "lr": 1, "zerolock-chunks": 2.0})
    assert run.num_server_rounds == 3 and type(run.num_server_rounds) is int
    assert run.lr == 1.0 and type(run.lr) is float
    assert run.options["zerolock-chunks"] == 2 and type(run.options["zerolock-chunks"]) is int


def test_a_run_config_built_in_code_is_checked_as_strictly():
    with pytest.raises(ConfigError, match="weight-decay must be a finite number"):
        RunConfig(weight_decay=math.nan)
    with pytest.raises(ConfigError, match="unknown option 'zo-epsilon'; did you mean 'zo-eps'"):
        RunConfig(options={"zo-epsilon": 1e-3})
    with pytest.raises(ConfigError, match="memory-budget-mb must be a finite number"):
        NodeConfig(memory_budget_mb=math.inf)


# ---------------------------------------------------------------------------- the new keys


def test_robustness_and_output_keys():
    run = RunConfig()
    assert (run.overwrite, run.max_update_norm, run.outlier_factor, run.aggregate,
            run.trim_fraction) == (False, 0.0, 10.0, "auto", 0.2)
    for name in aggregator_names():
        assert RunConfig.from_run_config({"aggregate": name}).aggregate == name
    # Whether a name is registered, the server checks (plug-ins register more); its form, here
    with pytest.raises(ConfigError, match=r"aggregate must name a registered one"):
        RunConfig.from_run_config({"aggregate": "Trimmed Mean"})
    with pytest.raises(ConfigError, match=re.escape("trim-fraction must be in [0, 0.5), got 0.5")):
        RunConfig.from_run_config({"trim-fraction": 0.5})
    with pytest.raises(ConfigError, match="outlier-factor must be >= 0"):
        RunConfig.from_run_config({"outlier-factor": -1})
    with pytest.raises(ConfigError, match="unknown key 'max-header-kb'"):
        RunConfig.from_run_config({"max-header-kb": 1024})


# ------------------------------------------------------------------------------ rule options


@pytest.mark.parametrize("rule", BUILTIN_RULES)
def test_every_rules_options_are_checked_at_start_whatever_the_rule(rule):
    # A node may switch to any rule, so a bad lezo option stops an fo run too.
    with pytest.raises(ConfigError, match=re.escape("lezo-density must be in (0, 1], got 0.0")):
        RunConfig.from_run_config({"update-rule": rule, "lezo-density": 0.0})
    with pytest.raises(ConfigError, match="zerolock-head = 'mlp' is not allowed"):
        RunConfig.from_run_config({"update-rule": rule, "zerolock-head": "mlp"})


def test_serverapp_stops_at_start_on_a_misspelt_rule_option():
    from flwr.app import Context, RecordDict

    from fedcybgd.server.app import main

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={**FLWR_CONFIG, "lezo-densty": 0.5})
    logger = logging.getLogger("fedcybgd")  # main() sets up its logging: keep the test's
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        with pytest.raises(ConfigError, match="did you mean 'lezo-density'"):
            main(grid=None, context=context)  # the grid is never reached
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


def test_typed_rule_options_from_the_run_config():
    run = RunConfig.from_run_config({"zo-eps": 1e-2, "lezo-density": 0.5,
                                     "zerolock-head": "tuned", "zerolock-chunks": 2})
    assert run.rule_options("lezo") == builtin.LezoOptions(eps=1e-2, density=0.5)
    assert run.rule_options("mezo") == builtin.MezoOptions(eps=1e-2)
    assert run.rule_options("zerolock") == builtin.ZeroLockOptions(head="tuned", chunks=2)
    assert run.rule_options("fo") == builtin.FoOptions()
    assert run.to_run_config()["lezo-density"] == 0.5
    assert RunConfig.from_run_config(run.to_run_config()) == run


def test_a_rule_reads_only_its_own_options_but_refuses_unknown_ones():
    # MeZO ignores lezo-density; every rule refuses a key that is no rule option
    assert parse_options("mezo", {"lezo-density": 0.0, "zo-eps": 0.1}) == \
        builtin.MezoOptions(eps=0.1)
    with pytest.raises(ConfigError, match="unknown option 'zo-esp'; did you mean 'zo-eps'"):
        parse_options("fo", {"zo-esp": 0.1})
    with pytest.raises(ConfigError, match="unknown update rule 'lezzo'; did you mean 'lezo'"):
        parse_options("lezzo", {})


# --------------------------------------------------------------- run configs built in code


def test_run_configs_in_the_repository_use_only_known_keys():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import compare_rules
        import run_experiments
        import sweep
    finally:
        sys.path.pop(0)
    from fedcybgd.deploy.local import QUICK_RUN_CONFIG

    # Every file under experiments/configs: a profile has [profile], a sweep has not.
    configs = sorted((ROOT / "experiments" / "configs").glob("*.toml"))
    profiles = [c for c in configs if "profile" in tomllib.loads(c.read_text())]
    payoffs = {"payoff", "payoff-tomi", "payoff-skew", "payoff-tomi-skew"}
    assert payoffs <= {c.stem for c in profiles}
    for path in configs:
        if path in profiles:
            plans = run_experiments.planned_runs(run_experiments.load_profile(path.stem), None)
        else:
            plans = sweep.planned_runs(sweep.load_sweep(path.stem), None)
        for plan in plans:
            RunConfig.from_run_config(plan["config"])
    for variant in compare_rules.VARIANTS.values():
        RunConfig.from_run_config(variant)
    RunConfig.from_run_config(QUICK_RUN_CONFIG)


# ------------------------------------------------------- no runtime dependency installation


def test_pyproject_points_uv_at_cpu_torch():
    uv = PYPROJECT["tool"]["uv"]
    index = {i["name"]: i for i in uv["index"]}
    source = uv["sources"]["torch"]
    names = [s["index"] for s in (source if isinstance(source, list) else [source])]
    assert names == ["pytorch-cpu"]
    assert index["pytorch-cpu"]["url"] == "https://download.pytorch.org/whl/cpu"
    assert index["pytorch-cpu"]["explicit"] is True


def test_make_venv_defaults_disables_flowers_dependency_installation(tmp_path):
    # Prepare: a bare venv, as `python -m venv` makes it in `make install`
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in (FLWR_NO_DEPS, "MAKEFLAGS",
                                                              "MAKELEVEL")}
    # Execute: twice (idempotent)
    for _ in range(2):
        subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "venv-defaults",
                        f"VENV={venv}"], check=True, env=env, capture_output=True)
    # Assert: the activation scripts export it once; any python of the venv sees it;
    # a value set before wins
    for script in ("activate", "activate.fish", "activate.csh"):
        if (venv / "bin" / script).exists():
            assert (venv / "bin" / script).read_text().count(FLWR_NO_DEPS) == 2, script
    python = str(venv / "bin" / "python")
    show = f"import os; print(os.environ.get('{FLWR_NO_DEPS}'))"
    assert subprocess.run([python, "-c", show], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "1"
    assert subprocess.run([python, "-c", show], env={**env, FLWR_NO_DEPS: "0"},
                          capture_output=True, text=True, check=True).stdout.strip() == "0"
    sourced = subprocess.run(["bash", "-c", f". {venv}/bin/activate && echo ${FLWR_NO_DEPS}"],
                             env=env, capture_output=True, text=True, check=True)
    assert sourced.stdout.strip() == "1"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_flwr_run_with_rule_options_and_no_dependency_installation(tmp_path: Path):
    """`flwr run . local` from this venv, the variable NOT exported: lezo with non-default
    lezo-density and zo-eps, seed-log uploads; the run finishes and nothing is installed."""
    from fedcybgd.cli.demo import stop_local_superlink, write_flower_config

    env = {k: v for k, v in os.environ.items() if k != FLWR_NO_DEPS}
    probe = subprocess.run([sys.executable, "-c",
                            f"import os; print(os.environ.get('{FLWR_NO_DEPS}'))"],
                           env=env, capture_output=True, text=True, check=True)
    if probe.stdout.strip() != "1":
        pytest.skip("this venv was not made by `make install` (no fedcybgd-flwr-env.pth); "
                    "run `make venv-defaults`")
    # Flower 1.42's own default for a SuperLink started from this venv: no installation
    default = subprocess.run([sys.executable, "-c", "from flwr.superlink.cli.flower_superlink "
                              "import _runtime_dependency_install_default as d; print(d())"],
                             env=env, capture_output=True, text=True, check=True)
    assert default.stdout.strip() == "False"
    # Prepare: a private Flower home and private ports, so the managed SuperLink is ours alone
    flwr_home = tmp_path / "flwr-home"
    write_flower_config(flwr_home)
    out = tmp_path / "out"
    bin_dir = str(Path(sys.executable).parent)
    env.update(FLWR_HOME=str(flwr_home), HF_HUB_OFFLINE="1",
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
               FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
               PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    overrides = (f"output-dir='{out}' model='tiny-llama' layers-per-block=1 num-server-rounds=2 "
                 "clients-per-round=2 local-steps=2 batch-size=4 max-seq-len=48 "
                 "eval-examples=16 update-rule='lezo' upload-codec='seedlog' lr=1e-3 "
                 "lezo-density=0.5 zo-eps=2e-3")
    command = [str(Path(sys.executable).with_name("flwr")), "run", str(ROOT), "local", "--stream",
               "--run-config", overrides,
               "--federation-config", "num-supernodes=2 client-resources-num-cpus=1"]
    # Execute
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=600, check=False)
    finally:
        stop_local_superlink(flwr_home)
    # Assert: finished, with the options applied, and no runtime environment was built
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert summary["run_config"]["lezo-density"] == 0.5
    assert summary["run_config"]["zo-eps"] == 2e-3
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["update_rule"] == ["lezo"] and r["bytes_up"] > 0 for r in records[1:]), [
        json.dumps(r) for r in records[1:]]
    assert not (flwr_home / "runtime-envs").exists()
    superlink_log = (flwr_home / "local-superlink" / "superlink.log")
    if superlink_log.exists():
        assert "Installing application dependencies" not in superlink_log.read_text()


@pytest.mark.parametrize("extra", [{"lr-schedule": "cosine"}, {"warmup-rounds": 2}])
def test_a_schedule_the_pipeline_would_not_follow_is_refused(extra):
    # the pipeline's stages train at the constant lr: a schedule there would be ignored
    with pytest.raises(ConfigError, match="lr-schedule / warmup-rounds"):
        RunConfig.from_run_config({"strategy": "pipeline", **extra})
    for strategy in ("fedcybgd", "fedavg"):  # both send each round's rate
        assert RunConfig.from_run_config({"strategy": strategy, **extra}).strategy == strategy


SECTIONS = ("cohort", "codecs", "robust", "server_step", "privacy", "evaluation", "pipeline",
            "baseline")


def _other_value(setting: Setting) -> Any:
    """A value of ``setting``'s type other than its default (sections are views: no checks)."""
    if setting.kind is bool:
        return not setting.default
    if setting.kind is int:
        return setting.default + 1
    if setting.kind is float:
        return setting.default * 2 + 0.5
    choices = setting.bounds.choices
    if choices:
        return next(c for c in choices if c != setting.default)
    return setting.default + ",other" if setting.default else "other"


def test_every_field_of_every_section_follows_a_key_of_the_run_config():
    import copy
    import dataclasses

    base = RunConfig()
    moved: dict[str, set[str]] = {s: set() for s in SECTIONS}
    for setting in settings(RunConfig).values():
        changed = copy.copy(base)
        object.__setattr__(changed, setting.name, _other_value(setting))
        for section in SECTIONS:
            before = dataclasses.asdict(getattr(base, section))
            after = dataclasses.asdict(getattr(changed, section))
            moved[section] |= {field for field in before if before[field] != after[field]}
    still = {s: sorted(set(dataclasses.asdict(getattr(base, s))) - moved[s]) for s in SECTIONS}
    assert still == {s: [] for s in SECTIONS}  # a field no key moves reads no key
