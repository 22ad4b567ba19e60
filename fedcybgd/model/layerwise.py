"""Run a causal LM piece by piece: embeddings, any range of decoder layers, final norm + head.

Block-wise training needs to stop at a layer (ZeroLock never runs the layers above its block),
start at a layer (a cached prefix is reused across steps), and apply the LM head only where a
loss is taken (vocabulary-sized logits for every token would dwarf a block's memory).

What each decoder layer receives besides its hidden states (attention masks, rotary position
embeddings, position ids, ...) is not the same for every layer: families that alternate
sliding-window and full attention (Gemma2/3, Cohere2, GPT-OSS, Qwen2 with sliding layers) give
each layer the mask of its attention type, and Gemma3 also the rotary embeddings of its type
(local and global bases). So :meth:`LayerStack.embed` runs the model's own forward once per batch
with every decoder layer swapped for a stub that records its call and passes its input through;
the model builds masks and rotary tables before its layer loop, so this costs the embeddings,
the masks and the rotary tables, no layer. :meth:`LayerStack.run` then calls each real layer with
its own recorded inputs.

That replay is exact only if the model's layer loop does nothing but chain its layers, and the
tail (final norm, output projection, LM head, logit scaling or softcapping) is known here.
:class:`LayerStack` checks both when it is built: it runs a short padded probe through the
model's own forward and piece by piece, and refuses the model (``UnsupportedModelError`` naming
the family) unless the logits agree. ``tests/model/test_layerwise.py`` checks the families one
by one with padding and with sequences longer than the sliding window.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from fedcybgd.model.blocks import UnsupportedModelError, base_model, family_name, find_layers

_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm")

# The probe's logits must agree with the model's own to this fraction of their largest value.
# Both sides run the same kernels on the same tensors in the same order, so in practice they
# agree bit for bit; the slack only covers a kernel choosing another path for another shape.
PROBE_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
PROBE_RTOL_LOW_PRECISION = 2e-2
_PROBE_LENGTH = 6
_PROBE_LEFT_PAD = 2


class _StopForward(Exception):
    """Raised by the last layer's stub: nothing after the layer loop is needed."""


@dataclass
class Hidden:
    """Hidden states between two layers, plus what each decoder layer receives besides them.

    ``args[i]`` and ``kwargs[i]`` are the extra positional and keyword inputs of decoder layer
    ``i`` exactly as the model's own forward passes them (masks by attention type, rotary
    embeddings, position ids, ...). ``Hidden(states, (), {})`` carries none: it can be a
    placeholder, but :meth:`LayerStack.run` refuses to run a layer on it.
    """

    states: torch.Tensor
    args: Sequence[tuple[Any, ...]]
    kwargs: Mapping[int, Mapping[str, Any]]

    def with_states(self, states: torch.Tensor) -> Hidden:
        """Same extra inputs, new hidden states."""
        return Hidden(states, self.args, self.kwargs)

    def detach(self) -> Hidden:
        """Detach the hidden states (the extra inputs never carry grad)."""
        return self.with_states(self.states.detach())


class _LayerStub(nn.Module):
    """Stands in for decoder layer ``index`` while :meth:`LayerStack.embed` records its inputs.

    Attribute reads the model's loop makes on the layer (e.g. ``decoder_layer.attention_type``)
    fall through to the real layer. The real layer's own hooks do not fire: nothing ran.
    """

    def __init__(self, real: nn.Module, index: int, last: bool, arity: int | None,
                 sink: dict[int, tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)  # plain attribute: not a registered submodule
        self._index = index
        self._last = last
        self._arity = arity
        self._sink = sink
        self.train(real.training)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not args:
            raise UnsupportedModelError(
                f"decoder layer {self._index} was called without positional hidden states; "
                f"cannot replay it (keywords: {sorted(kwargs)})"
            )
        if self._index in self._sink:
            raise UnsupportedModelError(f"decoder layer {self._index} is called more than once")
        self._sink[self._index] = (args, kwargs)
        if self._last:
            raise _StopForward
        # Pass the input on in the shape the real layer returns, so the loop goes on.
        if self._arity is None:
            return args[0]
        return (args[0],) + (None,) * (self._arity - 1)


class _LogitHead(nn.Module):
    """The LM head followed by the model's own logit scaling and/or tanh softcapping.

    Gemma2/3 and RecurrentGemma softcap (``tanh(z / c) * c``), Cohere multiplies by
    ``logit_scale`` and Falcon-H1 by ``lm_head_multiplier``, Granite divides by
    ``logits_scaling``: all after the head's matmul. ``weight``/``bias`` expose the wrapped
    head's, so a caller reading the tied weight still finds it.
    """

    def __init__(self, head: nn.Module, scale: float, softcap: float | None) -> None:
        super().__init__()
        self.head = head
        self.scale = scale
        self.softcap = softcap

    @property
    def weight(self) -> Any:
        return getattr(self.head, "weight", None)

    @property
    def bias(self) -> Any:
        return getattr(self.head, "bias", None)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.transform(self.head(states))

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The scaling and softcapping alone, on the head's raw output."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(frozen=True)
class _Probed:
    """What the probe learned about a model (cached per model object)."""

    arity: int | None  # the layers return a tensor (None) or a tuple of this length
    tail: tuple[str, ...]  # modules of the base model run after the last layer, in order


# Models that passed the probe, with what it learned. The probe runs the real layers, so their
# hooks fire; a second stack on the same model object (a rule building its own) neither pays
# for it again nor shows up in a caller's layer hooks. What the probe learns is a property of
# the architecture (the modules and their order, the config, the dtype), not of the weights, so
# a model loaded again in the same process (a pipeline stage's every message) is not probed
# again either.
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, _Probed] = weakref.WeakKeyDictionary()
_VERIFIED_ARCHITECTURES: dict[tuple[Any, ...], _Probed] = {}
_ARCHITECTURES_KEPT = 16


