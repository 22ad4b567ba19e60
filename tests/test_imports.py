"""The package's structure: its import graph has no cycles, the server side never imports the
client nor the client the server side, every shared module reaches neither side, and one table
of runners serves the ServerApp and the experiments harness.

Read statically from the source (``ast``), so a lazy import inside a function counts as much as
one at the top: it is still a dependency. Imports under ``if TYPE_CHECKING:`` do not run and
are left out. A package's own ``__init__`` running when one of its submodules is imported is
Python's doing, not an edge; an explicit ``from fedcybgd.pkg import name`` is an edge to the
submodule ``name`` when there is one, else to ``fedcybgd.pkg`` itself. A string that is a whole
module path (``"fedcybgd.pkg.mod"``, ``"fedcybgd.pkg.mod:attr"``), such as a registry's lazy
entry, is an import by string and an edge like any other.
"""

from __future__ import annotations

import ast
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedcybgd.choices import STRATEGIES
from fedcybgd.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent / "fedcybgd"
SERVER_SIDE = ("fedcybgd.server", "fedcybgd.strategies")
CLIENT = "fedcybgd.client"
# On the operator's machine only (kept out of the app bundle): they may use both sides.
OPERATOR_SIDE = ("fedcybgd.harness", "fedcybgd.deploy", "fedcybgd.cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_in(child))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def _known(name: str) -> str | None:
    """The fedcybgd module ``name`` or its closest listed parent."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


STRING_IMPORT = re.compile(r"(fedcybgd(?:\.\w+)+)(?::[\w.]+)?")


def _string_imports(tree: ast.AST) -> Iterator[str]:
    """The module paths named by whole strings (``"fedcybgd.x.y:attr"``) in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = STRING_IMPORT.fullmatch(node.value)
            if match:
                yield match.group(1)


def dependencies(module: str) -> set[str]:
    """The fedcybgd modules ``module`` imports (by statement or by string)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found = {target for target in _string_imports(tree)
             if target in MODULES and target != module}
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        for target in targets:
            if target == "fedcybgd" or target.startswith("fedcybgd."):
                known = _known(target)
                if known is not None and known != module:
                    found.add(known)
    return found


GRAPH = {module: dependencies(module) for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in GRAPH.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _on(module: str, packages: tuple[str, ...] | str) -> bool:
    packages = (packages,) if isinstance(packages, str) else packages
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_graph_sees_known_edges():
    # Guards the reader itself: if these are missed, the checks below prove nothing.
    assert "fedcybgd.strategies.fedcybgd" in GRAPH["fedcybgd.server.app"]
    assert "fedcybgd.protocol" in GRAPH["fedcybgd.strategies.reader"]
    assert any(_on(m, CLIENT) for m in GRAPH) and len(GRAPH) > 40


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_server_side_imports_nothing_of_the_client():
    direct = {m: sorted(d for d in deps if _on(d, CLIENT))
              for m, deps in GRAPH.items() if _on(m, SERVER_SIDE)}
    assert {m: d for m, d in direct.items() if d} == {}


def test_server_side_reaches_nothing_of_the_client_through_other_modules():
    through = {m: sorted(d for d in reachable(m) if _on(d, CLIENT))
               for m in GRAPH if _on(m, SERVER_SIDE)}
    assert {m: d for m, d in through.items() if d} == {}


def test_client_imports_nothing_of_the_server_side():
    direct = {m: sorted(d for d in deps if _on(d, SERVER_SIDE))
              for m, deps in GRAPH.items() if _on(m, CLIENT)}
    assert {m: d for m, d in direct.items() if d} == {}


def test_shared_modules_reach_neither_side():
    # Prepare: every module that is neither side nor operator-side (config, rules, model, ...)
    shared = [m for m in GRAPH if not _on(m, (*SERVER_SIDE, CLIENT, *OPERATOR_SIDE))]
    assert {"fedcybgd.config", "fedcybgd.rules.registry", "fedcybgd.memory.estimate",
            "fedcybgd.baselines.model", "fedcybgd.core.registry",
            "fedcybgd.protocol.zeroth_order"} <= set(shared)
    # Assert: none imports either side, directly or through other modules
    through = {m: sorted(d for d in reachable(m) if _on(d, (*SERVER_SIDE, CLIENT)))
               for m in shared}
    assert {m: d for m, d in through.items() if d} == {}


# ------------------------------------------------------------ folders and their floors
def folder(module: str) -> str:
    """The sub-package (or root module) of ``fedcybgd`` that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fedcybgd"


FOLDERS = {folder(m): set() for m in GRAPH}
for _module, _deps in GRAPH.items():
    FOLDERS[folder(_module)] |= {folder(d) for d in _deps} - {folder(_module)}

# The floors of the package, lowest first: a folder imports only from floors below its own.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("core", "choices"),  # leaf utilities; the lists of allowed values
    ("data", "compression", "rules", "model"),  # rows, codecs, the rules' contract, models
    ("protocol", "memory"),  # what both sides agree on; memory estimates
    ("config",),  # the typed run and node config: the edge every setting enters by
    ("tasks", "strategies", "baselines"),  # tasks; the server's strategy; FedAvg baselines
    ("client", "server"),  # the two apps
    ("harness", "deploy"),  # test and experiment rigs, deployments
    ("cli",),  # the operator's command line, over all of it
)


def test_folders_import_no_circle():
    assert cycles(FOLDERS) == []


def test_every_folder_imports_only_from_floors_below():
    floor = {name: level for level, names in enumerate(FLOORS) for name in names}
    assert set(FOLDERS) - {"fedcybgd"} == set(floor)  # every folder has its floor
    upward = {f"{a} -> {b}" for a, deps in FOLDERS.items() for b in deps
              if floor.get(b, -1) >= floor.get(a, -1)}
    assert upward == set()


