"""The zeroth-order maths of LeZO and MeZO: seeds, units, perturbation directions, the update,
and the step log that describes a round so that it can be replayed.

A zeroth-order step is fully described by a few numbers: the step's seed, which units of the
block it perturbed, the projected gradient ``g`` and the learning rate. Everything else is
rebuilt from the seed, so a client can upload its step log (:class:`SeedLog`, a few bytes per
step) instead of its weights, and the server :func:`replay` s it on its own copy of the block.

What both sides must agree on, and this module defines once:

* **Units** (:func:`unit_layout`): a block of several decoder layers has one unit per layer
  (the layer's tensors, in model order); a single-layer block, ``embed`` and ``head`` have one
  unit per parameter tensor.
* **Seeds**: ``step_seed(seed, step)``, ``unit_seed(step_seed, unit)``, ``choice_seed`` are
  splitmix64 mixes (:func:`mix64`), pure Python, identical everywhere.
* **z** (:func:`unit_z_chunks`): each unit has its own ``torch.Generator`` seeded with its
  unit seed; its z is that generator's ``torch.randn`` stream in fp32, drawn tensor by tensor in
  layout order, in chunks of ``Z_CHUNK`` elements (so no full-size z is ever materialized).
  One unit's z is rebuilt without touching any other unit.
* **The update** (:func:`apply_update`): ``theta -= lr * (g * z + wd * theta)`` in fp32, as four
  separately rounded elementwise ops (no fused multiply-add), weight decay only on tensors of
  two or more dimensions (not on norms and biases, as in MeZO).

``torch.randn`` on CPU is reproducible for one torch build but not promised across builds (or
CPU vector extensions), so a log carries the torch version and a fingerprint of z and of the
update arithmetic (:func:`z_fingerprint`); :func:`replay` refuses a log whose fingerprint
differs from its own, and checks the client's result checksum when the log has one.

The log's bytes on the wire are :mod:`fedcybgd.protocol.seedlog`'s business.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.blocks import BlockMap

Z_CHUNK = 1 << 20  # elements of z drawn per randn call (a multiple of 16)
MASK64 = (1 << 64) - 1
_HEX = re.compile(r"[0-9a-f]*")
_DOMAIN_STEP, _DOMAIN_UNIT, _DOMAIN_CHOICE, _DOMAIN_PROBE = 1, 2, 3, 4
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bounds of a well-formed log, far outside what honest zeroth-order training produces (eps
# ~1e-3, lr ~1e-6..1e-3, |g| = |loss difference| / 2 eps), so a log cannot overflow the
# replay; what a replay may change is bounded again by the server's update checks.
MAX_EPS = 1.0
MAX_WEIGHT_DECAY = 1.0
MAX_LR = 1.0
MAX_PROJECTED_GRAD = 1e8


class ReplayError(ValueError):
    """A seed log that cannot be replayed here (other torch, other z, wrong base/result)."""


# ------------------------------------------------------------------------------- seeds
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix64(*values: int) -> int:
    """Hash integers (any sign, taken mod 2**64) to one 64-bit seed with splitmix64."""
    h = 0x6A09E667F3BCC908
    for value in values:
        h = _splitmix64(h ^ (int(value) & MASK64))
    return h


def step_seed(seed: int, step: int) -> int:
    """Seed of local step ``step`` of a round whose seed is ``seed``."""
    return mix64(_DOMAIN_STEP, seed, step)


def unit_seed(seed_of_step: int, unit: int) -> int:
    """Seed of unit ``unit``'s generator in the step seeded ``seed_of_step``."""
    return mix64(_DOMAIN_UNIT, seed_of_step, unit)


def choice_seed(seed_of_step: int) -> int:
    """Seed of the generator that picks the step's units."""
    return mix64(_DOMAIN_CHOICE, seed_of_step)


