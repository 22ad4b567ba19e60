"""One train message's work: apply downloaded blocks, train the assigned block, upload it.

The ClientApp (:mod:`fedcybgd.client.app`) imports this module on a node's first train message.

One train message = one assignment: the block to train, the update rule, the round's seed and
the blocks to download (only those whose version the node's cache lacks). The reply carries the
encoded new block, the metrics and what the node now holds, so the server never has to guess.

Self-sync (:mod:`fedcybgd.protocol.selfsync`): asked to, the node keeps its own decoded upload as a
pending copy; when the server's next instruction says it installed that block from it, the node
computes the installed version itself, checks it against the server's checksum and holds it, so
the block is not sent back. Error feedback (``error-feedback``): with a lossy upload codec, what
the codec dropped of the node's update is kept per block and added to its next upload of it.
Seed-log downloads (:mod:`fedcybgd.protocol.seedsync`): a block may arrive as the step logs that
made its new versions, which the node replays on its exact copy and checks by checksum.
The instruction is untrusted (:mod:`fedcybgd.client.instruction`), and what it asks is bounded
by the node's own limits (:mod:`fedcybgd.client.limits`): training steps, learning rate, batch
size, download bytes and decoded sizes, step logs and steps to replay, all checked before the
work they bound; beyond one the node answers ``refused``, naming it.
Messages from Flower's own FedAvg (the baselines) go to :mod:`fedcybgd.client.baselines`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedcybgd import protocol
from fedcybgd.client import limits
from fedcybgd.client.baselines import is_fedavg_message, train_fedavg
from fedcybgd.client.feedback import encode_upload
from fedcybgd.client.instruction import Instruction, read_instruction
from fedcybgd.client.limits import Refusal
from fedcybgd.client.local_data import private_batches, training_batches
from fedcybgd.client.paths import UnsafeName, block_name, node_dirs
from fedcybgd.client.privacy import LedgerError, NodeLedger, round_entry
from fedcybgd.client.run_state import run_state
from fedcybgd.client.runtime import ClientModel, client_model
from fedcybgd.client.store import BlockStore
from fedcybgd.client.updates import TrainOutcome, TrainTask, get_rule, step_log_of
from fedcybgd.client.updates.fo_program import NodePrograms
from fedcybgd.client.updates.programs import PROGRAM_RULES, unsupported
from fedcybgd.compression import (
    CodecError,
    decode,
    parse_spec,
    payload_from_array,
    payload_to_array,
    raw_fp32_bytes,
    read_header,
    uses_base,
)
from fedcybgd.config import ConfigError, NodeConfig, RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.core.measure import PeakMemory, cgroup_memory, rss_bytes
from fedcybgd.data.prompts import Batch
from fedcybgd.memory.estimate import (
    estimate_peak_mb,
    fallback_order,
    fitting_rule_options,
    measured_runtime_mb,
    weights_mb,
)
from fedcybgd.model.block_programs import (
    BlockProgram,
    ExecuTorchError,
    require_executorch,
    tie_refusal,
)
from fedcybgd.model.devices import node_device, to_cpu
from fedcybgd.model.loading import cache_root
from fedcybgd.model.precision import Precision
from fedcybgd.protocol import Holding, dp, seedlog, seedsync, selfsync, zeroth_order
from fedcybgd.protocol.zeroth_order import SeedLog
from fedcybgd.rules import ExampleDp, rule_spec
from fedcybgd.rules.builtin import LEAN_OPTIONS, FoOptions
from fedcybgd.tasks.base import Task
from fedcybgd.tasks.shares import target_shares

log = logging.getLogger(__name__)


def _reply(
    msg: Message,
    status: str,
    store: BlockStore | None,
    reason: str = "",
    rule: str = "",
    budget: float = 0.0,
    **records: Any,
) -> Message:
    state = ConfigRecord(
        {
            protocol.STATUS: status,
            protocol.REASON: reason,
            protocol.RULE: rule,
            protocol.MEMORY_BUDGET: float(budget),
            protocol.HOLDINGS: protocol.dump_holdings(store.holdings if store else {}),
        }
    )
    return Message(RecordDict({protocol.STATE: state, **records}), reply_to=msg)


@dataclass
class Downloads:
    """An instruction's downloads, read (headers, chains, step logs) but none decoded or
    replayed: what the node's limits were checked against."""

    weights: dict[str, bytes] = field(default_factory=dict)  # block -> payload
    chains: dict[str, tuple[seedsync.LogChain, list[list[SeedLog]]]] = field(
        default_factory=dict)  # block -> its chain and that chain's decoded logs, per install
    chained: dict[str, list[bytes]] = field(default_factory=dict)  # block -> install deltas
    received: int = 0  # payload bytes