def test_the_package_root_holds_only_sub_packages_and_two_modules():
    # config.py: the one typed object config enters by; choices.py: the allowed values (no
    # imports, read by every floor)
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "choices.py", "config.py"]


# Folders of tests/ that mirror a top folder of the project rather than one of the package's.
PROJECT_FOLDERS = {"docs", "examples", "experiments"}


def test_the_tests_mirror_the_package():
    """A module's tests are found from its path: tests/<folder>/ holds the tests of
    fedcybgd/<folder>/ (or of the project's docs/, examples/, experiments/), and the files at
    tests/'s top test the package as a whole or a module at its root."""
    tests = Path(__file__).resolve().parent
    strays = []
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir()):
        rel = folder.relative_to(tests)
        if "__pycache__" in rel.parts or rel.parts[-1] == "golden":
            continue
        mirrored = ROOT / rel if rel.parts[0] not in PROJECT_FOLDERS else ROOT.parent / rel
        if not mirrored.is_dir():
            strays.append(str(rel))
    assert strays == []
    top = sorted(p.stem.removeprefix("test_") for p in tests.glob("test_*.py"))
    at_root = {p.stem for p in ROOT.glob("*.py")} | {"imports", "fab"}
    assert set(top) <= at_root, f"tests at tests/'s top that belong in a folder: {top}"

@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_finder(graph, expected):
    assert cycles(graph) == expected


# ------------------------------------------------------------ one table of runners
def test_one_runner_per_strategy():
    from fedcybgd.server.app import RUNNERS, run_server
    from fedcybgd.server.baselines import run_fedavg

    assert set(RUNNERS) == set(STRATEGIES)
    assert RUNNERS["fedcybgd"] is run_server and RUNNERS["fedavg"] is run_fedavg


def test_the_serverapp_runs_the_strategys_runner(monkeypatch, tmp_path):
    from fedcybgd.server import app

    seen: list[tuple[Any, RunConfig]] = []
    monkeypatch.setitem(app.RUNNERS, "fedavg", lambda grid, run: seen.append((grid, run)) or {})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"strategy": "fedavg", "output-dir": str(tmp_path)})
    logger = logging.getLogger("fedcybgd")  # main() sets up its logging: keep the test's
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        app.main(grid="the grid", context=context)  # type: ignore[arg-type]
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    assert [(g, r.strategy) for g, r in seen] == [("the grid", "fedavg")]


class _FakeGrid:
    """Stands in for the ProcessGrid run_one opens (no child process)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.exchanges: list[Any] = []

    def __enter__(self) -> _FakeGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_the_experiments_harness_picks_the_runner_from_the_same_table(monkeypatch, tmp_path):
    # Prepare: a runner that writes what a run writes, and no child process
    sys.path.insert(0, str(ROOT.parent / "experiments"))
    try:
        import run_experiments
    finally:
        sys.path.pop(0)
    from fedcybgd.harness import procgrid
    from fedcybgd.server import app

    class Exchange:
        bytes_down, bytes_up, peak_rss_mb, max_rss_mb = 10, 5, 100.0, 120.0
        message_type = "train"

    def fake_runner(grid: _FakeGrid, run: RunConfig) -> dict[str, Any]:
        grid.exchanges.append(Exchange())
        out = Path(run.output_dir)
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1, "round_s": 2.0}\n')
        return {"strategy": run.strategy}

    monkeypatch.setattr(procgrid, "ProcessGrid", _FakeGrid)
    monkeypatch.setitem(app.RUNNERS, "fedavg", fake_runner)
    plan = {"id": "fedavg-x", "method": "fedavg", "partition": "iid", "seed": 0,
            "config": {"strategy": "fedavg", "model": "tiny-llama"}}
    # Execute
    result = run_experiments.run_one(plan, tmp_path, nodes=2, threads=1)
    # Assert
    assert result["summary"] == {"strategy": "fedavg"}
    assert result["round_s"] == pytest.approx(2.0) and result["wire_bytes_up"] == 5


def test_the_node_side_imports_without_the_server_extras():
    # A node on its own data installs `pip install .` alone: no Ray (flwr[simulation]),
    # matplotlib, dp-accounting, flwr-datasets or datasets. Block them and import what a node
    # runs; the two that a node may need say which extra to install.
    # (Probes such as transformers' find_spec still see them; importing one fails.)
    code = """
import importlib.machinery, sys
BLOCKED = ("ray", "matplotlib", "dp_accounting", "flwr_datasets", "datasets")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked (a node install has no server extras)")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Block())
import fedcybgd.client.app, fedcybgd.cli, fedcybgd.cli.node, fedcybgd.model.export
from fedcybgd.protocol.dp import epsilon_of
import pandas as pd
from fedcybgd.data.partition import partition_positions
try:
    epsilon_of([(0.1, 1.0, 3)], 1e-5)
except ImportError as err:
    print("accounting:", err)
try:
    partition_positions(pd.DataFrame({"label": [0, 1] * 20}), "iid", 2, 0.5, 0, "label")
except ImportError as err:
    print("partitions:", err)
print([m for m in sys.modules if m.split(".")[0] in BLOCKED])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert "pip install 'fedcybgd[privacy]'" in lines[0]
    assert "pip install 'fedcybgd[data]'" in lines[1]
    assert lines[-1] == "[]"


# ------------------------------------------------------------ sizes a reader can hold
MAX_FUNCTION_LINES = 80
MAX_STRATEGY_LINES = 350


def test_no_function_is_longer_than_a_screenful_or_two():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []


def test_the_strategy_module_reads_in_one_sitting():
    lines = len(MODULES["fedcybgd.strategies.fedcybgd"].read_text().splitlines())
    assert lines <= MAX_STRATEGY_LINES
