"""A block's training step as an ExecuTorch program, equal to eager PyTorch's.

ExecuTorch is PyTorch's runtime for phones. A FedCyBGD node trains one block, everything else
frozen; that step exports as one program per block:

1. The model with the language-modelling loss (next-token cross-entropy over the scored
   positions, a padded position ignored) is traced by ``torch.export`` with only the block's
   parameters trainable, and its joint forward-backward graph is taken
   (``_export_forward_backward``): the program returns the loss, the block's gradients and the
   block's parameters.
2. ``to_edge`` and ``to_executorch`` lower it with every weight *outside* the program
   (``external_constants``): ``<block>.pte`` holds the graph (a few hundred KB), a ``.ptd``
   file the weights. One program per block serves every round: a round's weights are a new
   ``.ptd`` (:func:`write_weights`), written from the node's own tensors.
3. :class:`ProgramTrainer` loads a program with its weights and trains: the runtime's
   ``forward_backward`` gives the loss and the gradients; the runtime lends the block's
   parameter tensors without copying them, so ``torch.optim.AdamW`` steps them in place
   (the same optimizer, the same arithmetic as the eager node's).

A zeroth-order rule needs the loss alone, at weights it perturbs itself: the block's
*forward* program (``kind = "forward"``, ``<block>.forward.pte``) is the model's loss with the
block's tensors as inputs after the batch (:class:`WithBlockInputs`; no gradient, no backward
plan), every other weight in its ``.ptd``; :class:`ProgramLoss` runs it.

The program's inputs have the shapes it was exported with (``batch`` x ``seq``): a node exports
for its run's ``batch-size`` and ``max-seq-len`` and pads a short batch's windows.

ExecuTorch is optional (``make executorch`` builds ``.venv-executorch``, which sees this venv's
packages): importing this module does not import it; :func:`require_executorch` names what is
missing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from fedcybgd.model.blocks import BlockMap

__all__ = ["KINDS", "BlockProgram", "ExecuTorchError", "ProgramLoss", "ProgramTrainer",
           "WithBlockInputs", "WithLMLoss", "export_block", "export_programs", "lm_inputs",
           "logits_mb", "named_tensors", "program_intact", "read_manifest", "require_executorch",
           "rewrite_empty_permuted", "runtime_key", "tie_refusal", "tied_weights", "write_weights"]

PREFIX = "model."  # the wrapper's attribute: program names are "model." + the model's own
IGNORE = -100  # a target the loss skips (a padded position)
MANIFEST = "manifest.json"
# A block's programs: "fo" its training step (loss, gradients), "forward" its loss with the
# block's tensors as inputs (the zeroth-order rules'); the file of each, by block name.
KINDS: dict[str, str] = {"fo": "{block}.pte", "forward": "{block}.forward.pte"}


class ExecuTorchError(RuntimeError):
    """The ExecuTorch runtime is missing, or a program does not fit what it is asked to do."""


def require_executorch() -> None:
    """Import ExecuTorch's training runtime, or fail naming the install step."""
    try:
        import executorch.extension.training  # noqa: F401
    except ImportError as err:
        raise ExecuTorchError(
            f"ExecuTorch is not installed in this environment ({err}); `make executorch` "
            "builds .venv-executorch with it") from None


class WithLMLoss(nn.Module):
    """The model and its language-modelling loss: what a block program computes.

    ``ids``, ``mask`` ``[B, T]``; ``targets`` ``[B, T - 1]``: the next token of each position,
    ``IGNORE`` where a position is not scored. The loss is the mean over the scored positions,
    as the ``lm`` task's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1), ignore_index=IGNORE)


class WithBlockInputs(nn.Module):
    """The model's language-modelling loss with the block's tensors given as inputs: what a
    block's forward program computes. ``forward(ids, mask, targets, *block)`` reads the
    tensors named ``names`` (the model's own names, in this order) from ``block`` instead of
    the model."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = list(names)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                *block: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call

        out = functional_call(self.model, dict(zip(self.names, block, strict=True)), (),
                              {"input_ids": ids, "attention_mask": mask, "use_cache": False},
                              tie_weights=True)  # a tied head reads the given embedding
        logits = out.logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1), ignore_index=IGNORE)