def read_downloads(weights: ArrayRecord, logs: ArrayRecord, node: NodeConfig, max_bytes: int,
                   max_steps: int, chained: ArrayRecord | None = None) -> Downloads:
    """Read the instruction's downloads and check them against the node's limits before any
    is decoded or replayed: their bytes, what each weights payload decodes to, what a chain
    of install deltas (``chained``) decodes to in all, and the step logs' number and steps
    (each log at most ``max_steps``, the instruction's local steps).

    Raises
    ------
    Refusal
        Beyond a limit of the node (named; nothing was decoded or replayed).
    CodecError
        A malformed payload, chain or step log (the node asks for a resync).
    """
    chained = ArrayRecord() if chained is None else chained
    out = Downloads(received=limits.check_download_bytes(
        {protocol.DOWNLOAD: weights, protocol.DOWNLOAD_LOGS: logs,
         protocol.DOWNLOAD_CHAIN: chained}, node))
    for block, array in weights.items():
        payload = payload_from_array(array)
        limits.check_decoded(protocol.DOWNLOAD, block,
                             read_header(payload, max_bytes=max_bytes), node)
        out.weights[block] = payload
    try:
        lengths = protocol.read_chain_keys(chained.keys())
    except ValueError as err:
        raise CodecError(str(err)) from None
    if twice := set(lengths) & (set(weights.keys()) | set(logs.keys())):
        raise CodecError(f"blocks {sorted(twice)[:4]} sent both as a chain of install deltas "
                         "and otherwise")
    decoded_total = 0
    for block, length in lengths.items():
        out.chained[block] = []
        for index in range(length):
            payload = payload_from_array(chained[protocol.chain_key(block, index)])
            header = read_header(payload, max_bytes=max_bytes)
            limits.check_decoded(protocol.DOWNLOAD_CHAIN, block, header, node)
            decoded_total += max(header.decoded_bytes, header.raw_body_length)
            limits.check_chain_decoded(decoded_total, node)
            out.chained[block].append(payload)
    chains = {}
    for block, array in logs.items():
        try:
            chains[block] = seedsync.decode_chain(payload_from_array(array), max_bytes=max_bytes)
        except ValueError as err:
            raise CodecError(f"block '{block}': {err}") from None
    limits.check_replay_logs(sum(len(i.logs) for c in chains.values() for i in c.installs),
                             node)
    counted = 0
    for block, chain in chains.items():
        decoded: list[list[SeedLog]] = []
        for install in chain.installs:
            decoded.append([])
            for encoded in install.logs:
                try:
                    step_log = seedsync.read_log(chain, encoded, max_steps=max_steps)
                except ValueError as err:
                    raise CodecError(f"block '{block}': {err}") from None
                counted += len(step_log.steps)
                limits.check_replay_steps(counted, node)  # before any replay, or more reading
                decoded[-1].append(step_log)
        out.chains[block] = (chain, decoded)
    return out


def apply_downloads(cm: ClientModel, store: BlockStore, payloads: Mapping[str, Sequence[bytes]],
                    max_bytes: int, max_decoded_bytes: int) -> None:
    """Decode and install every downloaded block (:func:`read_downloads` read them): a block's
    payloads in order, the first against what this node holds (a delta: against the pretrained
    block or this node's exact copy), each next one a delta from the version the one before
    made (a chain of install deltas); decode verifies every base's checksum against its header.

    Raises ``CodecError`` on a bad payload or a broken chain; blocks already installed stay
    (each was verified), the block being applied is left as it was.
    """
    for block, chain in payloads.items():
        tensors: dict[str, torch.Tensor] | None = None
        version = 0
        for index, payload in enumerate(chain):
            header = read_header(payload, max_bytes=max_bytes)
            base = None
            if tensors is not None and (not uses_base(header.spec)
                                        or header.base_version != version):
                raise CodecError(f"block '{block}': install delta {index} of its chain starts "
                                 f"from version {header.base_version} ({header.spec}), not "
                                 f"{version}")
            if tensors is not None:
                base = tensors
            elif uses_base(header.spec):
                base = held_base(cm, store, block, header.base_version)
            tensors = decode(payload, base=base, expect_block=block,
                             expect_shapes=cm.shapes(block), max_bytes=max_bytes,
                             max_decoded_bytes=max_decoded_bytes).tensors
            version = header.target_version
        if tensors is not None:
            holding = store.put(block, version, tensors)
            cm.set_block(block, tensors, holding)


