"""Where a process computes: the ``device`` key (run config, overridable per node) resolved.

``auto`` takes the first accelerator torch sees (CUDA, then Apple's MPS), else the CPU;
``cuda`` means ``cuda:0``. A device that is named but absent is refused with
:class:`DeviceUnavailable`, naming the key, the device and what the machine does have, so a node
configured for a GPU it lacks fails at start instead of quietly training on the CPU.

What the machine has is read through a :class:`DeviceProbe` (torch by default), so the
resolution logic and its refusals are tested on any machine.

Weights, step logs and checksums always cross the wire as CPU tensors: code that computes on a
device brings results back with :func:`to_cpu` before encoding them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcybgd.core.fields import ConfigError

DEVICE_PATTERN = r"auto|cpu|cuda|cuda:[0-9]{1,3}|mps"
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, mps"


class DeviceUnavailable(ConfigError):
    """The configured device is well formed but this machine does not have it."""


@dataclass(frozen=True)
class DeviceProbe:
    """What accelerators a machine has: CUDA devices and whether MPS is usable."""

    cuda_count: int
    mps: bool

    @classmethod
    def of_torch(cls) -> DeviceProbe:
        """This machine, as torch sees it."""
        mps = getattr(torch.backends, "mps", None)
        return cls(
            cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            mps=bool(mps is not None and mps.is_available()),
        )

    def describe(self) -> str:
        """What is there, in words (for refusals)."""
        have = ["cpu"]
        if self.cuda_count:
            have.append(f"cuda:0..{self.cuda_count - 1}" if self.cuda_count > 1 else "cuda:0")
        if self.mps:
            have.append("mps")
        return ", ".join(have)


def check_device_name(name: str, key: str = "device") -> str:
    """``name`` if it is a well-formed device name, else :class:`ConfigError` naming ``key``."""
    if not re.fullmatch(DEVICE_PATTERN, name):
        raise ConfigError(f"{key} = {name[:80]!r} is not a device; choose one of "
                          f"{DEVICE_CHOICES}")
    return name


def resolve_device(name: str, key: str = "device",
                   probe: DeviceProbe | None = None) -> torch.device:
    """The torch device ``name`` stands for on this machine.

    Parameters
    ----------
    name : str
        ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
    key : str
        The config key the name came from (named in errors).
    probe : DeviceProbe, optional
        What the machine has; default: as torch sees it.

    Raises
    ------
    ConfigError
        ``name`` is not a device name.
    DeviceUnavailable
        The machine lacks the device (the message names it and what there is).
    """
    check_device_name(name, key)
    probe = probe or DeviceProbe.of_torch()
    if name == "auto":
        if probe.cuda_count:
            return torch.device("cuda", 0)
        return torch.device("mps") if probe.mps else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not probe.mps:
            raise DeviceUnavailable(f"{key} = 'mps', but this machine has no usable MPS device "
                                    f"(it has: {probe.describe()}); set {key} to one of those")
        return torch.device("mps")
    index = int(name.partition(":")[2] or 0)
    if index >= probe.cuda_count:
        why = (f"it has {probe.cuda_count} CUDA device(s)" if probe.cuda_count else
               f"torch {torch.__version__} sees no CUDA device")
        raise DeviceUnavailable(f"{key} = {name!r}, but {why} (it has: {probe.describe()}); "
                                f"set {key} to one of those")
    return torch.device("cuda", index)


def node_device(run_device: str, node_device_name: str,
                probe: DeviceProbe | None = None) -> torch.device:
    """A node's device: its node config's ``device`` when set, else the run config's."""
    if node_device_name:
        return resolve_device(node_device_name, "device (node config)", probe)
    return resolve_device(run_device, "device (run config)", probe)


def to_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors on the CPU (no copy for those already there), for encoding."""
    return {name: t.detach().cpu() for name, t in tensors.items()}
