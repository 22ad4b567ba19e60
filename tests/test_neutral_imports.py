"""The import rules of the design: the server side never imports the client package, shared
pieces live in neutral modules, server modules import each other without cycles, and one table
of runners serves the ServerApp and the experiments harness."""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedcybgd.choices import STRATEGIES
from fedcybgd.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fedcybgd"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions (absolute names)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(
        ".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _files(*where: str) -> list[Path]:
    found: list[Path] = []
    for name in where:
        path = PACKAGE / name
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def _importing(files: list[Path], prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in files:
        hits = sorted(m for m in _imports(path) if m.startswith(prefixes))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


def test_server_and_strategies_never_import_the_client_package():
    assert _importing(_files("server", "strategies"), ("fedcybgd.client",)) == {}


def test_neutral_modules_import_neither_side():
    neutral = _files("baselines", "rules", "rule_options.py", "memory/estimate.py", "config.py",
                     "config_fields.py")
    sides = ("fedcybgd.client", "fedcybgd.server", "fedcybgd.strategies")
    assert _importing(neutral, sides) == {}


def test_server_modules_import_each_other_without_cycles():
    # Prepare: the import graph among fedcybgd.server's modules
    files = _files("server")
    names = {_module_name(p) for p in files}
    graph = {_module_name(p): {m for m in _imports(p) if m in names} for p in files}
    # Execute: depth-first search for a back edge
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend([*path, node, nxt])
                return True
            if nxt not in state and visit(nxt, [*path, node]):
                return True
        state[node] = 2
        return False

    # Assert
    assert not any(visit(n, []) for n in sorted(graph) if n not in state), cycle


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
    sys.path.insert(0, str(ROOT / "experiments"))
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