def units_per_step(density: float, units: int) -> int:
    """``ceil(density * units)``, at least 1 (``density`` in (0, 1])."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"lezo-density must be in (0, 1], got {density}")
    # round() first: 0.1 * 30 is 3.0000000000000004, which must give 3, not 4.
    return min(units, max(1, math.ceil(round(density * units, 9))))


def choose_units(seed_of_step: int, units: int, count: int) -> tuple[int, ...]:
    """The ``count`` units (sorted) a step perturbs; all of them when ``count >= units``."""
    if count >= units:
        return tuple(range(units))
    generator = torch.Generator().manual_seed(choice_seed(seed_of_step))
    perm = torch.randperm(units, generator=generator)
    return tuple(sorted(int(i) for i in perm[:count]))


# ------------------------------------------------------------------------------- units
def unit_layout(blocks: BlockMap, block: str) -> tuple[tuple[str, ...], ...]:
    """The units of ``block``: tensor names grouped per unit, in model order.

    A block of several decoder layers has one unit per layer; a single-layer block, ``embed``
    and ``head`` have one unit per tensor.
    """
    info = blocks.info(block)
    if info.layers is None or info.layers[0] == info.layers[1]:
        return tuple((name,) for name in info.param_names)
    prefix = blocks.layers_name + "."
    groups: dict[int, list[str]] = {}
    for name in info.param_names:
        index = int(name[len(prefix):].split(".", 1)[0])
        groups.setdefault(index, []).append(name)
    return tuple(tuple(groups[index]) for index in sorted(groups))


def layout_id(layout: Sequence[Sequence[str]]) -> str:
    """A short hash of a unit layout (both sides must use the same one)."""
    text = json.dumps([list(unit) for unit in layout], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def decays(shape: Sequence[int] | torch.Size) -> bool:
    """Whether weight decay applies to a tensor of ``shape`` (not to norms and biases)."""
    return len(shape) >= 2


# ----------------------------------------------------------------------------------- z
def z_spans(numels: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The chunks z is drawn in: ``(tensor position, offset, size)`` over ``numels`` in order,
    each at most ``Z_CHUNK`` long (one ``torch.randn`` call each)."""
    for pos, numel in enumerate(numels):
        for offset in range(0, numel, Z_CHUNK):
            yield pos, offset, min(Z_CHUNK, numel - offset)


