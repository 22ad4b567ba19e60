"""Frozen blocks in low precision: ``frozen-dtype`` (fp32, bf16, fp16) and ``frozen-quant`` (int8).

A client trains one block; the others only run forward (and, for ``fo``, carry gradients through
to the block). :class:`FrozenBlocks` holds those in a compact form and switches a block between
its *frozen* form and its *trainable* fp32 form, always from exact fp32 tensors handed in by the
caller (the client's durable cache or the pretrained files): a bf16 or int8 copy is never cast
back up and trained from.

Frozen forms:

* ``frozen-dtype`` bf16/fp16: the block's parameters are cast in place (the ``nn.Parameter``
  objects stay, so ties and references hold). Each module owning such parameters gets hooks that
  cast its floating inputs to its dtype and its floating outputs back to fp32: between modules the
  hidden states stay fp32, so attention masks, rotary tables and the trained block see fp32 as in
  the model's own forward, and only the frozen matmuls and norms compute in low precision.
* ``frozen-quant = "int8"``: the weight of every plain ``nn.Linear`` and ``nn.Embedding`` of the
  block (exact type: subclasses such as Gemma's scaled embedding do more in their forward) is
  quantized symmetrically per output channel (per row: the same rows serve a tied embedding as
  lookup table and LM head) to int8 with an fp32 scale; the ``weight`` parameter is removed and
  the module's forward replaced by one that dequantizes at most :data:`DEQUANT_CHUNK` weight
  elements at a time into the compute dtype (``frozen-dtype``) and returns fp32. Everything else
  in the block (norms, biases, other module types) takes ``frozen-dtype``. Why our own and not a
  library: torch's own int8 weight-only CPU kernel (``aten._weight_int8pack_mm``, what torchao
  calls on CPU) crashes the process on bf16 inputs whose width is not a multiple of 32 (torch
  2.13), and a library's quantized tensor subclasses would need special cases in every place
  that copies, checksums or encodes block tensors; the dequantize-and-matmul here runs on every
  device.

The int8 tensors are kept by this object, not registered as module buffers, so ``model.to``
does not split a tied pair into two copies: :meth:`FrozenBlocks.place` moves them.

No client imports: the server's evaluator uses the same class (``eval-precision = "frozen"``).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from fedcybgd.core.measure import fix_mmap_threshold
from fedcybgd.model.blocks import BlockMap

FROZEN_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
DEQUANT_CHUNK = 1 << 20  # weight elements dequantized at once (4 MB as fp32)


@dataclass(frozen=True)
class Precision:
    """How frozen blocks are held: ``dtype`` (a :data:`FROZEN_DTYPES` key) and ``quant``."""

    dtype: str = "float32"
    quant: str = "none"  # or "int8"

    def __post_init__(self) -> None:
        if self.dtype not in FROZEN_DTYPES:
            raise ValueError(f"frozen-dtype = {self.dtype!r}; choose one of {list(FROZEN_DTYPES)}")
        if self.quant not in ("none", "int8"):
            raise ValueError(f"frozen-quant = {self.quant!r}; choose 'none' or 'int8'")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute and storage dtype of frozen tensors that are not quantized."""
        return FROZEN_DTYPES[self.dtype]

    @property
    def full(self) -> bool:
        """Frozen blocks are plain fp32: nothing to convert."""
        return self.dtype == "float32" and self.quant == "none"

    def describe(self) -> str:
        """E.g. ``bfloat16+int8``."""
        return self.dtype if self.quant == "none" else f"{self.dtype}+{self.quant}"


def compute_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """The dtype frozen Linear layers compute in: fp32 on a CPU (where bf16 matmuls run 6x
    slower than fp32 without native bf16 units: measured on this project's 2-core machine),
    ``frozen-dtype`` on an accelerator. Storage stays ``frozen-dtype``/int8 either way; one
    weight chunk at a time is converted."""
    return torch.float32 if device.type == "cpu" else precision.torch_dtype


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight ~= q * scale[:, None]`` with ``|q| <= 127``.

    A row of zeros gets scale 1 (its q is 0), so dequantizing never divides by zero.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                    ) -> torch.Tensor:
    """``q * scale[:, None]`` in ``dtype`` (``scale`` ``None``: ``q`` is a bf16/fp16 weight)."""
    if scale is None:
        return q.to(dtype)
    return (q.to(dtype) * scale.to(dtype)[:, None])