def held_base(cm: ClientModel, store: BlockStore, block: str, version: int
              ) -> dict[str, torch.Tensor]:
    """What a delta against ``version`` of ``block`` is decoded against: the pretrained block
    (version 0, always at hand) or this node's exact copy (fp32 from its cache: the model may
    hold the block as bf16/int8); ``CodecError`` for a version this node does not hold."""
    if version == 0:
        return cm.pretrained(block)
    held = store.holdings.get(block, Holding(0, "")).version
    if held != version:
        raise CodecError(f"block '{block}': delta against version {version}, but this client "
                         f"holds version {held}")
    return cm.exact(block, store)


def apply_log_downloads(cm: ClientModel, store: BlockStore,
                        chains: Mapping[str, tuple[seedsync.LogChain, list[list[SeedLog]]]],
                        device: torch.device) -> None:
    """Rebuild every block sent as step logs (:func:`read_downloads` read them) from this
    node's exact copy and install it. Raises ``CodecError`` on a chain that does not start
    from what this node holds, or a rebuilt version whose checksum differs."""
    for block, (chain, logs) in chains.items():
        held = store.holdings.get(block)
        base = Holding(chain.base_version, chain.base_checksum) if chain.base_version else None
        if chain.block != block or held != base:
            raise CodecError(f"block '{block}': step logs for '{chain.block[:64]}' from version "
                             f"{chain.base_version}, but this node holds "
                             f"{held.version if held else 0}")
        start = cm.exact(block, store) if base is not None else cm.pretrained(block)
        try:
            tensors = seedsync.replay_chain(start, chain, logs,
                                            zeroth_order.unit_layout(cm.blocks, block),
                                            device=device)
        except ValueError as err:
            raise CodecError(str(err)) from None
        holding = store.put(block, chain.installs[-1].version, tensors)
        cm.set_block(block, tensors, holding)


class Answered(Exception):
    """A step ended the round early with this reply (a refusal, a rejection, a resync)."""

    def __init__(self, reply: Message) -> None:
        super().__init__(reply.content.config_records[protocol.STATE][protocol.STATUS])
        self.reply = reply


@dataclass
class Round:
    """One FedCyBGD assignment as the steps of :func:`train` fill it in."""

    msg: Message
    run: RunConfig
    task: Task  # the run's (fedcybgd.client.run_state)
    node: NodeConfig
    ins: Instruction
    lr: float  # the round's rate, within the node's limit
    rule_name: str
    max_bytes: int  # the run's bound on one payload, and the node's own
    device: torch.device
    precision: Precision
    cm: ClientModel
    store: BlockStore
    rule_state: Path
    cache_dir: Path = Path()
    incoming: Downloads = field(default_factory=Downloads)
    batches: Any = None
    privacy: ExampleDp | None = None  # dp = "example": this round's DP-SGD settings
    ledger: NodeLedger | None = None
    dp_round: tuple[float, float, int] | None = None  # (rate, multiplier, steps) to record
    options: dict[str, Any] = field(default_factory=dict)  # the rule's, as the budget fits them

    def __post_init__(self) -> None:
        if not self.options:
            self.options = dict(self.run.options)

    def answer(self, status: str, reason: str, store: bool = True) -> Answered:
        """End the round with ``status`` and ``reason`` (the holdings too with ``store``)."""
        return Answered(_reply(self.msg, status, self.store if store else None, reason,
                               budget=self.node.memory_budget_mb))


def train(msg: Message, context: Context) -> Message:
    """Handle one FedCyBGD assignment (see the module docstring), or a FedAvg round.

    The round's steps, each of which may end it early with its reply: read and check the
    instruction, check the downloads against the node's limits, prepare the batches, fit a
    rule to the memory budget, install the downloads, train the block, encode the upload.
    """
    if is_fedavg_message(msg):
        return train_fedavg(msg, context)
    try:
        rnd = open_round(msg, context)
        check_downloads(rnd)
        prepare_batches(rnd)
        fit_memory_budget(rnd)
        check_trainer(rnd)
        check_privacy_budget(rnd)
        install_downloads(rnd)
        outcome, trained, start, base, mem, train_s = train_block(rnd)
        return upload_reply(rnd, outcome, trained, start, base, mem.peak_mb, train_s)
    except Answered as done:
        return done.reply


