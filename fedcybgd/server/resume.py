"""Resuming a FedCyBGD run: its checkpoint read back field by field, the run config checked
against the one that made it, every saved tensor against the model.

A resume continues the run its checkpoint was made by; it never quietly becomes another run.
The run config stored in the checkpoint is compared key by key with the new one: only the keys
of :data:`HARMLESS_CHANGES` may differ, and a refusal names every other key that does
(old -> new). ``state.json`` is checked before anything is installed, each saved tensor against
the model's parameter (name, shape and dtype; nothing is broadcast or cast into place), and the
strategy's own state is restored under the same rule: anything malformed is a
:class:`~fedcybgd.server.checkpoint.CheckpointError` naming the file.

A hard kill costs no round. The rounds after the checkpoint are redone, with the seeds, samples
and plans they had; but their nodes may have moved on: a node sent an instruction after the
checkpoint may hold the blocks it downloaded then, or not. Those nodes (``sent.json``, see
:mod:`fedcybgd.server.checkpoint`) are *unconfirmed* in the strategy's node book until they
reply, and their downloads go against the pretrained block, carrying exactly what the plan
would leave them holding (:mod:`fedcybgd.strategies.downloads`): the redone round drops no
upload, and the run ends with the uninterrupted run's model. The checkpoint also keeps the
run's segments (:class:`~fedcybgd.server.metrics.Segments`), which ``summary.json`` lists.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fedcybgd.config import ConfigError, RunConfig, run_config_keys
from fedcybgd.model.blocks import BlockMap
from fedcybgd.server.checkpoint import (
    SENT,
    STATE,
    Checkpointer,
    CheckpointError,
    EntryLayout,
    Layout,
    TensorSpec,
)
from fedcybgd.server.metrics import SEGMENT_ENDS
from fedcybgd.strategies.checkpoint_entries import INSTALL_PAYLOAD, SERVER_STATE
from fedcybgd.strategies.fedcybgd import FedCyBGD
from fedcybgd.strategies.quantized_install import RESIDUAL
from fedcybgd.tasks.objective import EvalResult

log = logging.getLogger(__name__)

# Run-config keys a resume may change, each with why that is harmless: none of them changes
# the weights the rounds compute or what the recorded figures measure. Every other key
# (update-rule options and plug-ins' keys included) must equal the checkpoint's.
HARMLESS_CHANGES: dict[str, str] = {
    # With lr-schedule = "constant" only: a decaying schedule is spread over the run's rounds,
    # so a new length would change the rate of every round still to come.
    "num-server-rounds": "how long the run goes on; the rounds done do not depend on it",
    "resume": "how this start treats the output folder",
    "overwrite": "how a start treats a non-empty output folder",
    "output-dir": "where the run's folder is (a moved folder is resumed where it is now)",
    "round-timeout": "how long the server waits for a round's replies, not what it does "
                     "with them (a node that does not answer in time is dropped either way)",
    "eval-every": "which rounds are evaluated; an evaluation reads the weights, never "
                  "changes them",
    "eval-batch-size": "how many evaluation rows share a forward pass: the same rows, the same "
                       "scores up to the rounding of float sums",
    "eval-cache": "whether the round-0 evaluation may come from the cache; a resumed run "
                  "takes it from its checkpoint",
}
# Schedules whose rates do not depend on num-server-rounds (see HARMLESS_CHANGES).
_ROUNDS_FREE_SCHEDULES = ("constant",)
# Keys a checkpoint may hold that the run config no longer has, with the value that meant
# "unused": a checkpoint holding that value resumes; any other is refused by name.
RETIRED_KEYS: dict[str, Any] = {"rule-modules": ""}
_ABSENT = "(absent)"
_JSON_KINDS: dict[type, str] = {dict: "an object", str: "a string",
                                 list: "a list"}  # in _Fields' messages
_SEGMENT_KEYS = {"resumed_after", "first_round", "last_round", "wall_s", "end", "started"}
# Moments of the server optimizer's per-block state (fedcybgd.strategies.server_step), fp32.
_MOMENTS = ("m", "v", RESIDUAL)
# What a malformed strategy state makes its loaders raise; each becomes a CheckpointError.
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
              RecursionError)


class ResumeRefused(ConfigError):
    """The checkpoint is sound but was made by another run (other weights, other settings)."""


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint brings back, checked.

    Attributes
    ----------
    round : int
        The last round the checkpoint holds.
    lineage, base_hash : str
        The run's lineage id and the content checksum of the pretrained weights.
    strategy : dict
        The strategy's :meth:`~fedcybgd.strategies.fedcybgd.FedCyBGD.state`.
    initial_eval : EvalResult
        The evaluation before round 1.
    last_eval : EvalResult or None
        The evaluation of the weights after ``round``, if that round was evaluated.
    record : dict or None
        The ``metrics.jsonl`` row of ``round``.
    run_config : dict
        The run config of the run that wrote the checkpoint.
    blocks : dict
        Checkpoint entry -> its tensors (see :meth:`FedCyBGD.checkpoint_tensors`).
    path : Path
        The checkpoint's ``state.json`` (for messages).
    unconfirmed : set of int
        Nodes sent instructions after the checkpoint was saved (their holdings may be past
        what it records); every node it records, for a checkpoint that kept no such record.
    segments : list of dict
        The run's segments up to the checkpoint (see :class:`~fedcybgd.server.metrics.Segments`).
    """

    round: int
    lineage: str
    base_hash: str
    strategy: dict[str, Any]
    initial_eval: EvalResult
    last_eval: EvalResult | None
    record: dict[str, Any] | None
    run_config: dict[str, Any]
    blocks: dict[str, dict[str, torch.Tensor]]
    path: Path
    unconfirmed: frozenset[int] = frozenset()
    segments: tuple[dict[str, Any], ...] = ()

    def install(self, strategy: FedCyBGD) -> None:
        """Put the saved blocks and the strategy's state into ``strategy``; the nodes sent
        instructions after the checkpoint become unconfirmed in its node book.

        Raises
        ------
        CheckpointError
            The strategy's loaders refuse the saved state (the message names ``state.json``).
        """
        try:
            for name, tensors in self.blocks.items():
                strategy.install_checkpoint(name, tensors)
            strategy.load_state(self.strategy)
        except _MALFORMED as err:
            raise CheckpointError(f"checkpoint state {self.path} is malformed: the strategy's "
                                  f"state cannot be restored ({_short(err)})") from err
        strategy.nodes.unconfirmed |= self.unconfirmed
        strategy.done_through = self.round


