"""Typed run configuration, built once at the edge from Flower's flat ``run_config`` dict.

Every key of ``[tool.flwr.app.config]`` is either a field of :class:`RunConfig` (dashes become
underscores) or a registered update rule's option (:mod:`fedcybgd.rules`). Nothing else is
accepted: an unknown key stops the run at start with the closest known key suggested, and a bad
value (wrong type, NaN, infinite, out of range, not an allowed choice) with a
:class:`ConfigError` naming the key and what is allowed. The modules named in ``plugin-modules``
(and ``rule-modules``, its older name) are imported first (their rules, schedules and
aggregators register themselves, see :mod:`fedcybgd.core.registry`), then ``update-rule`` must name
a registered rule and every registered rule's options are checked, here, on the server, before
round 1; each client builds the same :class:`RunConfig`, so it loads the same plug-ins.
``block-schedule`` and ``aggregate`` are only the server's business: their registries live with
the strategy, so the ServerApp checks them at start (:func:`fedcybgd.strategies.check_names`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcybgd import protocol, rules
from fedcybgd.choices import (
    AUTO_TASK,
    DAMPINGS,
    DP_MODES,
    EVAL_PRECISIONS,
    EVAL_SPLITS,
    FEDAVG_PARAMS,
    FROZEN_DTYPES,
    FROZEN_QUANTS,
    LR_SCHEDULES,
    PARTITIONERS,
    SERVER_OPTIMIZERS,
    STRATEGIES,
)
from fedcybgd.compression import CodecError, lossy_delta_spec, parse_spec
from fedcybgd.core import registry
from fedcybgd.core.fields import ConfigError, build, closest, coerce, normalize, setting, settings
from fedcybgd.data.catalogue import builtin_dataset
from fedcybgd.data.kinds import task_class
from fedcybgd.model.devices import check_device_name
from fedcybgd.protocol.prior import ClassPriorSpec
from fedcybgd.rules import RuleOptions

__all__ = [
    "FEDAVG_PARAMS",
    "PARTITIONERS",
    "STRATEGIES",
    "ConfigError",
    "NodeConfig",
    "RunConfig",
    "run_config_keys",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated. Defaults equal ``[tool.flwr.app.config]`` (a test
    checks), so a strategy built in code behaves like ``flwr run`` with no overrides."""

    model: str = setting("smollm2-135m")  # alias, tiny-<family>, local path or hub id
    strategy: str = setting("fedcybgd", choices=STRATEGIES)  # fedavg: Flower's FedAvg
    fedavg_params: str = setting("full", choices=FEDAVG_PARAMS)  # whole model or LoRA
    lora_rank: int = setting(8, ge=1)
    lora_alpha: int = setting(16, ge=1)
    lora_target_modules: str = setting("q_proj,v_proj")  # comma-separated module names
    # The task layer (fedcybgd.tasks): what is fine-tuned, on which data, how it is scored
    # A registered task (fedcybgd.data.kinds), checked; "auto": the built-in dataset's own kind
    # (classification for files and hub names). The resolved kind: `task_kind`.
    task: str = setting(AUTO_TASK)
    dataset: str = setting("rotten-tomatoes")  # a built-in name (data.catalogue), a path, hub name
    eval_dataset: str = setting("")  # the server's own held-out file; "": dataset's eval-split
    text_field: str = setting("text")  # classification
    label_field: str = setting("label")  # classification: class index or label word
    label_words: str = setting("negative,positive")  # classification, in label order
    prompt_template: str = setting("Review: {text}\nSentiment:")  # classification
    prompt_field: str = setting("prompt")  # sft
    response_field: str = setting("response")  # sft
    messages_field: str = setting("")  # sft: a chat `messages` list column instead
    question_field: str = setting("question")  # multiple-choice
    options_field: str = setting("options")  # multiple-choice: a list of option texts
    answer_field: str = setting("answer")  # multiple-choice: index or text of the answer
    length_normalize: bool = setting(False)  # multiple-choice: log-likelihood per token
    max_new_tokens: int = setting(32, ge=1, le=4096)  # sft: greedy generation at evaluation
    partition_by: str = setting("")  # column dirichlet/movie read; "": the task's default
    partitioner: str = setting("dirichlet", choices=PARTITIONERS)
    dirichlet_alpha: float = setting(0.5, gt=0)
    num_server_rounds: int = setting(8, ge=1)
    clients_per_round: int = setting(4, ge=1)
    # 0: all of a round's clients train one block (averaged); k: k clients per block
    clients_per_block: int = setting(0, ge=0)
    # A registered schedule (built-ins' and plug-ins'), checked at server start
    block_schedule: str = setting("descending")
    layers_per_block: int = setting(4, ge=1)
    train_embeddings: bool = setting(False)
    train_head: bool = setting(False)
    update_rule: str = setting("fo")  # a registered rule (fedcybgd.rules), checked at start
    # Comma-separated modules imported first, registering plug-in rules, schedules, aggregators
    plugin_modules: str = setting("")
    rule_modules: str = setting("")  # the older name of plugin-modules; both are imported
    local_steps: int = setting(5, ge=1)
    batch_size: int = setting(8, ge=1)
    max_seq_len: int = setting(64, ge=8)
    lr: float = setting(1e-4, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    eval_every: int = setting(4, ge=0)  # 0 = only before and after training
    eval_examples: int = setting(200, ge=1)
    eval_batch_size: int = setting(32, ge=1)
    # the untrained model's evaluation kept on disk, keyed by weights, rows and settings
    eval_cache: bool = setting(True)
    output_dir: str = setting("outputs/demo")
    resume: bool = setting(False)
    overwrite: bool = setting(False)  # allow starting over a non-empty output-dir
    seed: int = setting(0, ge=0, lt=2**32)
    round_timeout: float = setting(3600.0, gt=0)
    upload_codec: str = setting("delta+int2+zstd")  # a codec spec, or "seedlog" (ZO step log)
    seedlog_fallback: str = setting("delta+int8+zstd")  # weights codec when no exact replay
    download_codec: str = setting("delta+int2+zstd")  # frozen blocks, or "seedlog" (ZO step logs)
    # most replay work (passes over the block) a seed-log download may cost a node; 0 = no cap
    seedlog_max_replay: float = setting(64.0, ge=0)
    download_fraction: float = setting(1.0, gt=0, le=1)  # the paper's random dropping
    max_staleness: int = setting(0, ge=0)  # installs a frozen copy may lag before it is sent
    traffic_budget_mb: float = setting(0.0, ge=0)  # payload MB per client-round; 0 = none
    # "none", or a lossy delta codec the server rounds each installed block to, so nodes
    # holding its previous version get it exactly at that codec's cost; "auto": the
    # download codec when it is one (nodes' frozen copies are that rounding anyway)
    install_codec: str = setting("auto")
    version_history: int = setting(2, ge=0)  # past exact block versions kept for deltas
    # a node that trained a block alone computes the installed version itself (not re-sent)
    self_sync: bool = setting(True)
    # lossy uploads: a node adds what the codec dropped of its last update of a block
    error_feedback: bool = setting(True)
    max_payload_mb: float = setting(2048.0, gt=0)
    max_update_norm: float = setting(0.0, ge=0)  # clip a node's block delta (L2); 0 = off
    outlier_factor: float = setting(10.0, ge=0)  # refuse a delta > factor x median; 0 = off
    # refuse a delta whose RMS exceeds this share of the block's own RMS (a wipe); 0 = off
    max_update_ratio: float = setting(0.5, ge=0, le=10)
    # clients-per-block > 1: a registered aggregator (built-ins' and plug-ins'), checked at start
    aggregate: str = setting("mean")
    trim_fraction: float = setting(0.2, ge=0, lt=0.5)  # trimmed-mean: share cut at each end
    # User-level differential privacy (docs/privacy.md): off; central (the server adds the
    # noise to each merged block); local (each node adds it before upload)
    dp: str = setting("off", choices=DP_MODES)
    dp_clip_norm: float = setting(1.0, gt=0)  # L2 bound of a node's block delta, per round
    dp_noise_multiplier: float = setting(1.0, ge=0, le=100)  # noise deviation / dp-clip-norm
    dp_delta: float = setting(1e-5, gt=0, lt=1)  # the delta epsilon is read at
    dp_target_epsilon: float = setting(0.0, ge=0)  # the budget: no round beyond it; 0 = none
    server_lr: float = setting(1.0, gt=0, le=10)  # the server's step on each merged block
    parallel_damping: str = setting("none", choices=DAMPINGS)  # shrink steps of parallel blocks
    server_optimizer: str = setting("sgd", choices=SERVER_OPTIMIZERS)  # FedOpt, per block
    server_beta1: float = setting(0.9, ge=0, lt=1)  # momentum / Adam's first moment
    server_beta2: float = setting(0.99, ge=0, lt=1)  # Adam's second moment
    server_eps: float = setting(1e-8, gt=0, le=1)  # Adam's epsilon
    lr_schedule: str = setting("constant", choices=LR_SCHEDULES)  # client lr over the rounds
    warmup_rounds: int = setting(0, ge=0)  # rounds of linear lr warm-up
    eval_split: str = setting("test", choices=EVAL_SPLITS)  # validation: for tuning
    logit_adjust: bool = setting(True)  # clients add log(C x own label share) to class logits
    class_balance: bool = setting(True)  # clients draw each batch evenly from their classes
    # the class shares training aims at: global (the nodes' pooled counts), uniform, or shares
    class_prior: str = setting("global")
    # Placement and precision (fedcybgd.model.devices, fedcybgd.model.precision): the clients'
    # and the server's device (a node's own `device` overrides), and how a client holds the
    # blocks it does not train; the trained block and the server's weights are always fp32.
    device: str = setting("auto")  # auto, cpu, cuda, cuda:N, mps
    frozen_dtype: str = setting("float32", choices=FROZEN_DTYPES)
    frozen_quant: str = setting("none", choices=FROZEN_QUANTS)  # int8: Linear/Embedding weights
    eval_precision: str = setting("float32", choices=EVAL_PRECISIONS)  # frozen: as the clients
    # Every registered update rule's options (zerolock-*, zo-*, lezo-*, plug-ins'), every key
    # with its value; keys not given take the rule's default. See fedcybgd.rules.options.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        normalize(self)
        self._check_rules()
        object.__setattr__(self, "options", rules.check_all(self.options))
        check_device_name(self.device, "device")
        if not self.model:
            raise ConfigError("model must name a model (alias, tiny-<family>, path or hub id)")
        if not self.output_dir:
            raise ConfigError("output-dir must name a folder")
        if not self.lora_modules:
            raise ConfigError("lora-target-modules must name at least one module")
        try:
            ClassPriorSpec.parse(self.class_prior)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        specs = [("seedlog-fallback", self.seedlog_fallback)]
        if self.upload_codec != "seedlog":
            specs.append(("upload-codec", self.upload_codec))
        if self.download_codec != "seedlog":
            specs.append(("download-codec", self.download_codec))
        elif self.upload_codec != "seedlog":
            raise ConfigError("download-codec = 'seedlog' resends the uploaded step logs, so it "
                              f"needs upload-codec = 'seedlog' (got {self.upload_codec!r})")
        for key, spec in specs:
            try:
                parse_spec(spec)
            except CodecError as err:
                raise ConfigError(f"{key} = {spec!r}: {err}") from None
        if self.install_codec not in ("none", "auto"):
            try:
                lossy_delta_spec(self.install_codec)
            except CodecError as err:
                raise ConfigError(f"install-codec = {self.install_codec!r}: {err}; or 'none' "
                                  "or 'auto'") from None
        self._check_task()
        if self.clients_per_round % self.per_block:
            raise ConfigError(
                f"clients-per-round ({self.clients_per_round}) must be a multiple of "
                f"clients-per-block ({self.per_block})"
            )
        if 0 < self.outlier_factor < 1:
            # below 1 it would refuse about half of the honest updates
            raise ConfigError(f"outlier-factor must be 0 (off) or >= 1, got {self.outlier_factor}")
        self._check_dp()

    def _check_dp(self) -> None:
        """User-level DP bounds each node's block delta and adds noise to a plain mean: it
        needs weight uploads, the ``mean`` aggregate, FedCyBGD and a noise multiplier > 0."""
        if self.dp == "off":
            return
        for wrong, why in (
            (self.strategy != "fedcybgd", f"strategy = {self.strategy!r}: dp covers FedCyBGD "
                                          "runs (Flower's DP wrappers cover FedAvg's)"),
            (self.aggregate != "mean", f"aggregate = {self.aggregate!r}: dp's noise is "
                                       "calibrated to a mean of clipped deltas; use 'mean'"),
            (self.upload_codec == "seedlog", "upload-codec = 'seedlog': a step log is not a "
                                             "clipped delta; upload weights"),
            (self.dp_noise_multiplier == 0, "dp-noise-multiplier = 0 adds no noise: no "
                                            "privacy to account for"),
        ):
            if wrong:
                raise ConfigError(f"dp = {self.dp!r} with {why}")

    def _check_rules(self) -> None:
        """Load the plug-in modules; ``update-rule`` must be registered, and no rule's option
        key may be one of the run's own keys (it would be read as both). ``block-schedule`` and
        ``aggregate`` must be well-formed names (whether registered, the server checks)."""
        load_plugins(self.rule_modules, self.plugin_modules)
        for key, name in (("block-schedule", self.block_schedule), ("aggregate", self.aggregate)):
            if not re.fullmatch(registry.NAME_PATTERN, name):
                raise ConfigError(f"{key} must name a registered one ({registry.NAME_PATTERN}), "
                                  f"got {name[:80]!r}")
        try:
            rules.rule_spec(self.update_rule)
        except ConfigError as err:
            raise ConfigError(f"update-rule = {self.update_rule!r}: {err}") from None
        clash = sorted(set(rules.option_settings()) & set(settings(type(self))))
        if clash:
            owners = [s.name for s in rules.rule_specs()
                      if set(rules.registry.option_keys(s.options)) & set(clash)]
            raise ConfigError(f"update rule(s) {owners} declare option(s) {clash}, which are "
                              "run-config keys of their own; rename the option(s)")

    def _check_task(self) -> None:
        """``task`` (``auto`` resolved) must be registered (plug-in modules are loaded); its
        text keys parse."""
        try:
            task_class(self.task_kind)
        except ConfigError as err:
            raise ConfigError(f"{err}") from None
        words = [w.strip() for w in self.label_words.split(",")]
        if len(words) < 2 or not all(words) or len(set(words)) != len(words):
            raise ConfigError(f"label-words must be two or more distinct comma-separated words, "
                              f"got {self.label_words!r}")
        if self.prompt_template.count("{text}") != 1:
            raise ConfigError(f"prompt-template must contain {{text}} exactly once, got "
                              f"{self.prompt_template!r}")
        if not self.dataset:
            raise ConfigError("dataset must name a built-in dataset, a file or a folder")

    @property
    def task_kind(self) -> str:
        """The task that runs: ``task``, or for ``auto`` the built-in dataset's own kind
        (``classification`` for files, folders and hub names)."""
        if self.task != AUTO_TASK:
            return self.task
        builtin = builtin_dataset(self.dataset)
        return builtin.task if builtin is not None else "classification"

    @property
    def lora_modules(self) -> list[str]:
        """``lora-target-modules`` as a list."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    @property
    def install_spec(self) -> str:
        """The codec installs are rounded to (``install-codec``, ``auto`` resolved): for
        ``auto`` the download codec if it is a lossy delta codec, else ``"none"``."""
        if self.install_codec != "auto":
            return self.install_codec
        try:
            return str(lossy_delta_spec(self.download_codec))
        except CodecError:
            return "none"

    @property
    def per_block(self) -> int:
        """Clients that train the same block in a round (``clients-per-block``, 0 resolved)."""
        return self.clients_per_block or self.clients_per_round

    @property
    def blocks_per_round(self) -> int:
        """Distinct blocks trained in parallel each round."""
        return self.clients_per_round // self.per_block

    def rule_options(self, rule: str) -> RuleOptions:
        """The typed options of the registered update rule ``rule``."""
        return rules.parse_options(rule, self.options)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Build from Flower's ``context.run_config`` (keys with dashes).

        Raises
        ------
        ConfigError
            A key is unknown (the message suggests the closest known key), or a value is of
            the wrong type, not finite, out of range or not an allowed choice.
        """
        # The plug-in modules first: their rules' option keys are keys of this run config.
        load_plugins(coerce("rule-modules", run_config.get("rule-modules", ""), str),
                     coerce("plugin-modules", run_config.get("plugin-modules", ""), str))
        known = rules.option_settings()
        options = {k: v for k, v in run_config.items() if k in known}
        core = {k: v for k, v in run_config.items() if k not in known}
        run: RunConfig = build(cls, core, also_known=known, options=options)
        return run

    def to_run_config(self) -> dict[str, Any]:
        """Back to Flower's flat key style (for records, checkpoints and the summary)."""
        out = {key: getattr(self, s.name) for key, s in settings(type(self)).items()}
        out.update(self.options)
        return out


def load_plugins(rule_modules: str, plugin_modules: str) -> None:
    """Import the modules of ``rule-modules``, then ``plugin-modules`` (errors name the key)."""
    registry.load_modules(rule_modules, key="rule-modules")
    registry.load_modules(plugin_modules, key="plugin-modules")


def run_config_keys() -> dict[str, Any]:
    """Every run-config key with its default: the run's own keys, then the rules' options."""
    return RunConfig().to_run_config()


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode declares about itself (``--node-config``)."""

    partition_id: int = setting(0, ge=0)
    num_partitions: int = setting(1, ge=1)
    # "": follow the run config. Any other name must be a rule registered once the run's
    # plug-in modules are loaded, so the client checks it when it trains, not here.
    update_rule: str = setting("")
    memory_budget_mb: float = setting(0.0, ge=0)  # 0: no budget declared
    cache_dir: str = setting("")  # empty: FEDCYBGD_CACHE or ~/.cache/fedcybgd
    # The node's stable key (sampling order, seeds); empty: its partition-id. See `key`.
    node_key: str = setting("")
    device: str = setting("")  # empty: the run config's `device`
    # The node's own training data (a file or folder on this device; never sent anywhere):
    # it replaces the node's partition of the run's dataset. Empty: use the partition.
    data_path: str = setting("")
    # What a server may ask of this node (fedcybgd.client.limits); beyond it, refused by name
    max_local_steps: int = setting(1000, ge=1)  # training steps of one round
    max_lr: float = setting(1.0, gt=0)  # the round's learning rate
    max_batch_size: int = setting(256, ge=1)  # rows of one training batch
    max_replay_steps: int = setting(4096, ge=1)  # steps replayed from one round's step logs
    max_replay_logs: int = setting(1024, ge=1)  # step logs (chain length) of one round
    max_download_mb: float = setting(8192.0, gt=0)  # payload bytes of one round's downloads
    max_decoded_mb: float = setting(8192.0, gt=0)  # tensors one downloaded block decodes to

    def __post_init__(self) -> None:
        normalize(self)
        if self.device:
            check_device_name(self.device, "device (node config)")
        if not self.partition_id < self.num_partitions:
            raise ConfigError(
                f"partition-id must be in [0, num-partitions={self.num_partitions}), "
                f"got {self.partition_id}"
            )
        if self.update_rule and not re.fullmatch(registry.NAME_PATTERN, self.update_rule):
            raise ConfigError(
                f"update-rule must be empty or a rule name matching "
                f"{registry.NAME_PATTERN}, got {self.update_rule[:80]!r}"
            )
        if self.node_key and not re.fullmatch(protocol.NODE_KEY_PATTERN, self.node_key):
            raise ConfigError(
                f"node-key must match {protocol.NODE_KEY_PATTERN} (letters, digits and "
                f"._:@+-, at most 64 characters), got {self.node_key[:80]!r}"
            )

    @property
    def key(self) -> str:
        """The key the server orders nodes by and derives their seeds from, the same in every
        run: ``node-key`` if set, else the partition id (see
        :mod:`fedcybgd.strategies.node_keys`)."""
        return self.node_key or str(self.partition_id)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """Build from Flower's ``context.node_config``.

        Other keys are ignored (a node's config may carry keys for other apps); one that looks
        like a misspelt key of ours is logged as a warning with the key it resembles.
        """
        known = settings(cls)
        for key in node_config:
            if key not in known and (match := closest(key, known)) is not None:
                log.warning("node-config key %r is not known and is ignored; did you mean %r?",
                            key, match)
        node: NodeConfig = build(cls, {k: v for k, v in node_config.items() if k in known})
        return node