def open_round(msg: Message, context: Context) -> Round:
    """Read the instruction and check it against the node's limits, its rule, the model the
    node holds and the names it would turn into paths; open the node's block store."""
    run = RunConfig.from_run_config(context.run_config)
    node = limits.enforced_budget(NodeConfig.from_node_config(context.node_config),
                                  cgroup_memory())
    try:
        ins = read_instruction(msg.content.config_records.get(protocol.CONFIG))
        lr = limits.check_training(run, node, ins.lr, ins.local_steps)
        limits.check_privacy(run, node)
    except Refusal as err:
        log.warning("refused an instruction (%s)", err)
        raise Answered(_reply(msg, protocol.REFUSED, None, str(err))) from None
    rule_name = node.update_rule or ins.rule
    # Registered once the run's plugin-modules are loaded (RunConfig above); the node's own
    # choice is checked only here, so a misspelt one names the key.
    try:
        rule_spec(rule_name)
    except ConfigError as err:
        if not node.update_rule:  # the server's: refused
            raise Answered(_reply(
                msg, protocol.REFUSED, None,
                f"instruction field {protocol.RULE!r} = {rule_name[:80]!r}: {err}")) from None
        raise ConfigError(f"update-rule = {rule_name!r} (node config): {err}") from None
    device = node_device(run.device, node.device)
    precision = Precision(run.frozen_dtype, run.frozen_quant)
    cm = client_model(run.model, run.layers_per_block, str(device), precision)
    if ins.base_hash != cm.base_hash:
        raise Answered(_reply(
            msg, protocol.REJECTED, None,
            f"pretrained weights differ: server {ins.base_hash}, client {cm.base_hash}"))
    cache_dir = Path(node.cache_dir) if node.cache_dir else cache_root()
    downloads = msg.content.array_records.get(protocol.DOWNLOAD, ArrayRecord())
    log_downloads = msg.content.array_records.get(protocol.DOWNLOAD_LOGS, ArrayRecord())
    chained = [key.rpartition("#")[0] for key in
               msg.content.array_records.get(protocol.DOWNLOAD_CHAIN, ArrayRecord())]
    try:
        # Names the server sends become paths: checked before anything is touched.
        dirs = node_dirs(cache_dir, ins.lineage, context.node_id)
        for name in (ins.block, *downloads.keys(), *log_downloads.keys(), *chained,
                     *ins.promotions):
            if block_name(name) not in cm.blocks.names:
                raise UnsafeName(f"block {name!r} is not one of this model's {cm.blocks.names}")
    except UnsafeName as err:
        log.warning("round %s: refused an instruction (%s)", ins.server_round, err)
        raise Answered(_reply(msg, protocol.REFUSED, None, f"bad instruction: {err}")) from None
    return Round(msg, run, run_state(context, run).task, node, ins, lr, rule_name,
                 int(min(run.max_payload_mb, node.max_download_mb) * limits.MB), device,
                 precision, cm, BlockStore(dirs.store, cm.base_hash), dirs.rule_state,
                 cache_dir)


def check_downloads(rnd: Round) -> None:
    """The downloads' cost against the node's limits, before any is decoded or replayed."""
    msg = rnd.msg
    try:
        rnd.incoming = read_downloads(
            msg.content.array_records.get(protocol.DOWNLOAD, ArrayRecord()),
            msg.content.array_records.get(protocol.DOWNLOAD_LOGS, ArrayRecord()),
            rnd.node, rnd.max_bytes, rnd.ins.local_steps,
            msg.content.array_records.get(protocol.DOWNLOAD_CHAIN, ArrayRecord()))
    except Refusal as err:
        log.warning("round %s: refused an instruction (%s)", rnd.ins.server_round, err)
        raise rnd.answer(protocol.REFUSED, str(err)) from None
    except CodecError as err:
        raise Answered(_resync_after_bad_download(msg, rnd.ins.server_round, rnd.cm, rnd.store,
                                                  err, rnd.node.memory_budget_mb)) from None


def prepare_batches(rnd: Round) -> None:
    """The round's batches, aimed at the instruction's class prior when it sends one. Before
    the budget check: the tokenizer and data are then resident, part of what this process
    measures as its runtime."""
    target = rnd.ins.class_prior
    try:
        if target is not None:  # one share per class of the task
            target_shares(target, rnd.task.num_classes())
    except ValueError as err:
        log.warning("round %s: refused an instruction (%s)", rnd.ins.server_round, err)
        raise Answered(_reply(rnd.msg, protocol.REFUSED, None,
                              f"bad instruction: {err}")) from None
    if rnd.run.dp == "example":
        # the sample and the noise come from the node's own randomness: amplification by
        # sampling needs the sample hidden, and a known noise seed would let it be subtracted
        rnd.batches = private_batches(rnd.run, rnd.node, secrets.randbits(63), rnd.task)
        rnd.privacy = ExampleDp(rnd.run.dp_clip_norm, rnd.run.dp_noise_multiplier,
                                float(rnd.run.batch_size), secrets.randbits(63))
        return
    rnd.batches = training_batches(rnd.run, rnd.node, rnd.ins.seed, target, rnd.task)


