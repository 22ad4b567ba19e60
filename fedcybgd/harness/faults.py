"""Fault injection for soak runs: hostile replies, lost, late and corrupted messages.

:data:`HOSTILE` is a catalog of replies an attacker (or a broken client) sends, each made from
an honest reply: bad metrics, wrong records, oversized headers, unrequested or crafted seed
logs, finite but huge weights, fuzzed bytes. :class:`FaultyGrid` is a loopback Grid that
applies them to its hostile nodes and loses, delays or corrupts a share of every node's
replies, counting each fault it injects. Nothing here is used by a real run.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType

from fedcybgd import protocol
from fedcybgd.compression import encode, payload_from_array, payload_to_array, read_header
from fedcybgd.compression.header import MAX_HEADER_BYTES
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.protocol import zeroth_order

Tamper = Callable[[Message, random.Random], None]


def upload_of(reply: Message) -> tuple[str, bytes]:
    """The block and payload of a reply's upload."""
    upload = reply.content.array_records[protocol.UPLOAD]
    block = next(iter(upload))
    return block, payload_from_array(upload[block])


def set_upload(reply: Message, payload: bytes, kind: str | None = None) -> None:
    """Replace the reply's upload payload (and its upload kind, if given)."""
    upload = reply.content.array_records[protocol.UPLOAD]
    block = next(iter(upload))
    upload[block] = payload_to_array(payload)
    if kind is not None:
        reply.content.config_records[protocol.STATE][protocol.UPLOAD_KIND] = kind


def _metric(key: str, value: Any) -> Tamper:
    def tamper(reply: Message, rng: random.Random) -> None:
        reply.content.metric_records[protocol.METRICS][key] = value
    return tamper


def _state(key: str, value: Any) -> Tamper:
    def tamper(reply: Message, rng: random.Random) -> None:
        reply.content.config_records[protocol.STATE][key] = value
    return tamper


def _extra_record(reply: Message, rng: random.Random) -> None:
    reply.content.array_records["extra"] = ArrayRecord()


def _second_block(reply: Message, rng: random.Random) -> None:
    block, payload = upload_of(reply)
    reply.content.array_records[protocol.UPLOAD][block + "x"] = payload_to_array(payload)


def _huge_header(reply: Message, rng: random.Random) -> None:
    head = b'{"pad":"' + b"x" * (2 * MAX_HEADER_BYTES) + b'"}'
    set_upload(reply, struct.pack("<4sHI", b"FCYB", 1, len(head)) + head)


def _not_a_payload(reply: Message, rng: random.Random) -> None:
    block, _ = upload_of(reply)
    reply.content.array_records[protocol.UPLOAD][block] = Array(np.zeros((4, 4), np.float32))


def _huge_weights(reply: Message, rng: random.Random) -> None:
    # finite fp32 values at the edge of the range, in a valid exact payload for the honest
    # upload's block and versions (its codec when that needs no base, else fp32)
    block, payload = upload_of(reply)
    header = read_header(payload, max_bytes=len(payload))
    tensors = {e.name: torch.full(e.shape, 3e38) for e in header.entries}
    spec = "fp32" if header.codec.needs_base else header.spec
    set_upload(reply, encode(tensors, spec, block=block, target_version=header.target_version,
                             base_version=header.base_version))


def _seedlog_bytes(block: str, header: dict[str, Any], steps: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<4sHI", b"FCZL", 1, len(head)) + head + steps


def _seedlog_header(block: str, **extra: Any) -> dict[str, Any]:
    return {"block": block, "units": 2, "layout": "0" * 16, "eps": 1e-3, "weight_decay": 0.0,
            "torch": torch.__version__, "z": zeroth_order.z_fingerprint(),
            "chunk": zeroth_order.Z_CHUNK, "base": "", "result": "", "steps": 0, **extra}


def _seedlog_eps_1e400(reply: Message, rng: random.Random) -> None:
    block, _ = upload_of(reply)
    head = json.dumps(_seedlog_header(block, eps=1)).replace('"eps": 1', '"eps": 1' + "0" * 400)
    data = struct.pack("<4sHI", b"FCZL", 1, len(head)) + head.encode()
    set_upload(reply, data, protocol.SEEDLOG)


def _seedlog_nested(reply: Message, rng: random.Random) -> None:
    block, _ = upload_of(reply)
    head = _seedlog_header(block)
    text = json.dumps(head).replace('"torch"', '"deep": ' + "[" * 5000 + "]" * 5000 + ', "torch"')
    set_upload(reply, struct.pack("<4sHI", b"FCZL", 1, len(text)) + text.encode(),
               protocol.SEEDLOG)


def _seedlog_overflow(reply: Message, rng: random.Random) -> None:
    block, _ = upload_of(reply)
    step = struct.pack("<Qff", 7, 3e38, 3e38) + b"\x01"
    set_upload(reply, _seedlog_bytes(block, _seedlog_header(block, steps=100), step * 100),
               protocol.SEEDLOG)


def _seedlog_endless(reply: Message, rng: random.Random) -> None:
    block, _ = upload_of(reply)
    step = struct.pack("<Qff", 7, 1.0, 1e-6) + b"\x01"
    set_upload(reply, _seedlog_bytes(block, _seedlog_header(block, steps=20_000),
                                     step * 20_000), protocol.SEEDLOG)


def _fuzz_bytes(reply: Message, rng: random.Random) -> None:
    _, payload = upload_of(reply)
    data = bytearray(payload)
    for _ in range(rng.randint(1, 16)):
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)  # always a change
    if rng.random() < 0.3:
        del data[rng.randrange(len(data)):]
    set_upload(reply, bytes(data))