def unit_z_chunks(
    seed: int, numels: Sequence[int], out: torch.Tensor | None = None
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The z of one unit, chunk by chunk: ``(tensor position, offset, z chunk)``.

    ``numels`` are the element counts of the unit's tensors in layout order; chunks are fp32,
    on the CPU, at most ``Z_CHUNK`` long, and cover every tensor in order. With ``out`` (a CPU
    fp32 tensor of at least ``min(Z_CHUNK, max(numels))`` elements) every chunk is a view of
    it, overwritten by the next one: no allocation per chunk.
    """
    generator = torch.Generator().manual_seed(seed)
    for pos, offset, size in z_spans(numels):
        if out is None:
            yield pos, offset, torch.randn(size, generator=generator, dtype=torch.float32)
        else:
            yield pos, offset, torch.randn(size, generator=generator, out=out[:size])


def unit_z_into(seed: int, numels: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """The whole z of one unit drawn straight into ``out`` (flat CPU fp32 of ``sum(numels)``
    elements, the tensors end to end): the values of :func:`unit_z_chunks`, by the same calls.

    Units' generators are independent, so several units can be drawn at once on threads
    (``torch.randn`` releases the GIL) with the same result."""
    if out.dtype != torch.float32 or out.device.type != "cpu" or out.dim() != 1 \
            or out.numel() != sum(numels):
        raise ValueError(f"unit_z_into needs a flat CPU fp32 tensor of {sum(numels)} elements, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    generator = torch.Generator().manual_seed(seed)
    at = 0
    for _, _, size in z_spans(numels):
        torch.randn(size, generator=generator, out=out[at:at + size])
        at += size
    return out


def unit_z(seed: int, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The whole z of one unit, one fp32 tensor per shape (for tests and tools)."""
    numels = [math.prod(shape) for shape in shapes]
    flat = unit_z_into(seed, numels, torch.empty(sum(numels), dtype=torch.float32))
    return [part.view(*shape) for part, shape in
            zip(flat.split(numels), shapes, strict=True)]


def apply_update(
    theta: torch.Tensor,
    z: torch.Tensor,
    g: float,
    lr: float,
    wd: float,
    decay: bool,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``theta -= lr * (g * z + wd * theta)`` in place on fp32 ``theta``, op by op.

    ``g``, ``lr`` and ``wd`` must be fp32 values (see :func:`to_f32`) so that client and
    server round identically. ``work``: two fp32 scratch tensors shaped like ``theta`` (the
    result does not depend on them).
    """
    if work is None:
        work = (torch.empty_like(theta), torch.empty_like(theta))
    update = torch.mul(z, g, out=work[0])
    if decay and wd != 0.0:
        update.add_(torch.mul(theta, wd, out=work[1]))
    update.mul_(lr)
    theta.sub_(update)


def to_f32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as a Python float)."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:  # beyond fp32's range: fp32 rounds to inf
        return math.copysign(math.inf, value)


def replay_identity(device: torch.device | str = "cpu") -> str:
    """``"<torch>|<z fingerprint>"``: what a node and the server compare to know that one
    replays the other's step logs bit for bit on ``device`` (seed-log downloads)."""
    return f"{torch.__version__}|{z_fingerprint(device)}"


def z_fingerprint(device: torch.device | str = "cpu") -> str:
    """Hash of z and update arithmetic on a fixed probe: equal iff replay can be exact here.

    z is always drawn on the CPU (:func:`unit_z_chunks`), so its stream is the same whatever
    device trains; the update arithmetic runs where the block lives, so the probe's update runs
    on ``device``. A client training on a GPU and a server replaying on the CPU then agree
    exactly when that device's fp32 elementwise ops round as the CPU's do, and the fingerprints
    say so either way (a mismatch makes the client upload weights instead of its log).
    """
    return _z_fingerprint(str(torch.device(device)))


@functools.lru_cache(maxsize=8)
def _z_fingerprint(device: str) -> str:
    numels = [7, 4099, Z_CHUNK + 5]
    digest = hashlib.sha256()
    theta = torch.linspace(-0.05, 0.05, 4099, dtype=torch.float32).to(device)
    for pos, _offset, z in unit_z_chunks(mix64(_DOMAIN_PROBE), numels):
        digest.update(z.numpy().tobytes())
        if pos == 1:
            apply_update(theta, z.to(device), to_f32(0.37), to_f32(1e-3), to_f32(0.01), True)
            digest.update(theta.cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- the log
@dataclass(frozen=True)
class SeedStep:
    """One applied step: its seed, the units it perturbed and updated, ``g`` and ``lr``."""

    seed: int
    units: tuple[int, ...]
    g: float
    lr: float


@dataclass(frozen=True)
class SeedLog:
    """Everything needed to replay a client's zeroth-order training of one block.

    ``base`` and ``result`` are content checksums (:func:`fedcybgd.core.checksum.content_checksum`)
    of the block before and after training; empty when unknown.
    """

    block: str
    units: int
    layout: str
    eps: float
    weight_decay: float
    torch: str
    z: str
    steps: tuple[SeedStep, ...] = ()
    chunk: int = Z_CHUNK
    base: str = ""
    result: str = ""


def check_log(log: SeedLog) -> None:
    """Raise ``ValueError`` unless ``log`` is well formed (bounded, fp32 numbers, hex digests)."""
    if not 1 <= log.units < 1 << 16:
        raise ValueError(f"seed log units must be in 1..65535, got {log.units}")
    if not 0 < log.eps <= MAX_EPS:
        raise ValueError(f"seed log eps must be in (0, {MAX_EPS}], got {log.eps}")
    if not 0 <= log.weight_decay <= MAX_WEIGHT_DECAY:
        raise ValueError(
            f"seed log weight decay must be in [0, {MAX_WEIGHT_DECAY}], got {log.weight_decay}"
        )
    if log.chunk != Z_CHUNK:
        raise ValueError(f"seed log z chunk {log.chunk} differs from this version's {Z_CHUNK}")
    for key, digest, lengths in (
        ("layout", log.layout, (16,)),
        ("z", log.z, (16,)),
        ("base", log.base, (0, 64)),
        ("result", log.result, (0, 64)),
    ):
        if len(digest) not in lengths or not _HEX.fullmatch(digest):
            raise ValueError(f"seed log '{key}' is not a hex digest: {digest!r}")
    if not log.block or len(log.block) > 256:
        raise ValueError("seed log block name is empty or too long")
    if len(log.torch) > 64:
        raise ValueError("seed log torch version is too long")
    for index, step in enumerate(log.steps):
        if not 0 <= step.seed <= MASK64:
            raise ValueError(f"seed log step {index}: seed out of range")
        if not step.units or list(step.units) != sorted(set(step.units)):
            raise ValueError(f"seed log step {index}: units must be distinct, sorted, non-empty")
        if step.units[0] < 0 or step.units[-1] >= log.units:
            raise ValueError(f"seed log step {index}: unit out of 0..{log.units - 1}")
        for label, value in (("g", step.g), ("lr", step.lr)):
            if not math.isfinite(value) or to_f32(value) != value:
                raise ValueError(f"seed log step {index}: {label}={value} is not a finite fp32")
        if not 0 <= step.lr <= MAX_LR or abs(step.g) > MAX_PROJECTED_GRAD:
            raise ValueError(
                f"seed log step {index}: lr={step.lr} or g={step.g} out of range "
                f"(lr in [0, {MAX_LR}], |g| <= {MAX_PROJECTED_GRAD:g})"
            )


# -------------------------------------------------------------------------------- replay
def replay_passes(log: SeedLog, unit_sizes: Sequence[int]) -> float:
    """The work of replaying ``log``, in passes over its block: each step draws z for, and
    updates, the units it chose (``unit_sizes``: each unit's element count, in layout order).
    """
    total = sum(unit_sizes)
    if not total:
        return 0.0
    return sum(unit_sizes[u] for step in log.steps for u in step.units) / total


def replay(
    block_tensors: Mapping[str, torch.Tensor],
    log: SeedLog,
    layout: Sequence[Sequence[str]],
    *,
    check_torch: bool = True,
    verify: bool = True,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Re-apply the updates of ``log`` to a copy of ``block_tensors`` (the block's start).

    Parameters
    ----------
    block_tensors : Mapping[str, Tensor]
        The block as the client started from it (fp32, fp16 or bf16); not modified.
    log : SeedLog
        The client's step log.
    layout : sequence of sequences of str
        ``unit_layout(blocks, log.block)`` on this side.
    check_torch : bool
        Refuse a log written by another torch version.
    verify : bool
        Check the start against ``log.base`` and the result against ``log.result`` (when set).
    device : torch.device or str
        Where the update arithmetic runs (the server's ``device``); the log's fingerprint must
        match this device's (:func:`z_fingerprint`).

    Returns
    -------
    dict[str, Tensor]
        The trained block, on the CPU in the dtypes of ``block_tensors``: fp32 master
        arithmetic, as on the client, so it equals the client's block bit for bit when the
        fingerprints match.

    Raises
    ------
    ReplayError
        When the log cannot be replayed exactly here, or a checksum differs.
    ValueError
        When ``layout`` or ``block_tensors`` do not fit the log.
    """
    _check_replayable(block_tensors, log, layout, check_torch=check_torch, verify=verify,
                      device=device)
    masters = {
        name: t.detach().to(device=device, dtype=torch.float32, copy=True).reshape(-1)
        for name, t in block_tensors.items()
    }
    update = _UnitUpdate(masters, block_tensors, layout, log.weight_decay)
    _replay_steps(log.steps, update, device)
    out = {
        name: masters[name].view(block_tensors[name].shape).to("cpu", block_tensors[name].dtype)
        for name in block_tensors
    }
    if verify and log.result and content_checksum(out) != log.result:
        raise ReplayError(f"block '{log.block}': replay does not reproduce the client's result")
    return out


def _check_replayable(
    block_tensors: Mapping[str, torch.Tensor],
    log: SeedLog,
    layout: Sequence[Sequence[str]],
    *,
    check_torch: bool,
    verify: bool,
    device: torch.device | str,
) -> None:
    """Raise unless ``log`` can be replayed exactly here on ``block_tensors`` (see :func:`replay`):
    a well-formed log, the same unit layout and tensors, torch version, z fingerprint, supported
    dtypes, and (with ``verify``) the client's start.
    """
    check_log(log)
    names = [name for unit in layout for name in unit]
    if len(layout) != log.units or layout_id(layout) != log.layout:
        raise ValueError(
            f"block '{log.block}': the log was written for another unit layout "
            f"({log.units} units, {log.layout}; here {len(layout)}, {layout_id(layout)})"
        )
    if sorted(names) != sorted(block_tensors) or len(set(names)) != len(names):
        raise ValueError(
            f"block '{log.block}': tensors {sorted(block_tensors)} do not fit the layout"
        )
    if check_torch and log.torch != torch.__version__:
        raise ReplayError(f"log written with torch {log.torch}, this is torch {torch.__version__}")
    if log.z != z_fingerprint(device):
        raise ReplayError(f"z fingerprint {log.z} differs from this machine's "
                          f"{z_fingerprint(device)} on {device}")
    for name, tensor in block_tensors.items():
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"tensor '{name}' has dtype {tensor.dtype}; zeroth-order rules need "
                             f"one of {SUPPORTED_DTYPES}")
    if verify and log.base and content_checksum(block_tensors) != log.base:
        raise ReplayError(f"block '{log.block}': the start tensors are not the client's start")


class _UnitUpdate:
    """Applies one step's update to one unit of the fp32 ``masters``, in place: redraws the
    unit's z chunk by chunk and runs :func:`apply_update` on each chunk. Safe to call from
    several threads at once for disjoint units: each thread keeps its own z buffer and scratch.
    """

    def __init__(
        self,
        masters: Mapping[str, torch.Tensor],
        block_tensors: Mapping[str, torch.Tensor],
        layout: Sequence[Sequence[str]],
        weight_decay: float,
    ) -> None:
        self.masters = masters
        self.block_tensors = block_tensors
        self.layout = layout
        self.weight_decay = weight_decay
        self.size = min(Z_CHUNK, max((t.numel() for t in masters.values()), default=1))
        self.local = threading.local()  # each thread's z buffer and update scratch

    def __call__(self, step: SeedStep, unit: int) -> None:
        local, size = self.local, self.size
        if not hasattr(local, "buffer"):
            local.buffer = torch.empty(size, dtype=torch.float32)
            local.work = {}
        unit_names = self.layout[unit]
        numels = [self.masters[name].numel() for name in unit_names]
        for pos, offset, z in unit_z_chunks(unit_seed(step.seed, unit), numels,
                                            out=local.buffer):
            name = unit_names[pos]
            n = z.numel()
            theta = self.masters[name][offset:offset + n]
            if theta.device not in local.work:
                local.work[theta.device] = (torch.empty(size, device=theta.device),
                                            torch.empty(size, device=theta.device))
            scratch = local.work[theta.device]
            apply_update(theta, z.to(theta.device), step.g, step.lr, self.weight_decay,
                         decays(self.block_tensors[name].shape),
                         work=(scratch[0][:n], scratch[1][:n]))


def _replay_steps(
    steps: Sequence[SeedStep], update: _UnitUpdate, device: torch.device | str
) -> None:
    """Run ``update`` for every unit of every step, step after step.

    A step's units are disjoint tensors with generators of their own: on the CPU they are
    replayed side by side, one per torch thread (the same values as one after another).
    """
    widest = max((len(step.units) for step in steps), default=1)
    workers = min(torch.get_num_threads(), widest) if torch.device(device).type == "cpu" else 1
    if workers <= 1:
        for step in steps:
            for unit in step.units:
                update(step, unit)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for step in steps:
                for _ in pool.map(functools.partial(update, step), step.units):
                    pass  # re-raises a unit's error
