"""The allowed values of every fixed-choice config key, in one place.

The run config (:mod:`fedcybgd.config`), the rule options (:mod:`fedcybgd.rules.builtin`)
and the code that acts on a value import these tuples, so a value that passes the check at start
is one the code knows. No imports: the server, the clients and the tools can all use this module.

Keys whose values plug-ins can add have a registry instead, and the registry is the list:
``update-rule`` (:mod:`fedcybgd.rules`), ``block-schedule`` and ``aggregate``
(:mod:`fedcybgd.strategies`), ``task`` (:mod:`fedcybgd.data.kinds`) and the built-in
``dataset`` names (:mod:`fedcybgd.data.catalogue`).
"""

from __future__ import annotations

PARTITIONERS: tuple[str, ...] = ("iid", "dirichlet", "movie")  # partitioner
AUTO_TASK = "auto"  # task: the built-in dataset's own kind; classification for other data
# update-rule: the built-in rules (declared in fedcybgd.rules.builtin, their code bound by the
# client package, fedcybgd.client.updates.base; plug-ins add more)
BUILTIN_RULES: tuple[str, ...] = ("fo", "zerolock", "lezo", "mezo")
# task: the built-in kinds (each registers its class in fedcybgd.tasks; plug-ins add more)
BUILTIN_TASKS: tuple[str, ...] = ("classification", "sft", "multiple-choice", "lm")
# strategy (fedavg: Flower's own FedAvg; pipeline: one model split over several nodes)
STRATEGIES: tuple[str, ...] = ("fedcybgd", "fedavg", "pipeline")
FEDAVG_PARAMS: tuple[str, ...] = ("full", "lora")  # fedavg-params
ZEROLOCK_HEADS: tuple[str, ...] = ("frozen-lm", "tuned", "calibrated")  # zerolock-head
ZEROLOCK_OBJECTIVES: tuple[str, ...] = ("label", "next-token")  # zerolock-objective
DAMPINGS: tuple[str, ...] = ("none", "inverse", "inverse-sqrt")  # parallel-damping
SERVER_OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam")  # server-optimizer
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")  # lr-schedule
EVAL_SPLITS: tuple[str, ...] = ("test", "validation")  # eval-split
FROZEN_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # frozen-dtype
FROZEN_QUANTS: tuple[str, ...] = ("none", "int8")  # frozen-quant
EVAL_PRECISIONS: tuple[str, ...] = ("float32", "frozen")  # eval-precision
EARLY_STOP_METRICS: tuple[str, ...] = ("loss", "metric")  # early-stop-metric
DP_MODES: tuple[str, ...] = ("off", "central", "local", "example")  # dp
WANDB_MODES: tuple[str, ...] = ("offline", "online")  # wandb-mode
PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zerolock")  # pipeline schedule
ACTIVATION_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # pipeline-activations
TRAINERS: tuple[str, ...] = ("eager", "executorch")  # trainer (node config)