def check_privacy_budget(rnd: Round) -> None:
    """Node-side DP (``dp = "example"``: DP-SGD in the rule; ``"local"``: noise on the upload):
    the round must fit the run's budget and the node's own, counted by the node itself
    (:mod:`fedcybgd.client.privacy`), whatever the server accounts; else the node takes no
    part. Under ``example`` the rule must run DP-SGD."""
    run, node = rnd.run, rnd.node
    if run.dp not in ("example", "local"):
        return
    if run.dp == "example" and not rule_spec(rnd.rule_name).example_dp:
        raise rnd.answer(protocol.REJECTED, f"dp = 'example' needs a rule that runs DP-SGD; "
                         f"this node would train with {rnd.rule_name!r}, which does not",
                         store=False)
    try:
        ledger = NodeLedger.open(rnd.cache_dir / "privacy", node.key)
        entry = (round_entry(rnd.batches.rate, run.dp_noise_multiplier, run.local_steps)
                 if run.dp == "example" else round_entry(1.0, run.dp_noise_multiplier, 1))
    except (LedgerError, ValueError) as err:
        raise rnd.answer(protocol.REJECTED, str(err), store=False) from None
    try:
        why, _ = ledger.check(rnd.ins.lineage, entry, run.dp_delta, run.dp_target_epsilon,
                              node.max_dp_epsilon)
    except ImportError as err:  # the privacy extra is not installed on this node
        raise rnd.answer(protocol.REJECTED, str(err), store=False) from None
    if why is not None:
        log.warning("round %s: %s", rnd.ins.server_round, why)
        raise rnd.answer(protocol.REJECTED, why, store=False)
    rnd.ledger, rnd.dp_round = ledger, entry


def fit_memory_budget(rnd: Round) -> None:
    """With a memory budget, the asked rule or a smaller one that fits; none fits: rejected."""
    run, node, cm = rnd.run, rnd.node, rnd.cm
    if not node.memory_budget_mb:
        return
    block = rnd.ins.block
    # An sft batch scores every response token, not one per row (an upper bound here)
    scored = rnd.task.max_scored_tokens(run.batch_size, run.max_seq_len)
    runtime = measured_runtime_mb(cm.shape, cm.blocks, rnd.precision, rss_bytes() / 2**20)
    # a node training through ExecuTorch falls back only to rules its programs run
    allowed = None if node.trainer == "eager" else PROGRAM_RULES.names()
    fit = fitting_rule_options(cm.shape, cm.blocks, block, node.memory_budget_mb,
                               run.batch_size, run.max_seq_len, rnd.rule_name, rnd.precision,
                               run.options, scored, runtime, allowed)
    if fit is None:
        need = estimate_peak_mb(cm.shape, cm.blocks, "lezo", block, run.batch_size,
                                run.max_seq_len, rnd.precision,
                                {**run.options, **LEAN_OPTIONS}, scored, runtime)
        raise rnd.answer(
            protocol.REJECTED,
            f"memory-budget-mb = {node.memory_budget_mb:.0f} fits no update rule for "
            f"block {block} (the smallest, lezo, needs about {need:.0f} MB, "
            f"{runtime:.0f} MB of it this process's runtime)", store=False)
    rnd.rule_name, rnd.options = fit


def install_downloads(rnd: Round) -> None:
    """Self-synced blocks, then the downloads (weights, install-delta chains and step logs);
    the holdings must then be what the server expects, else a resync."""
    cm, store, node = rnd.cm, rnd.store, rnd.node
    cm.sync(store)
    # before the downloads: a block sent as a delta may be one against a self-synced version
    self_sync_blocks(cm, store, rnd.ins.promotions)
    try:
        apply_downloads(cm, store, {**{b: [p] for b, p in rnd.incoming.weights.items()},
                                    **rnd.incoming.chained},
                        rnd.max_bytes, int(node.max_decoded_mb * limits.MB))
        apply_log_downloads(cm, store, rnd.incoming.chains, rnd.device)
    except CodecError as err:
        raise Answered(_resync_after_bad_download(rnd.msg, rnd.ins.server_round, cm, store,
                                                  err, node.memory_budget_mb)) from None
    if store.holdings != rnd.ins.expect:
        raise rnd.answer(protocol.RESYNC, "cache differs from the server's record")