def lm_inputs(windows: list[list[int]], seq: int, pad: int) -> tuple[torch.Tensor, ...]:
    """``(ids, mask, targets)`` of ``windows`` padded to ``seq`` tokens (a window longer than
    ``seq`` is an error: the program's shape is fixed)."""
    ids = torch.full((len(windows), seq), pad, dtype=torch.long)
    mask = torch.zeros((len(windows), seq), dtype=torch.long)
    targets = torch.full((len(windows), seq - 1), IGNORE, dtype=torch.long)
    for row, window in enumerate(windows):
        if not 2 <= len(window) <= seq:
            raise ExecuTorchError(f"a window of {len(window)} tokens does not fit the "
                                  f"program's {seq}")
        ids[row, :len(window)] = torch.tensor(window)
        mask[row, :len(window)] = 1
        targets[row, :len(window) - 1] = torch.tensor(window[1:])
    return ids, mask, targets


@dataclass(frozen=True)
class BlockProgram:
    """A block program's manifest entry: what it was exported from and for."""

    model: str
    block: str
    task: str
    batch: int
    seq: int
    program: str  # file name of the .pte beside the manifest
    weights: str  # file name of the .ptd written at export (the pretrained weights)
    program_sha256: str
    base_hash: str
    planned_bytes: int  # the memory the runtime plans for one step (activations, gradients)
    vocab: int  # the logits' width (the loss's scratch outside the plan is one logits' size)
    # the block's tensors, name -> shape: trained ("fo"), or inputs after the batch in this
    # order ("forward")
    trainable: dict[str, list[int]] = field(default_factory=dict)
    constants: dict[str, list[int]] = field(default_factory=dict)  # every weight the .ptd holds
    kind: str = "fo"  # one of KINDS


def rewrite_empty_permuted(graph_module: torch.fx.GraphModule) -> None:
    """``to_edge`` refuses ``aten.empty_permuted`` (the joint graph's backward makes some):
    each becomes ``empty`` of the physical shape and the inverse ``permute``."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.empty_permuted.default:
            continue
        size, order = node.args[0], list(node.args[1])
        with graph.inserting_before(node):
            empty = graph.call_function(torch.ops.aten.empty.memory_format,
                                        ([size[i] for i in order],), dict(node.kwargs))
            back = graph.call_function(torch.ops.aten.permute.default,
                                       (empty, [order.index(i) for i in range(len(order))]))
        empty.meta, back.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(back)
        graph.erase_node(node)
    graph_module.recompile()


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its program name (tied weights under each name)."""
    pairs = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    return {PREFIX + name: tensor for name, tensor in pairs}


def tied_weights(model: nn.Module, names: set[str] | frozenset[str]) -> list[tuple[str, str]]:
    """``(name, other)`` for each parameter in ``names`` that the model also holds under another
    name (a tied input embedding and output projection)."""
    by_tensor: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(n)
    return [(n, other) for shared in by_tensor.values() if len(shared) > 1
            for n in shared if n in names for other in shared if other != n]


