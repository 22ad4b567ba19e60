"""FedAvg's message layout and the tensor <-> Flower record conversion both sides use.

Flower's FedAvg sends the global arrays under ``"arrays"`` and its config (with
``"server-round"``) under ``"config"``; a reply carries the trained arrays and a MetricRecord
with ``"num-examples"`` under ``"metrics"``, as any FedAvg ClientApp's does.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message

ARRAYS = "arrays"  # Flower FedAvg's default ArrayRecord key
CONFIG = "config"  # ... and ConfigRecord key
METRICS = "metrics"


def to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """Tensors as a Flower ArrayRecord (numpy-backed, no pickle)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v.cpu().numpy()))
                        for k, v in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """A Flower ArrayRecord as tensors (``np.load`` already made fresh arrays: no copy)."""
    return {k: torch.from_numpy(np.require(v.numpy(), requirements="W"))
            for k, v in record.items()}


def is_fedavg_message(msg: Message) -> bool:
    """Does ``msg`` come from Flower's FedAvg (global arrays under ``"arrays"``)?"""
    return ARRAYS in msg.content.array_records