def checkpoint_state(
    lineage: str,
    base_hash: str,
    strategy: FedCyBGD,
    initial_eval: EvalResult,
    last_eval: tuple[int, EvalResult] | None,
    run: RunConfig,
    record: dict[str, Any],
    segments: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON state :meth:`Checkpointer.save` writes beside the blocks (what
    :func:`read_checkpoint` reads back); ``last_eval`` is the latest evaluation and its round,
    ``segments`` the run's (:meth:`~fedcybgd.server.metrics.Segments.listed`)."""
    return {
        "segments": segments or [],
        "lineage": lineage,
        "base_hash": base_hash,
        "strategy": strategy.state(),
        "initial_eval": asdict(initial_eval),
        "last_eval": None if last_eval is None else {"round": last_eval[0],
                                                     **asdict(last_eval[1])},
        "run_config": run.to_run_config(),
        "record": record,
    }


def read_checkpoint(checkpointer: Checkpointer, run: RunConfig, blocks: BlockMap,
                    weights: Mapping[str, torch.Tensor], base_hash: str) -> Resumed:
    """Read the checkpoint back for ``run`` on the model of ``weights``, cut into ``blocks``.

    In this order: ``state.json`` and each of its fields; the nodes sent instructions since
    (``sent.json``); the pretrained weights (by ``base_hash``); the run config; then each
    block file against the model.

    Raises
    ------
    CheckpointError
        Any file of the checkpoint is missing or malformed, or holds tensors other than the
        model's (the message names the file).
    ResumeRefused
        The checkpoint was made from other pretrained weights, with a run config that differs
        in a key outside :data:`HARMLESS_CHANGES` (all such keys named, old -> new), or after
        more rounds than ``num-server-rounds``.
    """
    path = checkpointer.root / STATE
    state = checkpointer.read_state()
    fields = _Fields(state, path)
    server_round: int = state["round"]
    saved_config = fields.get("run_config", dict, missing=(
        "holds no run config (it was written by an older fedcybgd), so this resume cannot be "
        "checked against the run that made it: start the run again with overwrite = true, or "
        "use another output-dir"))
    if any(not isinstance(v, (bool, int, float, str)) for v in saved_config.values()):
        raise CheckpointError(f"checkpoint state {path} is malformed: run_config holds a value "
                              "that is not a bool, number or string")
    lineage = fields.get("lineage", str)
    saved_hash = fields.get("base_hash", str)
    strategy = fields.get("strategy", dict)
    initial = _eval_result(fields.get("initial_eval", dict), path, "initial_eval")
    last: EvalResult | None = None
    last_eval = fields.get("last_eval", dict, optional=True)
    if last_eval is not None:
        last_round = last_eval.pop("round", None)
        if not isinstance(last_round, int) or isinstance(last_round, bool) or \
                not 0 <= last_round <= server_round:
            raise CheckpointError(f"checkpoint state {path} is malformed: last_eval's round "
                                  f"is {_short(last_round)}, expected 0..{server_round}")
        last = _eval_result(last_eval, path, "last_eval") if last_round == server_round \
            else None
    record = fields.get("record", dict, optional=True)
    if record is not None and (type(record.get("round")) is not int
                               or record["round"] != server_round):
        raise CheckpointError(f"checkpoint state {path} is malformed: its record is of round "
                              f"{_short(record.get('round'))}, its round is {server_round}")
    segments = _segments(fields.get("segments", list, optional=True) or [], server_round, path)
    unconfirmed = checkpointer.read_sent()
    if "unconfirmed" not in strategy:
        # written before the checkpoint kept the nodes it sent to: none is vouched for
        holdings = strategy.get("holdings")
        unconfirmed |= _node_ids(holdings if isinstance(holdings, dict) else {}, path)
    if unconfirmed:
        log.info("resume: %d node(s) were sent instructions after the checkpoint (%s); "
                 "their downloads go from the pretrained blocks until they reply",
                 len(unconfirmed), checkpointer.root / SENT)
    if saved_hash != base_hash:
        raise ResumeRefused(
            f"resume: the checkpoint in {checkpointer.root} was made from other pretrained "
            "weights (base hash differs): resume it with its own model, or start a new run "
            "(overwrite = true or another output-dir)"
        )
    check_run_config(saved_config, run, server_round, checkpointer.root)
    _check_versions(state["blocks"], strategy, blocks, path)
    saved_blocks = checkpointer.load_blocks(
        state, checkpoint_layout(blocks, weights, run.install_chain))
    return Resumed(server_round, lineage, saved_hash, strategy, initial, last, record,
                   saved_config, saved_blocks, path, frozenset(unconfirmed), tuple(segments))


def check_run_config(saved: Mapping[str, Any], run: RunConfig, checkpoint_round: int,
                     root: Path) -> None:
    """Refuse a resume of the checkpoint in ``root`` (after ``checkpoint_round``, made with the
    run config ``saved``) by ``run`` when they differ outside :data:`HARMLESS_CHANGES`.

    A key ``saved`` lacks (one fedcybgd gained after the checkpoint was written) counts as its
    default; a key the run config no longer has is ignored at its unused value
    (:data:`RETIRED_KEYS`).

    Raises
    ------
    ResumeRefused
        Naming every differing key with its old and new value, or ``num-server-rounds`` when
        it is below ``checkpoint_round``.
    """
    new = json.loads(json.dumps(run.to_run_config()))  # the types a JSON round trip leaves
    defaults = run_config_keys()
    changed: list[str] = []
    for key in sorted(set(saved) | set(new)):
        old_value = saved.get(key, defaults.get(key, _ABSENT))
        new_value = new.get(key, _ABSENT)
        if _same(old_value, new_value):
            continue
        if key in RETIRED_KEYS and new_value == _ABSENT and _same(old_value, RETIRED_KEYS[key]):
            continue
        if key in HARMLESS_CHANGES and (key != "num-server-rounds"
                                        or run.lr_schedule in _ROUNDS_FREE_SCHEDULES):
            continue
        changed.append(f"{key}: {_short(old_value)} -> {_short(new_value)}")
    if changed:
        raise ResumeRefused(
            f"resume: the run config differs from the one the checkpoint in {root} was made "
            f"with, in keys that change the run's history: {'; '.join(changed)}. Resume with "
            "the checkpoint's values, or start a new run (overwrite = true or another "
            f"output-dir). A resume may change only {', '.join(HARMLESS_CHANGES)} "
            f"(num-server-rounds with lr-schedule = {' or '.join(_ROUNDS_FREE_SCHEDULES)})"
        )
    if run.num_server_rounds < checkpoint_round:
        raise ResumeRefused(
            f"resume: num-server-rounds = {run.num_server_rounds}, but the checkpoint in {root} "
            f"holds the model after round {checkpoint_round}; set num-server-rounds >= "
            f"{checkpoint_round}"
        )


def checkpoint_layout(blocks: BlockMap, weights: Mapping[str, torch.Tensor],
                      install_chain: int = 1) -> Layout:
    """What each checkpoint entry of this model must hold: a block its parameters (their
    shapes and dtypes), a block's server optimizer state fp32 moments of them, a block's
    kept install deltas flat byte tensors, ``payload.0`` to ``payload.<install_chain - 1>``."""
    payloads = {f"payload.{i}": TensorSpec((None,), torch.uint8) for i in range(install_chain)}

    def params(block: str) -> dict[str, TensorSpec]:
        return {p: TensorSpec(tuple(weights[p].shape), weights[p].dtype)
                for p in blocks.info(block).param_names}

    def layout(entry: str) -> EntryLayout | None:
        if entry in blocks.blocks:
            return EntryLayout(params(entry))
        if entry.startswith(SERVER_STATE) and entry.removeprefix(SERVER_STATE) in blocks.blocks:
            specs = params(entry.removeprefix(SERVER_STATE))
            return EntryLayout({f"{kind}.{p}": TensorSpec(s.shape, torch.float32)
                                for kind in _MOMENTS for p, s in specs.items()},
                               complete=False)
        if entry.startswith(INSTALL_PAYLOAD) and \
                entry.removeprefix(INSTALL_PAYLOAD) in blocks.blocks:
            return EntryLayout(payloads, complete=False)
        return None

    return layout


def _check_versions(entries: Mapping[str, Mapping[str, Any]], strategy: Mapping[str, Any],
                    blocks: BlockMap, path: Path) -> None:
    """The strategy's block versions and checksums agree with the block entries: every block
    above version 0 has its file, at that version and checksum, and no entry is of another
    block or version."""
    where = f"checkpoint state {path} is malformed"
    for name in entries:
        if name.removeprefix(SERVER_STATE).removeprefix(INSTALL_PAYLOAD) not in blocks.blocks:
            raise CheckpointError(f"{where}: it names block {name!r}, which this model has "
                                  "not (another model, or other layers-per-block?)")
    versions, checksums = strategy.get("versions"), strategy.get("checksums")
    if not isinstance(versions, dict) or not isinstance(checksums, dict):
        raise CheckpointError(f"{where}: the strategy's versions and checksums are not objects")
    for block, version in versions.items():
        if block not in blocks.blocks:
            raise CheckpointError(f"{where}: the strategy has a version of block {block!r}, "
                                  "which this model has not (another model, or other "
                                  "layers-per-block?)")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise CheckpointError(f"{where}: block {block} has version {_short(version)}")
        entry = entries.get(block)
        if not version:
            continue
        if entry is None:
            raise CheckpointError(f"{where}: block {block} is at version {version} but no "
                                  "block file is named for it")
        if entry["version"] != version or entry["checksum"] != checksums.get(block):
            raise CheckpointError(
                f"{where}: block {block} is at version {version}, checksum "
                f"{_short(checksums.get(block))}, but its entry names version "
                f"{entry['version']}, checksum {entry['checksum']}")
    for name, entry in entries.items():
        block = name.removeprefix(SERVER_STATE).removeprefix(INSTALL_PAYLOAD)
        if versions.get(block, 0) != entry["version"]:
            raise CheckpointError(f"{where}: entry {name!r} is at version {entry['version']}, "
                                  f"but block {block!r} is at version "
                                  f"{_short(versions.get(block, 0))}")


def _node_ids(keys: Mapping[str, Any], path: Path) -> set[int]:
    if not all(isinstance(n, str) and n.isdecimal() for n in keys):
        raise CheckpointError(f"checkpoint state {path} is malformed: the strategy's holdings "
                              "are not keyed by node ids")
    return {int(n) for n in keys}


def _segments(raw: list[Any], server_round: int, path: Path) -> list[dict[str, Any]]:
    """The run's segments in ``state.json``, each checked (see
    :class:`~fedcybgd.server.metrics.Segments`): rounds within 0..``server_round``, a finite
    wall time, a known end; only the last may lack its end (it ended without recording how)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint state {path} is malformed: segments {why}")

    def count(value: Any, high: int) -> bool:
        return type(value) is int and 0 <= value <= high

    for index, segment in enumerate(raw):
        if not isinstance(segment, dict) or set(segment) != _SEGMENT_KEYS:
            raise bad(f"entry {index} = {_short(segment)}, expected the keys "
                      f"{', '.join(sorted(_SEGMENT_KEYS))}")
        after, first, last = (segment["resumed_after"], segment["first_round"],
                              segment["last_round"])
        wall, end, started = segment["wall_s"], segment["end"], segment["started"]
        if not (after is None or count(after, server_round)) or \
                not count(first, server_round + 1) or not count(last, server_round) or \
                last < first - 1 or \
                not isinstance(wall, (int, float)) or isinstance(wall, bool) or \
                not 0 <= wall < math.inf or \
                not (end in SEGMENT_ENDS or (end is None and index == len(raw) - 1)) or \
                not isinstance(started, str) or len(started) > 64:
            raise bad(f"entry {index} = {_short(segment)}: rounds must lie within "
                      f"0..{server_round}, wall_s be a finite number >= 0, end one of "
                      f"{', '.join(SEGMENT_ENDS)}")
    return [dict(s) for s in raw]


class _Fields:
    """Typed access to the fields of ``state.json``, each failure naming the file."""

    def __init__(self, state: Mapping[str, Any], path: Path) -> None:
        self.state, self.path = state, path

    def get(self, key: str, kind: type, *, optional: bool = False,
            missing: str = "") -> Any:
        value = self.state.get(key)
        if value is None and optional:
            return None
        if key not in self.state:
            raise CheckpointError(f"checkpoint state {self.path} "
                                  f"{missing or f'is malformed: it lacks {key}'}")
        if not isinstance(value, kind):
            raise CheckpointError(f"checkpoint state {self.path} is malformed: {key} = "
                                  f"{_short(value)}, expected {_JSON_KINDS[kind]}")
        return dict(value) if isinstance(value, dict) else value


def _eval_result(raw: Mapping[str, Any], path: Path, key: str) -> EvalResult:
    """An :class:`EvalResult` from its ``asdict`` form (non-finite figures allowed: a
    diverged model's evaluation is one)."""
    metrics = raw.get("metrics", {})
    samples = raw.get("samples", [])
    numbers = [raw.get("loss"), raw.get("accuracy"), *(metrics.values()
                                                        if isinstance(metrics, dict) else [])]
    if set(raw) - {"loss", "accuracy", "examples", "metrics", "samples"} \
            or not isinstance(metrics, dict) \
            or not all(isinstance(k, str) for k in metrics) \
            or not isinstance(samples, list) \
            or not all(isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in x.items()) for x in samples) \
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers) \
            or not isinstance(raw.get("examples"), int) or isinstance(raw["examples"], bool) \
            or raw["examples"] < 0:
        raise CheckpointError(f"checkpoint state {path} is malformed: {key} = {_short(raw)}, "
                              "expected loss, accuracy, examples, metrics and samples")
    return EvalResult(float(raw["loss"]), float(raw["accuracy"]), int(raw["examples"]),
                      {k: float(v) for k, v in metrics.items()},
                      samples=tuple(dict(x) for x in samples))


def _same(old: Any, new: Any) -> bool:
    """Equal as config values: a bool is not a number; numbers compare by value."""
    if isinstance(old, bool) or isinstance(new, bool):
        return type(old) is type(new) and old == new
    if isinstance(old, (int, float)) and isinstance(new, (int, float)):
        return old == new or (math.isnan(old) and math.isnan(new))
    return type(old) is type(new) and old == new


def _short(value: Any) -> str:
    """``repr(value)``, cut short (a damaged file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
