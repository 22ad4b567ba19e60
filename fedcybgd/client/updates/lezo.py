"""Zeroth-order rules: LeZO (``lezo``) and MeZO (``mezo``, LeZO with every unit perturbed).

Forward passes only, at inference memory. One step on a batch:

1. pick ``ceil(density * units)`` units of the block (a unit is a decoder layer of a
   multi-layer block, or one tensor of a single-layer/``embed``/``head`` block; see
   :mod:`fedcybgd.protocol.zeroth_order`) with a generator seeded from ``(seed, step)``;
2. ``theta += eps * z`` on those units, forward -> ``l+``; ``theta -= 2 eps z``, forward ->
   ``l-``; restore ``theta`` exactly; ``g = (l+ - l-) / (2 eps)``;
3. ``theta -= lr * (g * z + wd * theta)`` on the chosen units; a non-finite ``l+``, ``l-`` or
   ``g`` skips the update (counted in ``skipped_steps``), the weights stay bit-identical.

z of a unit comes from the unit's own generator (``zeroth_order.unit_z_chunks``), in chunks.

**The step cache** (``zo-step-cache-mb``, 64 MB by default). When the chosen units' z and the
starting values of their fp32 tensors fit in it (8 bytes a perturbed element, 4 for fp16/bf16
weights, whose master copy already holds the start), z is drawn once a step straight into it
(the chosen units at once, one per torch thread: each unit has its own generator), the
perturbations are computed from the kept start, and the restore is a copy: no element needs
saving. Otherwise (e.g. LeZO-0.25 on a whole SmolLM2: 216 MB) z is drawn three times a step
(perturb, swap sign, restore+update) and never stored, and the restore is the sparse one below.
Both paths compute the same values with the same ops in the same order: the weights and the
step log are bit-identical (tests/client/updates/test_lezo.py), so the server's replay does not
care.

**Exact restore.** fp32 ``(theta + d) - d`` is not always ``theta``: an element differs by an
ulp when ``theta + d`` lands in a coarser binade (7 % of N(0, 0.02) weights at ``eps = 1e-3``;
SmolLM2-135M: 3 % of perturbed elements per step, both perturbations together). Saving the
chosen units would cost their full size (2x the weights for MeZO on a whole model). Instead
each perturbation checks, chunk by chunk, which elements would not
come back bit-exactly (comparing bit patterns, so -0.0 and NaN are handled) and saves only
those: int32 index + fp32 value, ~0.6 bytes per perturbed element instead of 4 (a chunk where
more than half would need saving is copied whole instead, so it never costs more than a copy).
The restore recomputes ``theta + d - d`` and patches the saved elements back: bit-identical,
always.

**Precision.** Arithmetic is fp32. fp32 weights are perturbed and updated in place. fp16/bf16
weights get an fp32 master copy of the block for the round (4 bytes/parameter of the block):
the model holds ``cast(master + eps z)`` during forwards and ``cast(master)`` otherwise, so
restore is exact by construction and small updates accumulate in the master (research/zo.md:
bf16 round trips destroy the update). Other dtypes are refused.

**Prefix reuse.** The layers below the block are frozen: their output is computed once per
batch and feeds both perturbed forwards; only the block and the layers above run twice. When
the units are layers, the prefix extends to the lowest *chosen* layer (the block's layers below
it are not perturbed this step either).

**Memory.** Besides the step cache or the saved elements, one reused workspace of five
2**20-element buffers (~17 MB). SmolLM2-135M, all 30 layers as one block, without the cache:
peak RSS 1.01-1.02x an inference forward for MeZO and LeZO alike; LeZO-0.25 with a cache that
holds it (256 MB): 1.2x.

**Seed log.** Every applied step is recorded (seed, units, fp32 ``g`` and ``lr``); the
:class:`~fedcybgd.protocol.zeroth_order.SeedLog` is returned as ``TrainOutcome.step_log`` (both
rules are declared with ``step_log=True``) and kept in ``rule.last_log``, and
``zeroth_order.replay`` rebuilds the trained block from it.

Options (``task.options``, run-config keys, declared in :mod:`fedcybgd.rules.builtin`):
``zo-eps`` (1e-3), ``lezo-density`` (0.25; ``mezo`` ignores it). Weight decay is the run's
``weight-decay``.

Example-level DP (``task.privacy``, ``dp = "example"``): the zeroth-order analogue of DP-SGD.
Each row of the Poisson-sampled batch is scored alone at ``+eps z`` and ``-eps z``; its
projected gradient ``(L+ - L-) / (2 eps)`` is clipped to ``[-dp-clip-norm, dp-clip-norm]``, the
clipped values are summed, Gaussian noise of ``dp-noise-multiplier x dp-clip-norm`` (from the
node's own generator) is added, and the sum is divided by the expected batch. The update is
that scalar times ``z``, so the step log, which holds the scalar, is the private release: the
server replays it exactly, and what it learns is what DP-SGD released.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from fedcybgd.core.checksum import content_checksum
from fedcybgd.data.prompts import Batch
from fedcybgd.model.layerwise import Hidden, LayerStack
from fedcybgd.protocol import seedlog, zeroth_order
from fedcybgd.rules import ExampleDp, TrainOutcome, TrainTask
from fedcybgd.rules.builtin import LezoOptions, MezoOptions
from fedcybgd.tasks.objective import batch_loss, scored_logits


@dataclass(frozen=True)
class ZoOptions:
    """The knobs of a zeroth-order round, fp32-rounded as the arithmetic uses them."""

    eps: float
    density: float
    weight_decay: float
    lr: float
    cache_bytes: int = 0

    @classmethod
    def from_task(cls, task: TrainTask, density: float | None) -> ZoOptions:
        """Read ``zo-eps`` and ``lezo-density`` (``density`` fixes the latter: MeZO)."""
        if density is None:
            lezo = LezoOptions.from_options(task.options)
            eps, density, cache_mb = lezo.eps, lezo.density, lezo.step_cache_mb
        else:
            mezo = MezoOptions.from_options(task.options)
            eps, cache_mb = mezo.eps, mezo.step_cache_mb
        wd = task.weight_decay
        if not (math.isfinite(wd) and wd >= 0):
            raise ValueError(f"weight-decay must be finite and >= 0, got {wd}")
        if not (math.isfinite(task.lr) and task.lr >= 0):
            raise ValueError(f"lr must be finite and >= 0, got {task.lr}")
        to32 = zeroth_order.to_f32
        return cls(to32(eps), density, to32(wd), to32(task.lr), int(cache_mb * 2**20))


def perturbed_loss(stack: LayerStack, batch: Batch, prefix: Hidden | None, start: int) -> float:
    """Task loss from layer ``start`` up, given the frozen prefix (``None``: embed too)."""
    hidden = prefix if prefix is not None else stack.embed(batch.input_ids, batch.attention_mask)
    hidden = stack.run(hidden, start, stack.num_layers)
    return float(batch_loss(scored_logits(stack, hidden.states, batch), batch))


def _block_checksum(task: TrainTask) -> str:
    """Content checksum of the live block (no copy: ``blocks.get`` would clone the block)."""
    params = dict(task.model.named_parameters())
    names = task.blocks.info(task.block).param_names
    return content_checksum({name: params[name] for name in names})


def _offenders(candidate: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat int32 positions where ``candidate``'s bits differ from ``exact``'s."""
    torch.ne(candidate.view(torch.int32), exact.view(torch.int32), out=mask)
    return mask.nonzero().view(-1).to(torch.int32)