def _architecture(model: nn.Module) -> tuple[Any, ...]:
    """What the probe's outcome depends on: the model's class, config, parameter dtype and
    every module's name and class in order."""
    config: Any = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    described = to_json(use_diff=False) if callable(to_json) else repr(config)
    dtype = next((p.dtype for p in model.parameters()), None)
    modules = tuple((name, type(m).__qualname__) for name, m in model.named_modules())
    return (type(model).__qualname__, described, str(dtype), modules)


class LayerStack:
    """Piecewise access to a Hugging Face decoder-only causal LM.

    Parameters
    ----------
    model : PreTrainedModel
        A decoder-only causal LM whose decoder layers are one ``nn.ModuleList`` (Llama, Qwen2/3,
        Mistral, Gemma2/3, Phi3, GPT-2, OPT, GPT-NeoX, Cohere2, ...).
    verify : bool
        Run the probe (module docstring) and refuse the model unless the pieces chained
        together give the model's own logits; once per model object and process. Only tests
        that build a deliberately broken stack turn it off.

    Raises
    ------
    UnsupportedModelError
        The model is not a decoder-only LM with a layer list, or its piecewise logits differ
        from its own (the message names the family and the gap).

    Notes
    -----
    :meth:`embed` swaps the decoder layers for stubs during the model's forward: a stack is
    not safe to use from two threads at once on one model.
    """

    def __init__(self, model: PreTrainedModel, verify: bool = True) -> None:
        self.model = model
        self.family = family_name(model)
        self.base: nn.Module = base_model(model)
        _, self.layers = find_layers(model)
        self.head: nn.Module = self._build_head()
        probed = _VERIFIED.get(model)
        if probed is None and verify:
            architecture = _architecture(model)
            probed = _VERIFIED_ARCHITECTURES.get(architecture)
            if probed is None:
                probed = self.verify()
                if len(_VERIFIED_ARCHITECTURES) >= _ARCHITECTURES_KEPT:
                    _VERIFIED_ARCHITECTURES.pop(next(iter(_VERIFIED_ARCHITECTURES)))
                _VERIFIED_ARCHITECTURES[architecture] = probed
            _VERIFIED[model] = probed
        if probed is not None:
            self._arity = probed.arity
            self.tail = tuple(self.base.get_submodule(name) for name in probed.tail)
        else:
            self._arity = None  # every transformers 5 layer returns a tensor
            self.tail = self._tail_by_name()

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layers)

    @property
    def norm(self) -> nn.Module:
        """The final norm: the first module of the tail with a 1-D weight (else an identity)."""
        for module in self.tail:
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 1:
                return module
        return nn.Identity()

    def _tail_by_name(self) -> tuple[nn.Module, ...]:
        """The tail guessed from module names, for a stack built without the probe."""
        tail: list[nn.Module] = []
        for owner in (self.base, getattr(self.base, "decoder", None)):
            if not isinstance(owner, nn.Module):
                continue
            for name in _FINAL_NORM_NAMES:
                module = getattr(owner, name, None)
                if isinstance(module, nn.Module):
                    tail.append(module)
                    break
            project_out = getattr(owner, "project_out", None)
            if isinstance(project_out, nn.Module):
                tail.append(project_out)
        return tuple(tail)

    def _build_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise UnsupportedModelError(f"{self.family} has no output embeddings (LM head)")
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        # What families do to the head's output, by the field they keep it in; the probe
        # refuses a family that does something else.
        scale = 1.0
        model_scale = getattr(self.model, "logit_scale", None)  # Cohere, Cohere2
        if isinstance(model_scale, (int, float)):
            scale *= float(model_scale)
        multiplier = getattr(text, "lm_head_multiplier", None)  # Falcon-H1
        if isinstance(multiplier, (int, float)):
            scale *= float(multiplier)
        divisor = getattr(text, "logits_scaling", None)  # Granite
        if isinstance(divisor, (int, float)):
            scale /= float(divisor)
        softcap = getattr(text, "final_logit_softcapping", None)  # Gemma2, Gemma3
        if softcap is None:
            softcap = getattr(text, "logits_soft_cap", None)  # RecurrentGemma
        if scale == 1.0 and softcap is None:
            return head
        return _LogitHead(head, scale, float(softcap) if softcap is not None else None)

    @contextlib.contextmanager
    def _stubbed(
        self, sink: dict[int, tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> Iterator[None]:
        """Swap every decoder layer for a recording stub; put the real ones back after."""
        modules = self.layers._modules
        real = dict(modules)
        keys = list(real)
        try:
            for index, key in enumerate(keys):
                layer = real[key]
                assert layer is not None
                modules[key] = _LayerStub(layer, index, index == len(keys) - 1, self._arity, sink)
            yield
        finally:
            modules.update(real)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Hidden:
        """Embeddings of a batch plus each decoder layer's own extra inputs.

        Runs the model's forward with stubbed layers (module docstring): whatever the model
        does before its first layer (embedding scale, learned positions, input projection,
        dropout) happens here, with grad if grad is enabled.
        """
        sink: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        with self._stubbed(sink):
            try:
                self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            else:
                raise UnsupportedModelError(
                    f"{self.family}: the forward returned before its last decoder layer ran"
                )
        missing = [i for i in range(self.num_layers) if i not in sink]
        if missing:
            raise UnsupportedModelError(f"{self.family}: decoder layers {missing} never ran")
        states = sink[0][0][0]
        args = tuple(sink[i][0][1:] for i in range(self.num_layers))
        kwargs = {i: sink[i][1] for i in range(self.num_layers)}
        return Hidden(states, args, kwargs)

    def run(self, hidden: Hidden, start: int, end: int) -> Hidden:
        """Apply decoder layers ``start`` to ``end - 1`` (Python slice semantics)."""
        states = hidden.states
        for index in range(*slice(start, end).indices(self.num_layers)):
            if index >= len(hidden.args) or index not in hidden.kwargs:
                raise ValueError(f"no inputs recorded for decoder layer {index}: use embed()")
            out = self.layers[index](states, *hidden.args[index], **hidden.kwargs[index])
            states = out[0] if isinstance(out, tuple) else out
        return hidden.with_states(states)

    def final_hidden(self, states: torch.Tensor) -> torch.Tensor:
        """The tail (final norm, and e.g. OPT's output projection) on the last layer's output."""
        for module in self.tail:
            states = module(states)
        return states

    def head_logits(
        self, rows: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The LM head, with the family's logit scaling/softcapping, on final hidden rows.

        ``weight`` replaces the head's weight (a frozen copy of a tied head while its tensor
        is being trained); that needs a linear head.
        """
        if weight is None:
            return self.head(rows)
        raw = self.head.head if isinstance(self.head, _LogitHead) else self.head
        if not isinstance(raw, nn.Linear):
            raise ValueError(f"a replacement head weight needs an nn.Linear head, got {type(raw)}")
        logits = F.linear(rows, weight, raw.bias)
        return self.head.transform(logits) if isinstance(self.head, _LogitHead) else logits

    def logits_at(self, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LM-head logits at one position per row: ``[B, T, H]`` and ``[B]`` -> ``[B, V]``.

        Only the gathered rows go through the norm and the head, so memory stays ``B x V``.
        """
        rows = states[torch.arange(states.shape[0], device=states.device), positions]
        return self.head(self.final_hidden(rows))

    def forward_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The whole model, piece by piece, returning logits at ``positions``."""
        hidden = self.run(self.embed(input_ids, attention_mask), 0, self.num_layers)
        return self.logits_at(hidden.states, positions)

    def all_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Piecewise logits at every position, ``[B, T, V]`` (checks and small batches)."""
        hidden = self.run(self.embed(input_ids, attention_mask), 0, self.num_layers)
        return self.head(self.final_hidden(hidden.states))

    def verify(self) -> _Probed:
        """Check on a short padded probe that the pieces give the model's own logits.

        The model's own forward runs once with hooks that record the order of the decoder
        layers, how they return, and which modules of the base model run after the last one
        (the tail: final norm, output projection); then the pieces run. Eval mode, no grad;
        the model's mode and the RNG are left as they were.

        Raises
        ------
        UnsupportedModelError
            The layers are not each called once in order, or the logits differ.
        """
        ids, mask = self._probe_batch()
        events: list[tuple[str, Any]] = []
        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_hook(
                lambda _m, _a, out, i=index: events.append(("layer", (i, out)))))
        layers_path, containers = _layer_path(self.base, self.layers)
        for name, module in self.base.named_modules():
            if name in containers or name.startswith(layers_path + "."):
                continue  # the layers, what they contain, and the modules that contain them
            handles.append(module.register_forward_pre_hook(
                lambda _m, _a, name=name: events.append(("module", name))))
        modes = [(module, module.training) for module in self.model.modules()]
        try:
            self.model.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                try:
                    expected = self.model(
                        input_ids=ids, attention_mask=mask, use_cache=False
                    ).logits
                finally:
                    for handle in handles:
                        handle.remove()
                probed = self._read_events(events)
                self._arity = probed.arity
                self.tail = tuple(self.base.get_submodule(name) for name in probed.tail)
                try:
                    got = self.all_logits(ids, mask)
                except UnsupportedModelError:
                    raise
                except Exception as err:
                    raise UnsupportedModelError(
                        f"{self.family}: cannot run it layer by layer ({type(err).__name__}: "
                        f"{err})"
                    ) from err
        finally:
            for module, training in modes:
                module.training = training
        self._compare(got, expected, mask)
        return probed

    def _probe_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two rows of probe tokens, the second left-padded (the masks' padding path runs)."""
        first = next(iter(self.model.parameters()))
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 2)
        ids = torch.arange(2 * _PROBE_LENGTH, device=first.device).view(2, _PROBE_LENGTH)
        ids = (ids * 7 + 3) % vocab
        mask = torch.ones_like(ids)
        mask[1, :_PROBE_LEFT_PAD] = 0
        return ids, mask

    def _read_events(self, events: list[tuple[str, Any]]) -> _Probed:
        """Layer order, layer output shape and tail from the probe's hook events."""
        order = [payload[0] for kind, payload in events if kind == "layer"]
        if order != list(range(self.num_layers)):
            raise UnsupportedModelError(
                f"{self.family}: its forward calls the decoder layers in the order {order}, "
                "not each once bottom-up; cannot run it layer by layer"
            )
        last = max(i for i, (kind, _) in enumerate(events) if kind == "layer")
        first_out = next(payload[1] for kind, payload in events if kind == "layer")
        arity = len(first_out) if isinstance(first_out, tuple) else None
        after = [name for kind, name in events[last + 1:] if kind == "module"]
        # Keep the outermost calls only: a norm's own submodules are not separate steps.
        tail: list[str] = []
        for name in after:
            if name not in tail and not any(name.startswith(t + ".") for t in tail):
                tail.append(name)
        return _Probed(arity, tuple(tail))

    def _compare(self, got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> float:
        """Largest gap at real tokens; refuse the model if it is beyond the tolerance."""
        if got.shape != expected.shape:
            raise UnsupportedModelError(
                f"{self.family}: piecewise logits have shape {tuple(got.shape)}, the model's "
                f"{tuple(expected.shape)}"
            )
        real = mask.bool()
        gap = float((got[real].float() - expected[real].float()).abs().max())
        scale = max(1.0, float(expected[real].float().abs().max()))
        rtol = PROBE_RTOL.get(expected.dtype, PROBE_RTOL_LOW_PRECISION)
        if not gap <= rtol * scale:  # also refuses NaN
            raise UnsupportedModelError(
                f"{self.family}: piecewise logits differ from the model's own by {gap:.3g} "
                f"(logit scale {scale:.3g}, allowed {rtol:g} of it); its forward does more "
                "than chain its decoder layers between embeddings and head, so training it "
                "block by block would train another function"
            )
        return gap


def _layer_path(base: nn.Module, layers: nn.ModuleList) -> tuple[str, set[str]]:
    """The layer list's name in ``base``, and the names of it and every module containing it."""
    for name, module in base.named_modules():
        if module is layers:
            parts = name.split(".")
            return name, {".".join(parts[:i]) for i in range(len(parts) + 1)}
    raise UnsupportedModelError("the decoder layers are not inside the base model")