def export_block(model: PreTrainedModel, blocks: BlockMap, block: str, out: Path, *, name: str,
                 base_hash: str, batch: int, seq: int, with_weights: bool = True,
                 kind: str = "fo") -> BlockProgram:
    """Export ``block``'s program of ``kind`` (:data:`KINDS`: its training step, or its loss
    with the block's tensors as inputs) of ``model`` to ``out`` (and, with ``with_weights``, the
    model's weights beside it; a node writes its own each round) for batches of ``batch`` x
    ``seq`` tokens; the model's ``requires_grad`` flags are restored afterwards."""
    require_executorch()
    if kind not in KINDS:
        raise ExecuTorchError(f"no block program of kind {kind!r}; kinds: {', '.join(KINDS)}")
    own = sorted(blocks.info(block).param_names)
    # A forward program takes the block's tensors as inputs and hands them to every name that
    # shares them (functional_call ties them). The training step's export would lift each name
    # as a parameter of its own, so for a tied head it runs with the head reading the embedding
    # (one parameter, its gradient the sum of both uses, as in the model).
    refused = tie_refusal(model, own, kind)
    if refused:
        raise ExecuTorchError(f"block {block} {refused}")

    lowered = _lower(model, own, batch, seq, kind)
    out.mkdir(parents=True, exist_ok=True)
    program = out / KINDS[kind].format(block=block)
    _replace(program, lowered.buffer)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        lowered.write_tensor_data_to_file(tmp)
        (written,) = Path(tmp).glob("*.ptd")
        constants = {k: list(v.sizes) for k, v in _read_layouts(written).items()}
    tensors = named_tensors(model)
    planned = sum(sum(plan.non_const_buffer_sizes)
                  for plan in lowered.executorch_program.execution_plan)
    entry = BlockProgram(
        model=name, block=block, task="lm", batch=batch, seq=seq, program=program.name,
        weights=program.with_suffix(".ptd").name,
        program_sha256=hashlib.sha256(lowered.buffer).hexdigest(),
        base_hash=base_hash, planned_bytes=int(planned),
        vocab=int(model.get_output_embeddings().weight.shape[0]),
        trainable={PREFIX + n: list(tensors[PREFIX + n].shape) for n in own},
        constants=constants, kind=kind)
    if with_weights:
        write_weights(out / entry.weights, entry, tensors)
    _add_to_manifest(out, entry)
    return entry


class TiedHead(nn.Module):
    """The output projection of a model whose head is its input embedding, as a module with no
    parameter of its own: it reads the embedding's weight, so an export lifts that tensor once."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        # read at each call (an export swaps the embedding's parameter for its own), held
        # outside the module's registry so the weight has no second name
        self._read: Callable[[], torch.Tensor] = lambda: cast(torch.Tensor, embedding.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._read())


def tie_refusal(model: PreTrainedModel, names: Iterable[str], kind: str) -> str | None:
    """Why a block of the parameters ``names`` cannot have a program of ``kind`` for a weight
    it shares with another name, or ``None``. A forward program takes the block's tensors as
    inputs and hands them to every name that shares them (:class:`WithBlockInputs`); a training
    step carries a tie only between the input embedding and a bias-free ``nn.Linear`` head
    (exported as :class:`TiedHead`: one parameter, its gradient summing both uses)."""
    tied = tied_weights(model, set(names))
    if kind != "fo" or not tied or _plain_tied_head(model):
        return None
    return (f"holds {tied[0][0]}, which the model ties to {tied[0][1]}: the training-step "
            "program carries a tie only between the input embedding and a bias-free nn.Linear "
            "head; its forward program trains it (lezo, mezo)")


def _plain_tied_head(model: PreTrainedModel) -> bool:
    """Whether the model's head is a bias-free ``nn.Linear`` on its input embedding's weight
    (what :class:`TiedHead` computes)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return (type(head) is nn.Linear and head.bias is None
            and head.weight is getattr(embedding, "weight", None))


@contextlib.contextmanager
def _head_reading_embedding(model: PreTrainedModel) -> Iterator[None]:
    """While exporting: a plainly tied head replaced by :class:`TiedHead` (any other model
    unchanged)."""
    if not _plain_tied_head(model):
        yield
        return
    head = model.get_output_embeddings()
    model.set_output_embeddings(TiedHead(model.get_input_embeddings()))
    try:
        yield
    finally:
        model.set_output_embeddings(head)