_ODD_VALUES: list[Any] = [math.nan, math.inf, -1.0, 0.0, 1e30, 1e308, 2**62, True, [1.0],
                          [], "x", "", "[" * 3000, '{"layer.0": [1, "x"]}']


def _fuzz_fields(reply: Message, rng: random.Random) -> None:
    for _ in range(rng.randint(1, 3)):
        value = rng.choice(_ODD_VALUES)
        if rng.random() < 0.5:
            key = rng.choice([protocol.NUM_EXAMPLES, "train_loss", "peak_mem_mb", "train_s"])
            record: Any = reply.content.metric_records[protocol.METRICS]
        else:
            key = rng.choice([protocol.STATUS, protocol.HOLDINGS, protocol.UPLOAD_KIND,
                              protocol.MEMORY_BUDGET, protocol.RULE, protocol.REASON])
            record = reply.content.config_records[protocol.STATE]
        with contextlib.suppress(TypeError, ValueError):  # a value this record cannot hold
            record[key] = value


# Cases a server may accept: the example count is capped, and fuzzed fields may happen to be
# in range (the upload itself is honest); every other case must be dropped.
SANITIZED = frozenset({"num-examples 1e30", "fuzzed fields", "self-sync claim forged"})

HOSTILE: dict[str, Tamper] = {
    "num-examples NaN": _metric(protocol.NUM_EXAMPLES, math.nan),
    "num-examples inf": _metric(protocol.NUM_EXAMPLES, math.inf),
    "num-examples 1e30": _metric(protocol.NUM_EXAMPLES, 1e30),
    "train_loss a list": _metric("train_loss", [1.0]),
    "peak memory inf": _metric("peak_mem_mb", math.inf),
    "extra record": _extra_record,
    "second block": _second_block,
    "status not a string": _state(protocol.STATUS, 3),
    "budget NaN": _state(protocol.MEMORY_BUDGET, math.nan),
    "unknown upload kind": _state(protocol.UPLOAD_KIND, "pickle"),
    "self-sync claim not a string": _state(protocol.SELF_SYNC_CHECKSUM, 7),
    "self-sync claim 100 kB": _state(protocol.SELF_SYNC_CHECKSUM, "a" * 100_000),
    # well formed but not the upload's checksum: accepted, credited with nothing
    "self-sync claim forged": _state(protocol.SELF_SYNC_CHECKSUM, "0" * 64),
    "oversized header": _huge_header,
    "not a payload array": _not_a_payload,
    "finite huge weights": _huge_weights,
    "seed log eps 1e400": _seedlog_eps_1e400,
    "seed log nested 5000 deep": _seedlog_nested,
    "seed log g = lr = 3e38": _seedlog_overflow,
    "seed log 20,000 steps": _seedlog_endless,
    "fuzzed bytes": _fuzz_bytes,
    "fuzzed fields": _fuzz_fields,
}


class FaultyGrid(LoopbackGrid):
    """A loopback Grid whose replies suffer faults, counted in :attr:`faults`.

    Parameters
    ----------
    hostile : set[int]
        Node ids whose every upload is replaced by a :data:`HOSTILE` case (chosen at random).
    lose, delay, corrupt : float
        Chance that a reply is lost, arrives one call late (among the next round's replies),
        or has bytes of its upload flipped on the way.
    seed : int
        Seeds every choice, so a soak is reproducible.
    **kwargs
        Passed to :class:`fedcybgd.harness.loopback.LoopbackGrid`.
    """

    def __init__(self, *args: Any, hostile: set[int], lose: float, delay: float,
                 corrupt: float, seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hostile = hostile
        self.lose, self.delay, self.corrupt = lose, delay, corrupt
        self.rng = random.Random(seed)
        self.faults: Counter[str] = Counter()
        # round -> node -> (reply as delivered, its fault or "" when honest), last attempt only
        self.delivered: dict[int, dict[int, tuple[Message, str]]] = {}
        self._late: list[Message] = []
        self.before_reply: Callable[[list[Message]], None] | None = None  # a kill seam

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Deliver, let the nodes answer, then apply the faults to the answers to train
        instructions (other messages, such as the node-key query, pass unharmed)."""
        messages = list(messages)
        if not messages or not all(m.metadata.message_type == MessageType.TRAIN
                                   for m in messages):
            return super().send_and_receive(messages, timeout=timeout)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        delivered = list(self._late)
        self._late = []
        attempt: dict[int, tuple[Message, str]] = {}
        if messages:
            self.delivered[int(messages[0].metadata.group_id)] = attempt
        if delivered:
            self.faults["late reply delivered"] += len(delivered)
        for reply in replies:
            node = reply.metadata.src_node_id
            trained = (reply.has_content() and protocol.UPLOAD in reply.content.array_records
                       and bool(reply.content.array_records[protocol.UPLOAD]))
            fault = ""
            if node in self.hostile and trained:
                fault = self.rng.choice(sorted(HOSTILE))
                HOSTILE[fault](reply, self.rng)
                self.faults[f"hostile: {fault}"] += 1
            roll = self.rng.random()
            if roll < self.lose:
                self.faults["reply lost"] += 1
                continue
            if roll < self.lose + self.delay:
                self.faults["reply late"] += 1
                self._late.append(reply)
                continue
            if trained and not fault and self.rng.random() < self.corrupt:
                _fuzz_bytes(reply, self.rng)
                self.faults["payload corrupted"] += 1
                fault = "payload corrupted"
            attempt[node] = (reply, fault)
            delivered.append(reply)
        if self.before_reply is not None:
            self.before_reply(delivered)
        return delivered
