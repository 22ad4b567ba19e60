"""Typed run configuration, built once at the edge from Flower's flat ``run_config`` dict.

Every key of ``[tool.flwr.app.config]`` maps to one field (dashes become underscores). A bad
value stops the run at start with a :class:`ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from fedcybgd.compression import CodecError, parse_spec

UPDATE_RULES = ("fo", "zerolock", "lezo", "mezo")
SCHEDULES = ("ascending", "descending", "random")
PARTITIONERS = ("iid", "dirichlet", "movie")
DATASETS = ("rotten-tomatoes",)
STRATEGIES = ("fedcybgd", "fedavg")  # fedavg: Flower's own FedAvg, the baselines
FEDAVG_PARAMS = ("full", "lora")


class ConfigError(ValueError):
    """A run-config or node-config value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated. Defaults equal ``[tool.flwr.app.config]`` (a test
    checks), so a strategy built in code behaves like ``flwr run`` with no overrides."""

    model: str = "smollm2-135m"  # alias, tiny-<family>, local path or hub id
    strategy: str = "fedcybgd"  # or "fedavg": Flower's FedAvg baseline over `fedavg-params`
    fedavg_params: str = "full"  # fedavg exchanges the whole model or PEFT LoRA adapters
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target_modules: str = "q_proj,v_proj"  # comma-separated module names
    dataset: str = "rotten-tomatoes"
    partitioner: str = "dirichlet"  # iid | dirichlet | movie
    dirichlet_alpha: float = 0.5
    num_server_rounds: int = 6
    clients_per_round: int = 4
    clients_per_block: int = 1  # >1: that many clients train the same block, averaged
    block_schedule: str = "ascending"
    layers_per_block: int = 8
    train_embeddings: bool = False
    train_head: bool = False
    update_rule: str = "fo"
    local_steps: int = 6
    batch_size: int = 8
    max_seq_len: int = 64
    lr: float = 2e-6
    weight_decay: float = 0.0
    eval_every: int = 3  # 0 = only before and after training
    eval_examples: int = 200
    eval_batch_size: int = 32
    output_dir: str = "outputs/demo"
    resume: bool = False
    seed: int = 0
    round_timeout: float = 3600.0
    upload_codec: str = "delta+int8+zstd"  # a codec spec, or "seedlog" (ZO rules' step log)
    seedlog_fallback: str = "delta+int8+zstd"  # weights codec when a log cannot be replayed
    download_codec: str = "delta+int8+zstd"  # frozen blocks; the trained one arrives exact
    download_fraction: float = 1.0  # the paper's random dropping of stale frozen blocks
    version_history: int = 2  # past exact block versions the server keeps for deltas
    max_payload_mb: float = 2048.0
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept for plug-ins

    def __post_init__(self) -> None:
        _choice("update-rule", self.update_rule, UPDATE_RULES)
        _choice("block-schedule", self.block_schedule, SCHEDULES)
        _choice("partitioner", self.partitioner, PARTITIONERS)
        _choice("dataset", self.dataset, DATASETS)
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("fedavg-params", self.fedavg_params, FEDAVG_PARAMS)
        _at_least("lora-rank", self.lora_rank, 1)
        _positive("lora-alpha", self.lora_alpha)
        if not self.lora_modules:
            raise ConfigError("lora-target-modules must name at least one module")
        _at_least("num-server-rounds", self.num_server_rounds, 1)
        _at_least("clients-per-round", self.clients_per_round, 1)
        _at_least("clients-per-block", self.clients_per_block, 1)
        _at_least("layers-per-block", self.layers_per_block, 1)
        _at_least("local-steps", self.local_steps, 1)
        _at_least("batch-size", self.batch_size, 1)
        _at_least("max-seq-len", self.max_seq_len, 8)
        _at_least("eval-every", self.eval_every, 0)
        _at_least("eval-examples", self.eval_examples, 1)
        _at_least("eval-batch-size", self.eval_batch_size, 1)
        _positive("lr", self.lr)
        _positive("dirichlet-alpha", self.dirichlet_alpha)
        _positive("round-timeout", self.round_timeout)
        _positive("max-payload-mb", self.max_payload_mb)
        if not 0 < self.download_fraction <= 1:
            raise ConfigError(
                f"download-fraction must be in (0, 1], got {self.download_fraction}"
            )
        _at_least("version-history", self.version_history, 0)
        specs = [("download-codec", self.download_codec),
                 ("seedlog-fallback", self.seedlog_fallback)]
        if self.upload_codec != "seedlog":
            specs.append(("upload-codec", self.upload_codec))
        for key, spec in specs:
            try:
                parse_spec(spec)
            except CodecError as err:
                raise ConfigError(f"{key} = {spec!r}: {err}") from None
        if self.weight_decay < 0:
            raise ConfigError(f"weight-decay must be >= 0, got {self.weight_decay}")
        if self.clients_per_round % self.clients_per_block:
            raise ConfigError(
                f"clients-per-round ({self.clients_per_round}) must be a multiple of "
                f"clients-per-block ({self.clients_per_block})"
            )
        if not self.model:
            raise ConfigError("model must name a model (alias, tiny-<family>, path or hub id)")

    @property
    def lora_modules(self) -> list[str]:
        """``lora-target-modules`` as a list."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    @property
    def blocks_per_round(self) -> int:
        """Distinct blocks trained in parallel each round."""
        return self.clients_per_round // self.clients_per_block

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Build from Flower's ``context.run_config`` (keys with dashes)."""
        return _build(cls, run_config)

    def to_run_config(self) -> dict[str, Any]:
        """Back to Flower's flat key style (for records, checkpoints and the summary)."""
        out = {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "extra"
        }
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode declares about itself (``--node-config``)."""

    partition_id: int = 0
    num_partitions: int = 1
    update_rule: str = ""  # empty: follow the run config
    memory_budget_mb: float = 0.0  # 0: no budget declared
    cache_dir: str = ""  # empty: FEDCYBGD_CACHE or ~/.cache/fedcybgd

    def __post_init__(self) -> None:
        _at_least("num-partitions", self.num_partitions, 1)
        if not 0 <= self.partition_id < self.num_partitions:
            raise ConfigError(
                f"partition-id must be in [0, num-partitions={self.num_partitions}), "
                f"got {self.partition_id}"
            )
        if self.update_rule:
            _choice("update-rule", self.update_rule, UPDATE_RULES)
        if self.memory_budget_mb < 0:
            raise ConfigError(f"memory-budget-mb must be >= 0, got {self.memory_budget_mb}")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """Build from Flower's ``context.node_config``; unknown keys are ignored."""
        known = {f.name.replace("_", "-") for f in dataclasses.fields(cls)}
        return _build(cls, {k: v for k, v in node_config.items() if k in known})


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {list(allowed)}")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


def _coerce(key: str, value: Any, kind: Any) -> Any:
    origin = get_origin(kind)
    if origin is Literal:
        kind = type(get_args(kind)[0])
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def _build(cls: Any, raw: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = {name: _field_type(cls, name) for name in fields}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in fields and name != "extra":
            kwargs[name] = _coerce(key, value, hints[name])
        else:
            extra[key] = value
    if "extra" in fields:
        kwargs["extra"] = extra
    return cls(**kwargs)


def _field_type(cls: Any, name: str) -> Any:
    annotation = cls.__dataclass_fields__[name].type
    return {"str": str, "int": int, "float": float, "bool": bool}.get(annotation, annotation)