def _lower(model: PreTrainedModel, own: list[str], batch: int, seq: int, kind: str) -> Any:
    """The ExecuTorch program of ``kind`` for the block of parameters ``own``, every weight
    outside it (``external_constants``)."""
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    attention = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # SDPA's CPU backward is outside core ATen
    example = lm_inputs([[1] * seq] * batch, seq, 0)
    try:
        if kind == "fo":
            for n, p in model.named_parameters():
                p.requires_grad_(n in own)
            with _head_reading_embedding(model):
                exported = export(WithLMLoss(model), example, strict=False)
            joint = _export_forward_backward(exported)
            rewrite_empty_permuted(joint.graph_module)
            config = ExecutorchBackendConfig(external_constants=True,
                                             external_mutable_weights=True)
            return to_edge(joint).to_executorch(config)
        for p in model.parameters():
            p.requires_grad_(False)
        params = dict(model.named_parameters())
        block = tuple(params[n].detach().clone() for n in own)
        forward = export(WithBlockInputs(model, own), (*example, *block), strict=False)
        return to_edge(forward).to_executorch(ExecutorchBackendConfig(external_constants=True))
    finally:
        model.config._attn_implementation = attention
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


def _read_layouts(path: Path) -> dict[str, Any]:
    """Each tensor's layout in the ``.ptd`` at ``path``, read from the file's head alone (its
    header and table of contents, not the weights behind them)."""
    from executorch.extension.flat_tensor.serialize.serialize import (
        FlatTensorHeader,
        _deserialize_to_flat_tensor,
    )

    with path.open("rb") as f:
        head = f.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
        header = FlatTensorHeader.from_bytes(head[8:])
        if not header.is_valid():
            raise ExecuTorchError(f"{path} is not an ExecuTorch data file")
        f.seek(0)
        table = _deserialize_to_flat_tensor(
            f.read(header.flatbuffer_offset + header.flatbuffer_size))
    return {entry.key: entry.tensor_layout for entry in table.named_data}


def write_weights(path: Path, entry: BlockProgram, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write the ``.ptd`` weights of ``entry``'s program from ``tensors`` (program names, fp32;
    every name the program reads, with its shape)."""
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.exir.scalar_type import ScalarType
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    buffers, named = [], {}
    for index, (key, shape) in enumerate(sorted(entry.constants.items())):
        tensor = tensors.get(key)
        if tensor is None:
            raise ExecuTorchError(f"the weights of {entry.block}'s program lack {key!r}")
        if list(tensor.shape) != shape or tensor.dtype != torch.float32:
            raise ExecuTorchError(f"{key!r} is {tuple(tensor.shape)} {tensor.dtype}; the "
                                  f"program reads {tuple(shape)} torch.float32")
        buffers.append(_tensor_bytes(tensor))
        named[key] = DataEntry(index, 16, TensorLayout(ScalarType.FLOAT, list(shape),
                                                       list(range(len(shape)))))
    blob = FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=named))
    with path.open("wb") as out:
        blob.write_to_file(out)


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """``tensor``'s bytes as a piece of ExecuTorch's serializer's output that is written
    straight from the tensor's memory: the ``.ptd`` streams to its file with no copy of the
    weights (a copy of every weight, then of the joined file, would hold three models at once).
    The serializer takes such a piece where it takes a file's contents (``FileBackedData``)."""
    array = tensor.detach().cpu().contiguous().numpy()
    return _tensor_bytes_type()(array.data.cast("B"))


@functools.cache
def _tensor_bytes_type() -> type:
    from executorch.exir._serialize._cord import FileBackedData

    class TensorBytes(FileBackedData):
        def __init__(self, view: memoryview) -> None:  # no file: the tensor's memory
            self._view = view

        def __len__(self) -> int:
            return self._view.nbytes

        def prefix(self, size: int) -> bytes:
            return bytes(self._view[:size])

        def sha256(self) -> bytes:
            return hashlib.sha256(self._view).digest()

        def to_bytes(self) -> bytes:
            return bytes(self._view)

        def write_to_file(self, outfile: Any) -> None:
            outfile.write(self._view)

        def close(self) -> None:
            pass

    return TensorBytes