def train_block(rnd: Round) -> tuple[TrainOutcome, dict[str, torch.Tensor],
                                     dict[str, torch.Tensor], Holding, PeakMemory, float]:
    """Train the assigned block with the round's rule; the cache keeps the block as the server
    had it. Returns the outcome, the trained and starting tensors (CPU), the holding trained
    from, the memory sampler and the training time."""
    cm, store, run, ins = rnd.cm, rnd.store, rnd.run, rnd.ins
    block = ins.block
    try:
        cm.train_block(block, store)  # fp32 from exact tensors; the rest frozen
    except CodecError as err:
        store.clear()
        cm.sync(store)
        raise rnd.answer(protocol.RESYNC, f"cannot rebuild block {block}: {err}") from None
    # Rules get their batches where the model is (on the CPU the iterator itself, which
    # zerolock can skip through without tokenizing).
    batches = rnd.batches
    feed: Iterator[Batch] = (batches if rnd.device.type == "cpu"
                             else (b.to(rnd.device) for b in batches))
    start = to_cpu(cm.blocks.get(cm.model, block))
    start_holding = store.holdings.get(block, Holding(0, ""))
    torch.manual_seed(ins.seed)
    task = TrainTask(model=cm.model, stack=cm.stack, blocks=cm.blocks, block=block,
                     batches=iter(feed), steps=run.local_steps, lr=rnd.lr,
                     weight_decay=run.weight_decay, seed=ins.seed, options=dict(rnd.options),
                     state_dir=rnd.rule_state, privacy=rnd.privacy)
    began = time.perf_counter()
    rule = get_rule(rnd.rule_name) if rnd.node.trainer == "eager" else program_rule(rnd)
    try:
        with PeakMemory() as mem:
            outcome = rule.train(task)
        trained = to_cpu(cm.blocks.get(cm.model, block))  # the wire is CPU tensors
    finally:
        # The cache keeps the block as the server had it (also when training failed); the new
        # version arrives like any other.
        cm.blocks.set(cm.model, block, start)
    train_s = time.perf_counter() - began
    if rnd.ledger is not None and rnd.dp_round is not None:  # before anything leaves the node
        rnd.ledger.record(ins.lineage, rnd.dp_round)
        outcome.metrics["dp_epsilon"] = rnd.ledger.spent(run.dp_delta, ins.lineage)
    rnd.task.warn_cut(f"round {ins.server_round}, block {block}", batches.encoder.cut,
                      outcome.examples, run.max_seq_len, "see the task's truncation rule",
                      key="training")
    return outcome, trained, start, start_holding, mem, train_s


def check_trainer(rnd: Round) -> None:
    """With node config ``trainer = "executorch"``, refuse the round (before anything is
    installed) naming what the block program does not cover or what is not installed."""
    if rnd.node.trainer == "eager":
        return
    run = rnd.run
    frozen = run.frozen_quant if run.frozen_quant != "none" else run.frozen_dtype
    recompute = rnd.rule_name == "fo" and FoOptions.from_options(rnd.options).recompute
    reason = unsupported(rnd.rule_name, run.task_kind, rnd.privacy is not None, frozen,
                         rnd.device.type, recompute)
    if reason is None:  # a weight the block shares with another name (a tied embedding)
        tie = tie_refusal(rnd.cm.model, rnd.cm.blocks.info(rnd.ins.block).param_names,
                          PROGRAM_RULES.get(rnd.rule_name).kind)
        if tie is not None:
            reason = f"block {rnd.ins.block} {tie}"
    try:
        require_executorch()
    except ExecuTorchError as err:
        reason = reason or str(err)
    if reason is not None:
        raise rnd.answer(protocol.REFUSED, f"trainer = 'executorch' (node config) cannot "
                                           f"train this round: {reason}")
    if rnd.node.memory_budget_mb:
        fit_program_budget(rnd)