def _row_chunks(q: torch.Tensor) -> Iterator[slice]:
    rows = max(1, DEQUANT_CHUNK // max(q.shape[1], 1))
    for start in range(0, q.shape[0], rows):
        yield slice(start, min(start + rows, q.shape[0]))


class _Workspace(threading.local):
    """One dequantize buffer per (device, dtype), reused by every chunk of every frozen layer.

    A fresh multi-MB weight chunk per Linear per forward (and a second one for the int8 -> float
    cast before scaling) made glibc raise its dynamic mmap threshold and then grow the heap by
    fragmentation: SmolLM2-135M inference with int8 frozen blocks peaked 140-190 MB above the
    loaded model, against 17 MB in fp32 (measured by RSS sampling; ``malloc_trim`` after a
    step gave it all back, so it was freed heap, not live tensors). With this buffer and a
    fixed mmap threshold (:func:`fedcybgd.core.measure.fix_mmap_threshold`) the transient is
    this buffer plus the layer outputs. Thread-local: loopback tests run clients in threads.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
        """A ``rows x cols`` view of the buffer for ``(device, dtype)``, grown if needed."""
        key = (device, dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < rows * cols:
            self.buffers.pop(key, None)  # free the old one before allocating the larger
            buffer = self.buffers[key] = torch.empty(
                max(rows * cols, min(DEQUANT_CHUNK, 1 << 20)), dtype=dtype, device=device)
        return buffer[: rows * cols].view(rows, cols)


_WORKSPACE = _Workspace()


def _dequantize_chunk(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                      ) -> torch.Tensor:
    """:func:`dequantize_rows` into the shared workspace (valid until the next chunk): the
    int8 (or bf16) rows are converted and scaled in one pass, with no temporary."""
    out = _WORKSPACE.take(q.shape[0], q.shape[1], dtype, q.device)
    if scale is None:
        return out.copy_(q)
    return torch.mul(q, scale[:, None], out=out)


def _rows(scale: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if scale is None else scale[rows]


class _Int8Linear(torch.autograd.Function):
    """``x @ (q * scale).T`` with the weight dequantized chunk by chunk; grad for ``x`` only.

    Also a bf16/fp16 weight computed in fp32 (``scale`` ``None``). Backward dequantizes again
    rather than letting autograd keep an fp32 copy of every weight for ``fo``. Each chunk goes
    into the thread's one workspace buffer (:class:`_Workspace`), consumed before the next.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None
                ) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        outs = [F.linear(x, _dequantize_chunk(q[rows], _rows(scale, rows), x.dtype))
                for rows in _row_chunks(q)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (grad,) = grads
        q, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        total: torch.Tensor | None = None
        for rows in _row_chunks(q):
            weight = _dequantize_chunk(q[rows], _rows(scale, rows), grad.dtype)
            part = grad[..., rows] @ weight
            total = part if total is None else total.add_(part)
        return total, None, None


@dataclass
class _Quantized:
    """A quantized weight shared by the modules that held it (a tied embedding and head)."""

    q: torch.Tensor
    scale: torch.Tensor
    modules: list[nn.Module] = field(default_factory=list)


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state: _Quantized | None = module.__dict__.get("_fc_int8")
    dtype: torch.dtype = module.__dict__["_fc_dtype"]
    if state is None:  # a bf16/fp16 weight, computed in ``dtype``
        out = _Int8Linear.apply(x.to(dtype), module.weight, None)
    else:
        out = _Int8Linear.apply(x.to(dtype), state.q, state.scale)
    if module.bias is not None:
        out = out + module.bias.to(dtype)
    return out.float()


def _embedding_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    state: _Quantized = module.__dict__["_fc_int8"]
    # Only the looked-up rows are dequantized; fp32 as the hidden stream is.
    return state.q[ids].float() * state.scale[ids].unsqueeze(-1)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    return value


def _cast_hooks(module: nn.Module, dtype: torch.dtype) -> list[RemovableHandle]:
    """Inputs of ``module`` to ``dtype``, its outputs back to fp32 (module docstring)."""

    def before(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _cast_floats(args, dtype), {k: _cast_floats(v, dtype) for k, v in kwargs.items()}

    def after(_m: nn.Module, _args: Any, out: Any) -> Any:
        return _cast_floats(out, torch.float32)

    return [module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after)]


def int8_weights(model: nn.Module, blocks: BlockMap) -> dict[str, tuple[int, int]]:
    """Per block, ``(elements, rows)`` of the weights ``frozen-quant = "int8"`` quantizes (the
    rule of :class:`FrozenBlocks`: plain ``nn.Linear``/``nn.Embedding`` weights, a tied one
    only when every module holding it is such), for the memory model."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    held: dict[str, list[bool]] = {}
    rows: dict[str, tuple[int, int]] = {}
    for module in model.modules():
        for local, param in module._parameters.items():
            if param is None or id(param) not in canonical:
                continue
            name = canonical[id(param)]
            held.setdefault(name, []).append(
                local == "weight" and type(module) in (nn.Linear, nn.Embedding))
            rows[name] = (param.numel(), int(param.shape[0]) if param.dim() == 2 else 0)
    out = dict.fromkeys(blocks.names, (0, 0))
    for name, ok in held.items():
        if all(ok):
            block = blocks.block_of(name)
            elements, count = out[block]
            out[block] = (elements + rows[name][0], count + rows[name][1])
    return out


class FrozenBlocks:
    """Switch blocks of ``model`` between their frozen form and trainable fp32.

    Parameters
    ----------
    model : nn.Module
        The model, with every block in fp32 when this object is made.
    blocks : BlockMap
        Its block partition.
    precision : Precision
        The frozen form.

    Notes
    -----
    Blocks start in fp32 (trainable form); :meth:`freeze` converts one. Every conversion takes
    the block's exact fp32 tensors, so going fp32 -> frozen -> fp32 never loses anything.
    """

    def __init__(self, model: nn.Module, blocks: BlockMap, precision: Precision,
                 device: torch.device | str | None = None) -> None:
        self.model, self.blocks, self.precision = model, blocks, precision
        self.device = next(iter(model.parameters())).device
        if not precision.full:
            fix_mmap_threshold()  # see _Workspace: the per-forward chunks fragment the heap
        self.compute = compute_dtype(precision, torch.device(device) if device else self.device)
        canonical = {id(p): name for name, p in model.named_parameters()}
        # block -> [(module, its attribute name, the canonical parameter name)]
        self._owned: dict[str, list[tuple[nn.Module, str, str]]] = {b: [] for b in blocks.names}
        for module in model.modules():
            for local, param in module._parameters.items():
                if param is None or id(param) not in canonical:
                    continue
                name = canonical[id(param)]
                self._owned[blocks.block_of(name)].append((module, local, name))
        holders: dict[str, list[tuple[nn.Module, str]]] = {}
        for entries in self._owned.values():
            for module, local, name in entries:
                holders.setdefault(name, []).append((module, local))
        # A weight is quantized only if every module holding it can run int8 (a tied pair of a
        # plain embedding and a plain head), so a tie is never split between forms.
        self._int8_names = {
            name for name, held in holders.items()
            if precision.quant == "int8"
            and all(local == "weight" and type(m) in (nn.Linear, nn.Embedding) for m, local in held)
        }
        self._frozen: set[str] = set()
        self._hooks: dict[str, list[RemovableHandle]] = {}
        self._quantized: dict[str, _Quantized] = {}  # canonical weight name -> int8 state

    def is_frozen(self, block: str) -> bool:
        """Whether ``block`` is in its frozen form."""
        return block in self._frozen

    def freeze(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put ``block`` in its frozen form, built from its exact fp32 ``tensors``."""
        self._check(block, tensors)
        if block in self._frozen:
            self.thaw(block, tensors)  # a new version of a frozen block: rebuild from exact
        dtype = self.precision.torch_dtype
        hooked: list[RemovableHandle] = []
        for module, local, name in self._owned[block]:
            source = tensors[name]
            if name in self._int8_names:
                state = self._quantized.get(name)
                if state is None:
                    q, scale = quantize_rows(source.to(self.device))
                    state = self._quantized[name] = _Quantized(q, scale)
                del module._parameters[local]
                # Plain attributes (not buffers: module docstring); the forward reads them.
                module.__dict__["_fc_int8"] = state
                module.__dict__["_fc_dtype"] = self.compute
                forward = _linear_forward if isinstance(module, nn.Linear) else _embedding_forward
                module.__dict__["forward"] = types.MethodType(forward, module)
                state.modules.append(module)
                continue
            param = module._parameters[local]
            assert param is not None
            param.data = source.detach().to(self.device, dtype, copy=True)
        if dtype != torch.float32:
            for module in {id(m): m for m, _, _ in self._owned[block]}.values():
                if "_fc_dtype" in module.__dict__:
                    continue
                if type(module) is nn.Linear:
                    # the low-precision weight computes in ``compute`` chunk by chunk
                    module.__dict__["_fc_dtype"] = self.compute
                    module.__dict__["forward"] = types.MethodType(_linear_forward, module)
                else:
                    hooked.extend(_cast_hooks(module, dtype))
        self._hooks[block] = hooked
        self._frozen.add(block)

    def thaw(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put ``block`` back as fp32 parameters, from its exact fp32 ``tensors``."""
        self._check(block, tensors)
        for handle in self._hooks.pop(block, []):
            handle.remove()
        fresh: dict[str, nn.Parameter] = {}
        for module, local, name in self._owned[block]:
            value = tensors[name].detach().to(self.device, torch.float32, copy=True)
            if "_fc_dtype" in module.__dict__ and "_fc_int8" not in module.__dict__:
                for attr in ("_fc_dtype", "forward"):  # a bf16 Linear: the class's again
                    module.__dict__.pop(attr)
            if "_fc_int8" in module.__dict__ and local == "weight":
                self._quantized.pop(name, None)
                for attr in ("_fc_int8", "_fc_dtype", "forward"):  # forward: the class's again
                    module.__dict__.pop(attr)
                if name not in fresh:  # one Parameter for a tied pair, as the model had
                    fresh[name] = nn.Parameter(value, requires_grad=False)
                module._parameters[local] = fresh[name]
                continue
            param = module._parameters[local]
            assert param is not None
            param.data = value
        self._frozen.discard(block)

    def place(self, device: torch.device) -> None:
        """Move the model and the int8 weights to ``device`` (ties kept)."""
        self.model.to(device)
        for state in self._quantized.values():
            state.q, state.scale = state.q.to(device), state.scale.to(device)
        self.device = device
        self.compute = compute_dtype(self.precision, device)
        for module in self.model.modules():
            if "_fc_dtype" in module.__dict__:
                module.__dict__["_fc_dtype"] = self.compute

    def _check(self, block: str, tensors: Mapping[str, torch.Tensor]) -> None:
        want = set(self.blocks.info(block).param_names)
        if set(tensors) != want:
            raise ValueError(f"block '{block}': tensors {sorted(set(tensors) ^ want)[:5]} do "
                             "not match its parameters")
        for name, t in tensors.items():
            if t.dtype != torch.float32:
                # the whole point: a frozen copy is never the source of a trainable one
                raise ValueError(f"block '{block}': tensor '{name}' is {t.dtype}; frozen and "
                                 "trainable forms are built from exact fp32 tensors only")

    def resident_bytes(self) -> int:
        """Bytes the model's weights take now (parameters plus int8 weights and scales)."""
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        for state in self._quantized.values():
            total += state.q.numel() + state.scale.numel() * state.scale.element_size()
        return total