def _add_to_manifest(out: Path, entry: BlockProgram) -> None:
    path = out / MANIFEST
    try:
        programs = json.loads(path.read_text())["programs"]
    except (OSError, ValueError, KeyError):  # none yet, or torn: this entry starts it again
        programs = []
    programs = [p for p in programs
                if (p.get("block"), p.get("kind", "fo")) != (entry.block, entry.kind)]
    programs.append(asdict(entry))
    _replace(path, (json.dumps({"programs": programs}, indent=1) + "\n").encode())


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file beside it, then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def runtime_key(base_hash: str, batch: int, seq: int) -> str:
    """The folder name of a node's programs: the weights they were exported for, their shapes,
    and the torch and ExecuTorch releases (another release exports again)."""
    from importlib.metadata import version

    return f"{base_hash[:16]}-{batch}x{seq}-torch{torch.__version__}-et{version('executorch')}"


def program_intact(folder: Path, entry: BlockProgram) -> bool:
    """Whether ``entry``'s program file is there and matches its checksum."""
    path = folder / entry.program
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == \
        entry.program_sha256


def read_manifest(out: Path, kind: str = "fo") -> dict[str, BlockProgram]:
    """The programs of ``kind`` (:data:`KINDS`) of an export folder by block. An entry written
    by another release of this module (other fields) is left out: its block exports again."""
    found = {}
    for p in json.loads((out / MANIFEST).read_text())["programs"]:
        if p.get("kind", "fo") != kind:
            continue
        try:
            found[p["block"]] = BlockProgram(**p)
        except TypeError:  # another release's fields
            continue
    return found


def logits_mb(entry: BlockProgram) -> float:
    """One batch's fp32 logits (MiB): what a program's loss takes beside its memory plan.
    Measured on SmolLM2, a round's peak exceeded the plan-based figures by about this much at
    4 x 64 and 8 x 128 tokens, for the training step and the forward program alike."""
    return entry.batch * entry.seq * entry.vocab * 4 / 2**20