def fit_program_budget(rnd: Round) -> None:
    """With a budget, the programs' own figures decide: the round's rule if its program fits,
    else the next smaller rule the programs run (``fo`` -> ``lezo``, each at the round's options
    and then lean ones), as :func:`fit_memory_budget` falls back on the eager estimates. A
    block's program is exported when the node has none yet (its export, once a block, is not
    held to the budget). Nothing fits: rejected, naming what the asked rule's program needs."""
    cm, block, budget = rnd.cm, rnd.ins.block, rnd.node.memory_budget_mb
    runtime = measured_runtime_mb(cm.shape, cm.blocks, rnd.precision, rss_bytes() / 2**20)
    held = weights_mb(cm.shape, cm.blocks, block, rnd.precision)
    order = fallback_order(rnd.rule_name, PROGRAM_RULES.names())  # as the eager fallback
    needs: list[tuple[float, BlockProgram]] = []  # what each program tried needs
    for name in order:
        rule = program_rule(rnd, name)
        try:
            entry = rule.program(cm.model, cm.blocks, block)
        except ExecuTorchError as err:
            raise rnd.answer(protocol.REFUSED, f"trainer = 'executorch' (node config): {err}",
                             store=False) from None
        for options in (rnd.options, {**rnd.options, **LEAN_OPTIONS}):
            need = rule.need_mb(entry, held, runtime, options)
            if need <= budget:
                rnd.rule_name, rnd.options = name, dict(options)
                return
            needs.append((need, entry))
    need, entry = needs[0]  # the asked rule's, at the round's options
    smaller = f", nor does {', '.join(order[1:])}'s" if len(order) > 1 else ""
    raise rnd.answer(
        protocol.REJECTED,
        f"memory-budget-mb = {budget:.0f} is below what block {block}'s ExecuTorch program "
        f"needs, about {need:.0f} MB ({runtime:.0f} MB of it this process's runtime, "
        f"{entry.planned_bytes / 2**20:.0f} MB planned by the program for a "
        f"{'step' if entry.kind == 'fo' else 'forward'}){smaller}", store=False)


def program_rule(rnd: Round, name: str | None = None) -> NodePrograms:
    """The round's rule (or ``name``) through the block's ExecuTorch program (node config
    ``trainer = "executorch"``; :func:`check_trainer` has passed): ``fo`` through its training
    step, ``lezo``/``mezo`` through its forward program; the programs in the node's rule-state
    folder."""
    run = rnd.run
    return PROGRAM_RULES.get(name or rnd.rule_name)(
        rnd.rule_state / "executorch", run.model, rnd.cm.base_hash, run.batch_size,
        run.max_seq_len)


def upload_reply(rnd: Round, outcome: TrainOutcome, trained: dict[str, torch.Tensor],
                 start: dict[str, torch.Tensor], start_holding: Holding, peak_mb: float,
                 train_s: float) -> Message:
    """The upload (the step log, or the weights through the asked codec with error feedback
    and the pending copy for self-sync), the round's metrics and the node's holdings."""
    run, ins, store, block = rnd.run, rnd.ins, rnd.store, rnd.ins.block
    upload_codec = ins.upload_codec
    kind, note = protocol.WEIGHTS, ""
    payload: bytes | None = None
    if upload_codec == protocol.SEEDLOG:
        payload, note = _seedlog_payload(rnd.rule_name, outcome, ins)
        kind = protocol.SEEDLOG if payload is not None else protocol.WEIGHTS
        upload_codec = ins.seedlog_fallback
    pending = ""
    if kind == protocol.WEIGHTS:
        trained, unclipped = private_update(run, trained, start, ins.dp_clip)
        if unclipped is not None:  # adaptive clipping: the node's vote on the clip
            outcome.metrics[protocol.DP_UNCLIPPED] = float(unclipped)
        keep = ins.keep_pending  # the server asks for the pending copy
        feedback = run.error_feedback and not parse_spec(upload_codec).lossless
        up = encode_upload(trained, start, upload_codec, block=block, version=ins.server_round,
                           base_version=start_holding.version,
                           residual=store.residual(block, ins.server_round) if feedback
                           else None, feedback=feedback, want_decoded=keep)
        payload = up.payload
        if up.residual is not None:
            store.put_residual(block, ins.server_round, up.residual)
        if up.decoded is not None:
            pending = store.put_pending(block, up.decoded, start_holding)
    assert payload is not None

    metrics = MetricRecord(
        {
            protocol.NUM_EXAMPLES: outcome.examples,
            "train_loss": outcome.loss,
            "steps": outcome.steps,
            "skipped_steps": outcome.skipped_steps,
            "peak_mem_mb": peak_mb,
            "train_s": train_s,
            "bytes_up": len(payload),
            "seedlog_fallback": float(bool(note)),
            "bytes_up_raw": raw_fp32_bytes(trained),
            "bytes_down": rnd.incoming.received,
            **{k: float(v) for k, v in outcome.metrics.items()},
        }
    )
    upload = ArrayRecord({block: payload_to_array(payload)})
    reply = _reply(
        rnd.msg, protocol.OK, store, note, rnd.rule_name, rnd.node.memory_budget_mb,
        **{protocol.UPLOAD: upload, protocol.METRICS: metrics},
    )
    reply.content.config_records[protocol.STATE][protocol.UPLOAD_KIND] = kind
    reply.content.config_records[protocol.STATE][protocol.SELF_SYNC_CHECKSUM] = pending
    if run.download_codec == protocol.SEEDLOG:
        reply.content.config_records[protocol.STATE][protocol.ZO_NODE] = zo_node(rnd.device)
    return reply


