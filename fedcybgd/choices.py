"""The allowed values of every enumerated config key, in one place.

The run config (:mod:`fedcybgd.config`), the rule options (:mod:`fedcybgd.rules.builtin_options`)
and the code that acts on a value import these tuples, so a value that passes the check at start is
one the code knows. No imports: the server, the clients and the tools can all use this module.
"""

from __future__ import annotations

UPDATE_RULES: tuple[str, ...] = ("fo", "zerolock", "lezo", "mezo")  # update-rule
SCHEDULES: tuple[str, ...] = ("ascending", "descending", "random", "spread")  # block-schedule
PARTITIONERS: tuple[str, ...] = ("iid", "dirichlet", "movie")  # partitioner
DATASETS: tuple[str, ...] = ("rotten-tomatoes", "tomi")  # dataset (built-in names; or a path)
TASKS: tuple[str, ...] = ("classification", "sft", "multiple-choice")  # task (built-ins)
AUTO_TASK = "auto"  # task: the built-in dataset's own kind; classification for other data
STRATEGIES: tuple[str, ...] = ("fedcybgd", "fedavg")  # strategy (fedavg: Flower's own FedAvg)
FEDAVG_PARAMS: tuple[str, ...] = ("full", "lora")  # fedavg-params
AGGREGATES: tuple[str, ...] = ("mean", "median", "trimmed-mean", "geometric-median",
                                 "centered-clip")  # aggregate
ZEROLOCK_HEADS: tuple[str, ...] = ("frozen-lm", "tuned", "calibrated")  # zerolock-head
ZEROLOCK_OBJECTIVES: tuple[str, ...] = ("label", "next-token")  # zerolock-objective
DAMPINGS: tuple[str, ...] = ("none", "inverse", "inverse-sqrt")  # parallel-damping
SERVER_OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam")  # server-optimizer
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")  # lr-schedule
EVAL_SPLITS: tuple[str, ...] = ("test", "validation")  # eval-split
FROZEN_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # frozen-dtype
FROZEN_QUANTS: tuple[str, ...] = ("none", "int8")  # frozen-quant
EVAL_PRECISIONS: tuple[str, ...] = ("float32", "frozen")  # eval-precision