class ProgramTrainer:
    """Train a block through its ExecuTorch program with AdamW.

    Parameters
    ----------
    folder, entry
        The export folder and the program's manifest entry (its ``.pte`` is checked against
        ``program_sha256``).
    tensors
        The round's weights by program name (the node's frozen blocks and the block's start).
    lr, weight_decay
        AdamW's, as the eager node's.
    """

    def __init__(self, folder: Path, entry: BlockProgram, tensors: Mapping[str, torch.Tensor],
                 lr: float, weight_decay: float) -> None:
        require_executorch()
        from executorch.extension.pybindings.portable_lib import _load_for_executorch
        from executorch.extension.training.pybindings._training_module import TrainingModule

        program = folder / entry.program
        if not program_intact(folder, entry):
            raise ExecuTorchError(f"{program} is missing or does not match its manifest's "
                                  "checksum")
        self.entry = entry
        # the round's weights beside the program (not in a RAM-backed /tmp), gone after it
        self._dir = tempfile.TemporaryDirectory(prefix=".round-", dir=folder)
        try:
            weights = Path(self._dir.name) / "weights.ptd"
            write_weights(weights, entry, tensors)
            self.module = TrainingModule(_load_for_executorch(str(program),
                                                              data_path=str(weights)))
        except BaseException:
            self._dir.cleanup()
            raise
        self.optimizer: torch.optim.AdamW | None = None
        self.lr, self.weight_decay = lr, weight_decay

    def step(self, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> float:
        """One AdamW step on a batch; returns its loss (before the step). A batch whose loss
        is not finite changes nothing (as the eager ``fo`` rule skips it)."""
        (loss,) = self.module.forward_backward("forward", (ids, mask, targets))
        if not math.isfinite(float(loss)):
            return float(loss)
        params = self.module.named_parameters()
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(list(params.values()), lr=self.lr,
                                               weight_decay=self.weight_decay)
        grads = self.module.named_gradients()
        for name, tensor in params.items():
            tensor.grad = grads[name]
        self.optimizer.step()
        return float(loss)

    def block(self) -> dict[str, torch.Tensor]:
        """The block's trained tensors by the model's own names (copies)."""
        return {name.removeprefix(PREFIX): t.detach().clone()
                for name, t in self.module.named_parameters().items()}

    def close(self) -> None:
        """Remove the round's weights file."""
        self._dir.cleanup()


class ProgramLoss:
    """The loss of a batch at given block tensors, through the block's forward program.

    Parameters
    ----------
    folder, entry
        The export folder and the forward program's manifest entry (``kind = "forward"``; its
        ``.pte`` is checked against ``program_sha256``).
    tensors
        The round's weights by program name (every weight but the block's, which each call
        passes).
    """

    def __init__(self, folder: Path, entry: BlockProgram,
                 tensors: Mapping[str, torch.Tensor]) -> None:
        require_executorch()
        from executorch.extension.pybindings.portable_lib import _load_for_executorch

        if entry.kind != "forward":
            raise ExecuTorchError(f"{entry.program} is a {entry.kind!r} program, not a forward "
                                  "one")
        program = folder / entry.program
        if not program_intact(folder, entry):
            raise ExecuTorchError(f"{program} is missing or does not match its manifest's "
                                  "checksum")
        self.entry = entry
        self.names = list(entry.trainable)
        self._dir = tempfile.TemporaryDirectory(prefix=".round-", dir=folder)
        try:
            weights = Path(self._dir.name) / "weights.ptd"
            write_weights(weights, entry, tensors)
            self.module = _load_for_executorch(str(program), data_path=str(weights))
        except BaseException:
            self._dir.cleanup()
            raise

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                 block: Mapping[str, torch.Tensor]) -> float:
        """The mean loss of the batch with the block's tensors ``block`` (program names)."""
        (loss,) = self.module.forward((ids, mask, targets, *(block[n] for n in self.names)))
        return float(loss)

    def close(self) -> None:
        """Remove the round's weights file."""
        self._dir.cleanup()


def export_programs(name: str, out: Path, layers_per_block: int, batch: int, seq: int,
                    only: list[str] | None = None,
                    kinds: tuple[str, ...] = ("fo",)) -> list[BlockProgram]:
    """Export the block programs of ``kinds`` (:data:`KINDS`) of the model ``name`` (a built-in
    name or a model folder) cut into blocks of ``layers_per_block`` layers: every block, or
    those ``only`` names (an unknown name or kind is an error naming those there are)."""
    from fedcybgd.core.checksum import content_checksum
    from fedcybgd.model.loading import load_model

    require_executorch()
    wrong = [k for k in kinds if k not in KINDS]
    if wrong:
        raise ExecuTorchError(f"no block program of kind {wrong[0]!r}; kinds: "
                              f"{', '.join(KINDS)}")
    model = load_model(name)
    blocks = BlockMap(model, layers_per_block)
    chosen = only or list(blocks.names)
    unknown = [b for b in chosen if b not in blocks.names]
    if unknown:
        raise ExecuTorchError(f"no block {unknown[0]!r} in {name} at {layers_per_block} "
                              f"layer(s) a block; its blocks: {', '.join(blocks.names)}")
    base_hash = content_checksum(dict(model.named_parameters()))
    return [export_block(model, blocks, block, out, name=name, base_hash=base_hash,
                         batch=batch, seq=seq, kind=kind) for block in chosen for kind in kinds]