def private_update(run: RunConfig, trained: dict[str, torch.Tensor],
                   start: dict[str, torch.Tensor], round_clip: float | None = None
                   ) -> tuple[dict[str, torch.Tensor], bool | None]:
    """User-level DP on the node (:mod:`fedcybgd.protocol.dp`): the block delta clipped to
    ``dp-clip-norm`` before compression and error feedback; with ``dp = "local"``, Gaussian
    noise of ``dp-noise-multiplier x dp-clip-norm`` added from the node's own randomness (a seed
    the server could know would let it subtract the noise).

    With ``dp = "central"`` and adaptive clipping the instruction's ``round_clip`` is the clip
    (the node trusts the central server with its noise already), and the second value says
    whether the delta was within it (the node's vote on the next clip); otherwise ``None``."""
    if run.dp not in ("central", "local"):  # off, or example-level (DP-SGD in training)
        return trained, None
    adaptive = run.dp == "central" and run.dp_adaptive_clip and round_clip is not None
    clip = round_clip if adaptive and round_clip is not None else run.dp_clip_norm
    clipped, norm = dp.clip_delta(trained, start, clip)
    if run.dp != "local":
        return clipped, (norm <= clip) if adaptive else None
    # a fresh key of OS entropy per upload, kept nowhere: nobody can regenerate this noise
    return dp.add_noise(clipped, run.dp_noise_multiplier * run.dp_clip_norm, dp.NoiseKey(),
                        "local"), None


def zo_node(device: torch.device) -> str:
    """``"<torch>|<z fingerprint>"`` of this node's replay on ``device``: the server sends step
    logs (seed-log downloads) only to nodes whose replay is exactly its own."""
    return zeroth_order.replay_identity(device)


def self_sync_blocks(cm: ClientModel, store: BlockStore,
                     promotions: dict[str, selfsync.Promotion]) -> list[str]:
    """Hold each block the server installed from this node's pending copy, computed here and
    checked against the server's checksum; returns the blocks now held that way.

    A block whose result cannot be computed or differs is left as it was and logged: the
    instruction's expected holdings then differ, the node asks for a resync and is sent the
    block. Pending copies not named are dropped (the server credited none of them).
    """
    done: list[str] = []
    for block, promotion in promotions.items():
        want = Holding(promotion.version, promotion.checksum)
        if store.holdings.get(block) == want:
            continue  # promoted already (the reply that said so was lost)
        entry = store.load_pending(block)
        tensors = store.pending_tensors(block)
        if entry is None or tensors is None:
            log.warning("self-sync of block %s: no pending copy here; it will be re-sent", block)
            continue
        if promotion.size != 1.0:
            if store.holdings.get(block, Holding(0, "")) != entry.start:
                log.warning("self-sync of block %s: the copy it was trained from is gone; it "
                            "will be re-sent", block)
                continue
            try:
                tensors = selfsync.sgd_step(cm.exact(block, store), tensors, promotion.size)
            except CodecError as err:
                log.warning("self-sync of block %s: %s; it will be re-sent", block, err)
                continue
        if content_checksum(tensors) != promotion.checksum:
            log.warning("self-sync of block %s: the computed block differs from the server's "
                        "installed version %d; it will be re-sent", block, promotion.version)
            continue
        holding = store.put(block, promotion.version, tensors)
        cm.set_block(block, tensors, holding)
        done.append(block)
    store.discard_pending()
    return done


def _resync_after_bad_download(msg: Message, server_round: int, cm: ClientModel,
                               store: BlockStore, err: CodecError, budget: float) -> Message:
    """Forget the cache and ask for a resync: a download was malformed or does not fit."""
    log.warning("round %s: rejected a download (%s); asking for a resync", server_round, err)
    store.clear()
    cm.sync(store)
    return _reply(msg, protocol.RESYNC, store, f"bad download: {err}", budget=budget)


def _seedlog_payload(
    rule_name: str, outcome: TrainOutcome, ins: Instruction
) -> tuple[bytes | None, str]:
    """The round's step log, or ``None`` and why the server could not replay it exactly."""
    step_log = step_log_of(rule_name, outcome)  # the rule declares whether it keeps one
    if step_log is None:
        return None, f"seedlog fallback: rule {rule_name!r} keeps no step log"
    server_z, server_torch = ins.zo_fingerprint, ins.zo_torch
    if step_log.torch != server_torch or step_log.z != server_z:
        return None, (
            f"seedlog fallback: client torch {step_log.torch} / z {step_log.z}, "
            f"server torch {server_torch} / z {server_z}"
        )
    return seedlog.encode_seedlog(step_log), ""
