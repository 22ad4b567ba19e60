"""What the FedAvg baselines' server and clients share: the exchanged model and its records.

The baselines are Flower's own FedAvg over the whole model or LoRA adapters
(:mod:`fedcybgd.server.baselines` runs them, :mod:`fedcybgd.client.baselines` trains them).
Both sides build the same :class:`BaselineModel`, check arrays against it with
:func:`check_tensors` and convert tensors to and from Flower records the same way, so these
pieces live here, in a package that imports neither side.
"""

from fedcybgd.baselines.model import (
    BaselineModel,
    build_baseline,
    build_full,
    build_lora,
    check_tensors,
    lora_config,
)
from fedcybgd.baselines.records import (
    ARRAYS,
    CONFIG,
    METRICS,
    from_record,
    is_fedavg_message,
    to_record,
)

__all__ = [
    "ARRAYS",
    "CONFIG",
    "METRICS",
    "BaselineModel",
    "build_baseline",
    "build_full",
    "build_lora",
    "check_tensors",
    "from_record",
    "is_fedavg_message",
    "lora_config",
    "to_record",
]