class _Workspace:
    """Scratch buffers for one chunk, reused for every chunk of every pass.

    Fresh multi-MB temporaries per chunk let the C allocator grow the heap by fragmentation
    (measured on SmolLM2: MeZO's peak RSS 1.28x inference with them, 1.0x with reuse).
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.z = torch.empty(size, dtype=torch.float32)  # CPU: where z is generated
        self.d, self.a, self.b = (
            torch.empty(size, dtype=torch.float32, device=device) for _ in range(3)
        )
        self.mask = torch.empty(size, dtype=torch.bool, device=device)

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of ``d``, ``a``, ``b`` and ``mask`` of length ``n``."""
        return self.d[:n], self.a[:n], self.b[:n], self.mask[:n]


class _Slot:
    """One parameter tensor of the block and its perturbation state (see module docstring).

    Every method takes one chunk: its ``offset``, ``z`` (on the device) and the workspace;
    ``d = eps * z`` is computed into ``ws.d``.
    """

    def __init__(self, param: nn.Parameter) -> None:
        if param.dtype not in zeroth_order.SUPPORTED_DTYPES:
            raise ValueError(
                f"zeroth-order rules need fp32/fp16/bf16 weights, got {param.dtype}"
            )
        if not param.is_contiguous():
            raise ValueError("zeroth-order rules need contiguous parameters")
        self.param = param
        self.flat = param.data.view(-1)
        self.master = (
            None if param.dtype == torch.float32 else param.detach().reshape(-1).float().clone()
        )
        self.decay = zeroth_order.decays(param.shape)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.patched = 0  # elements restored from ``saved`` (a diagnostic)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def _save(
        self, offset: int, candidate: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """Keep what ``candidate`` gets wrong about ``exact``: sparse, or the whole chunk when
        more than half of it is wrong (8 bytes per saved element would exceed a copy)."""
        idx = _offenders(candidate, exact, mask)
        if 2 * idx.numel() > exact.numel():
            self.saved[offset] = (None, exact.clone())
        else:
            self.saved[offset] = (idx, exact[idx.long()])

    def _patch(self, offset: int, values: torch.Tensor) -> torch.Tensor:
        idx, exact = self.saved.pop(offset)
        if idx is None:
            values.copy_(exact)
            self.patched += values.numel()
        elif idx.numel():
            values[idx.long()] = exact
            self.patched += idx.numel()
        return values

    def _chunk(self, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        end = offset + n
        return self.flat[offset:end], None if self.master is None else self.master[offset:end]

    def plus(self, offset: int, z: torch.Tensor, eps: float, ws: _Workspace) -> None:
        """theta -> theta + d."""
        x, master = self._chunk(offset, z.numel())
        d, a, b, mask = ws.take(z.numel())
        torch.mul(z, eps, out=d)
        if master is not None:
            x.copy_(torch.add(master, d, out=a))
            return
        new = torch.add(x, d, out=a)
        self._save(offset, torch.sub(new, d, out=b), x, mask)
        x.copy_(new)

    def swap(self, offset: int, z: torch.Tensor, eps: float, ws: _Workspace) -> None:
        """theta + d -> theta - d (restoring theta exactly in between)."""
        x, master = self._chunk(offset, z.numel())
        d, a, b, mask = ws.take(z.numel())
        torch.mul(z, eps, out=d)
        if master is not None:
            x.copy_(torch.sub(master, d, out=a))
            return
        theta = self._patch(offset, torch.sub(x, d, out=a))
        new = torch.sub(theta, d, out=b)
        self._save(offset, torch.add(new, d, out=d), theta, mask)  # d is not needed after
        x.copy_(new)

    def unplus(self, offset: int, z: torch.Tensor, eps: float, ws: _Workspace) -> None:
        """theta + d -> theta (after a failure between the two forwards)."""
        x, master = self._chunk(offset, z.numel())
        d, a, _, _ = ws.take(z.numel())
        if master is not None:
            x.copy_(master)
            return
        torch.mul(z, eps, out=d)
        x.copy_(self._patch(offset, torch.sub(x, d, out=a)))

    def finish(self, offset: int, z: torch.Tensor, eps: float, ws: _Workspace,
               update: tuple[float, float, float] | None) -> None:
        """theta - d -> theta, then the update ``(g, lr, wd)`` if given."""
        x, master = self._chunk(offset, z.numel())
        d, a, b, _ = ws.take(z.numel())
        if master is not None:
            theta = master
        else:
            torch.mul(z, eps, out=d)
            theta = self._patch(offset, torch.add(x, d, out=a))
        if update is not None:
            g, lr, wd = update
            zeroth_order.apply_update(theta, z, g, lr, wd, self.decay, work=(b, d))
        x.copy_(theta)

    # The cached step: z drawn once (``begin``), the starting values of fp32 weights kept in
    # ``start``; every value written is the one the uncached methods above write.
    def plus_cached(self, offset: int, z: torch.Tensor, start: torch.Tensor | None,
                    eps: float, ws: _Workspace) -> None:
        """theta -> theta + d, theta kept in ``start``."""
        x, master = self._chunk(offset, z.numel())
        d, a, _, _ = ws.take(z.numel())
        torch.mul(z, eps, out=d)
        if master is not None:
            x.copy_(torch.add(master, d, out=a))
            return
        assert start is not None
        start.copy_(x)
        torch.add(start, d, out=x)

    def swap_cached(self, offset: int, z: torch.Tensor, start: torch.Tensor | None,
                    eps: float, ws: _Workspace) -> None:
        """-> theta - d."""
        x, master = self._chunk(offset, z.numel())
        d, a, _, _ = ws.take(z.numel())
        torch.mul(z, eps, out=d)
        if master is not None:
            x.copy_(torch.sub(master, d, out=a))
            return
        assert start is not None
        torch.sub(start, d, out=x)

    def unplus_cached(self, offset: int, z: torch.Tensor, start: torch.Tensor | None) -> None:
        """-> theta."""
        x, master = self._chunk(offset, z.numel())
        source = master if master is not None else start
        assert source is not None
        x.copy_(source)

    def finish_cached(self, offset: int, z: torch.Tensor, start: torch.Tensor | None,
                      ws: _Workspace, update: tuple[float, float, float] | None) -> None:
        """-> theta, then the update ``(g, lr, wd)`` if given."""
        x, master = self._chunk(offset, z.numel())
        theta = master if master is not None else start
        assert theta is not None
        if update is not None:
            d, _, b, _ = ws.take(z.numel())
            g, lr, wd = update
            zeroth_order.apply_update(theta, z, g, lr, wd, self.decay, work=(b, d))
        x.copy_(theta)


def _draw_units(draws: list[tuple[int, list[int], torch.Tensor]]) -> None:
    """Each unit's z (``(seed, numels, flat target)``) drawn into its target, units spread over
    torch's threads: each unit has its own generator, so the values do not depend on which
    thread draws which unit. A target off the CPU is drawn on the CPU and copied over."""

    def draw(job: tuple[int, list[int], torch.Tensor]) -> None:
        seed, numels, target = job
        if target.device.type == "cpu":
            zeroth_order.unit_z_into(seed, numels, target)
        else:
            target.copy_(zeroth_order.unit_z_into(seed, numels, torch.empty(target.numel())))

    workers = min(torch.get_num_threads(), len(draws))
    if workers <= 1:
        for job in draws:
            draw(job)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(draw, draws):  # re-raises a draw's error
            pass


class _Block:
    """The block's units and the chunked passes over the chosen ones."""

    def __init__(self, task: TrainTask) -> None:
        self.layout = zeroth_order.unit_layout(task.blocks, task.block)
        params = dict(task.model.named_parameters())
        self.units = [[_Slot(params[name]) for name in unit] for unit in self.layout]
        self.device = params[self.layout[0][0]].device
        info = task.blocks.info(task.block)
        # Units that are whole layers: their layer indices (the prefix can stop at a unit).
        self.unit_layers: list[int] | None = None
        if info.layers is not None and len(self.layout) > 1 and info.layers[0] != info.layers[1]:
            self.unit_layers = list(range(info.layers[0], info.layers[1] + 1))
        largest = max(slot.numel for unit in self.units for slot in unit)
        self.ws = _Workspace(min(zeroth_order.Z_CHUNK, largest), self.device)
        self.perturbed = 0
        # The step cache (see ``begin``): z and the fp32 weights' starting values of the chosen
        # units, flat buffers reused from step to step; ``cached`` is the step's chunk list.
        self._z = torch.empty(0, dtype=torch.float32, device=self.device)
        self._start = torch.empty(0, dtype=torch.float32, device=self.device)
        self.cached: list[tuple[_Slot, int, torch.Tensor, torch.Tensor | None]] | None = None
        self.cached_steps = 0  # steps whose z was drawn up front into the cache (a diagnostic)

    def begin(self, seed_of_step: int, chosen: tuple[int, ...], cache_bytes: int) -> None:
        """Draw the step's z once into the cache when it fits in ``cache_bytes`` with the
        starting values of the chosen fp32 tensors (then ``plus``/``swap``/``finish`` read z
        from it and restore by copy); otherwise the passes redraw z and save sparsely.
        Either way the weights come out bit-identical (same z, same ops, same order)."""
        slots = [slot for unit in chosen for slot in self.units[unit]]
        z_numel = sum(slot.numel for slot in slots)
        start_numel = sum(slot.numel for slot in slots if slot.master is None)
        if 4 * (z_numel + start_numel) > cache_bytes:
            self.cached = None
            return
        if self._z.numel() < z_numel:
            self._z = torch.empty(z_numel, dtype=torch.float32, device=self.device)
        if self._start.numel() < start_numel:
            self._start = torch.empty(start_numel, dtype=torch.float32, device=self.device)
        self.cached = []
        self.cached_steps += 1
        draws: list[tuple[int, list[int], torch.Tensor]] = []  # per unit: seed, numels, z
        at_z = at_start = 0
        for unit in chosen:
            unit_slots = self.units[unit]
            numels = [slot.numel for slot in unit_slots]
            draws.append((zeroth_order.unit_seed(seed_of_step, unit), numels,
                          self._z[at_z:at_z + sum(numels)]))
            for pos, offset, n in zeroth_order.z_spans(numels):
                start = None
                if unit_slots[pos].master is None:
                    start = self._start[at_start:at_start + n]
                    at_start += n
                self.cached.append((unit_slots[pos], offset, self._z[at_z:at_z + n], start))
                at_z += n
        _draw_units(draws)

    def _chunks(
        self, seed_of_step: int, chosen: tuple[int, ...]
    ) -> Iterator[tuple[_Slot, int, torch.Tensor]]:
        for unit in chosen:
            slots = self.units[unit]
            seed = zeroth_order.unit_seed(seed_of_step, unit)
            numels = [s.numel for s in slots]
            for pos, offset, z in zeroth_order.unit_z_chunks(seed, numels, out=self.ws.z):
                yield slots[pos], offset, z.to(self.device)

    def plus(self, seed_of_step: int, chosen: tuple[int, ...], eps: float) -> None:
        if self.cached is not None:
            for slot, offset, z, start in self.cached:
                slot.plus_cached(offset, z, start, eps, self.ws)
                self.perturbed += z.numel()
            return
        for slot, offset, z in self._chunks(seed_of_step, chosen):
            slot.plus(offset, z, eps, self.ws)
            self.perturbed += z.numel()

    def swap(self, seed_of_step: int, chosen: tuple[int, ...], eps: float) -> None:
        if self.cached is not None:
            for slot, offset, z, start in self.cached:
                slot.swap_cached(offset, z, start, eps, self.ws)
            return
        for slot, offset, z in self._chunks(seed_of_step, chosen):
            slot.swap(offset, z, eps, self.ws)

    def unplus(self, seed_of_step: int, chosen: tuple[int, ...], eps: float) -> None:
        if self.cached is not None:
            for slot, offset, z, start in self.cached:
                slot.unplus_cached(offset, z, start)
            return
        for slot, offset, z in self._chunks(seed_of_step, chosen):
            slot.unplus(offset, z, eps, self.ws)

    def finish(self, seed_of_step: int, chosen: tuple[int, ...], eps: float,
               update: tuple[float, float, float] | None) -> None:
        if self.cached is not None:
            for slot, offset, z, start in self.cached:
                slot.finish_cached(offset, z, start, self.ws, update)
            self.cached = None
            return
        for slot, offset, z in self._chunks(seed_of_step, chosen):
            slot.finish(offset, z, eps, self.ws, update)

    @property
    def patched(self) -> int:
        return sum(slot.patched for unit in self.units for slot in unit)


class ZerothOrder:
    """LeZO with a configurable density; see the module docstring."""

    name = "lezo"
    fixed_density: float | None = None  # MeZO: 1.0, whatever lezo-density says

    def __init__(self) -> None:
        self.last_log: zeroth_order.SeedLog | None = None
        self.last_times: dict[str, float] = {}  # the last round's seconds, z drawing apart
        self.last_cached_steps = 0  # the last round's steps that drew z up front
        self._generator: torch.Generator | None = None

    def train(self, task: TrainTask) -> TrainOutcome:
        """Run ``task.steps`` zeroth-order steps on ``task.block``; returns the step log in the
        outcome (and keeps it in ``last_log``)."""
        opts = ZoOptions.from_task(task, self.fixed_density)
        model = task.model
        block = _Block(task)
        count = zeroth_order.units_per_step(opts.density, len(block.layout))
        lowest = task.blocks.lowest_layer([task.block])
        began = time.perf_counter()
        base = _block_checksum(task)
        times = {"prefix_s": 0.0, "zo_forward_s": 0.0, "perturb_s": 0.0, "z_s": 0.0}
        times["seedlog_s"] = time.perf_counter() - began
        steps: list[zeroth_order.SeedStep] = []
        losses: list[float] = []
        examples = skipped = 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for step in range(task.steps):
                    batch = next(task.batches).to(block.device)
                    examples += len(batch)
                    seed = zeroth_order.step_seed(task.seed, step)
                    chosen = zeroth_order.choose_units(seed, len(block.layout), count)
                    record = self._step(task, block, opts, batch, lowest, seed, chosen, times)
                    if record is None:
                        skipped += 1
                        continue
                    steps.append(record[0])
                    losses.append(record[1])
        finally:
            model.train(was_training)
        began = time.perf_counter()
        self.last_log = zeroth_order.SeedLog(
            block=task.block,
            units=len(block.layout),
            layout=zeroth_order.layout_id(block.layout),
            eps=opts.eps,
            weight_decay=opts.weight_decay,
            torch=torch.__version__,
            z=zeroth_order.z_fingerprint(block.device),  # its arithmetic ran there
            steps=tuple(steps),
            base=base,
            result=_block_checksum(task),
        )
        encoded = seedlog.encode_seedlog(self.last_log)
        times["seedlog_s"] += time.perf_counter() - began
        mean = sum(losses) / len(losses) if losses else float("nan")
        # the reply's timings: drawing z for the step cache counts as perturbation; the split
        # is kept here for profiling (experiments/bench_updates.py)
        self.last_times = dict(times)
        self.last_cached_steps = block.cached_steps
        metrics = {key: value for key, value in times.items() if key != "z_s"}
        metrics["perturb_s"] += times["z_s"]
        metrics.update(
            units_per_step=float(count),
            units_total=float(len(block.layout)),
            restore_patch_frac=block.patched / max(block.perturbed, 1),
            seedlog_bytes=float(len(encoded)),
        )
        return TrainOutcome(mean, len(steps), examples, skipped, metrics,
                            step_log=self.last_log)

    def _step(
        self,
        task: TrainTask,
        block: _Block,
        opts: ZoOptions,
        batch: Batch,
        lowest: int,
        seed: int,
        chosen: tuple[int, ...],
        times: dict[str, float],
    ) -> tuple[zeroth_order.SeedStep, float] | None:
        """One step; ``None`` when skipped. The weights are restored whatever happens."""
        private = task.privacy
        # Under example-level DP each row is scored alone, so each row's projected gradient
        # can be clipped.
        start = max(lowest, 0) if block.unit_layers is None else block.unit_layers[chosen[0]]
        parts = [batch] if private is None else [batch.row(i) for i in range(len(batch))]
        measure = self._scorer(task, parts, start if lowest >= 0 else None, times)
        clock = time.perf_counter()
        block.begin(seed, chosen, opts.cache_bytes)
        times["z_s"] += time.perf_counter() - clock
        clock = time.perf_counter()
        block.plus(seed, chosen, opts.eps)
        times["perturb_s"] += time.perf_counter() - clock
        try:
            plus = measure()
        except BaseException:
            block.unplus(seed, chosen, opts.eps)
            raise
        clock = time.perf_counter()
        block.swap(seed, chosen, opts.eps)
        times["perturb_s"] += time.perf_counter() - clock
        update = None
        try:
            minus = measure()
            if private is None:
                loss = (plus[0] + minus[0]) / 2
                g = zeroth_order.to_f32((plus[0] - minus[0]) / (2 * opts.eps))
                if math.isfinite(plus[0]) and math.isfinite(minus[0]) and math.isfinite(g):
                    update = (g, opts.lr, opts.weight_decay)
            else:
                g, loss = private_projection(plus, minus, opts.eps, private, self._noise(private))
                update = (zeroth_order.to_f32(g), opts.lr, opts.weight_decay)
        finally:
            clock = time.perf_counter()
            block.finish(seed, chosen, opts.eps, update)
            times["perturb_s"] += time.perf_counter() - clock
        if update is None:
            return None
        return zeroth_order.SeedStep(seed, chosen, update[0], opts.lr), loss

    def _scorer(self, task: TrainTask, parts: list[Batch], start: int | None,
                times: dict[str, float]) -> Callable[[], list[float]]:
        """The step's loss of each of ``parts`` at the block's weights as they are when called
        (perturbed in place). Everything below layer ``start`` (``None``: the embedding too)
        is the same in both forwards: run once here, reused by both."""
        stack = task.stack
        clock = time.perf_counter()
        prefixes = [None if start is None else
                    stack.run(stack.embed(b.input_ids, b.attention_mask), 0, start)
                    for b in parts]
        times["prefix_s"] += time.perf_counter() - clock
        first = 0 if start is None else start

        def measure() -> list[float]:
            clock = time.perf_counter()
            out = [perturbed_loss(stack, b, p, first) for b, p in zip(parts, prefixes,
                                                                      strict=True)]
            times["zo_forward_s"] += time.perf_counter() - clock
            return out

        return measure

    def _noise(self, privacy: ExampleDp) -> torch.Generator:
        """The node's own generator of the steps' noise (seeded once per round)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(privacy.seed)
        return self._generator


def private_projection(plus: list[float], minus: list[float], eps: float, privacy: ExampleDp,
                       generator: torch.Generator) -> tuple[float, float]:
    """The zeroth-order analogue of DP-SGD: each row's projected gradient
    ``(L+ - L-) / (2 eps)`` clipped to ``[-clip, clip]`` (a row whose losses are not finite
    gives 0), summed, plus Gaussian noise of ``noise_multiplier x clip``, divided by the
    expected batch. Returns that scalar (what the step log releases) and the mean loss of the
    finite rows (NaN when none)."""
    total, losses = 0.0, []
    for lp, lm in zip(plus, minus, strict=True):
        g = (lp - lm) / (2 * eps)
        if math.isfinite(lp) and math.isfinite(lm) and math.isfinite(g):
            total += max(-privacy.clip, min(privacy.clip, g))
            losses.append((lp + lm) / 2)
    noise = float(torch.randn((), generator=generator, dtype=torch.float64))
    total += noise * privacy.noise_multiplier * privacy.clip
    loss = sum(losses) / len(losses) if losses else math.nan
    return total / privacy.expected_batch, loss


class LeZO(ZerothOrder):
    """LeZO: ``lezo-density`` of the block's units perturbed and updated per step."""

    name = "lezo"


class MeZO(ZerothOrder):
    """MeZO: every unit of the block perturbed and updated every step."""

    name = "mezo"
    fixed_density = 1.0
