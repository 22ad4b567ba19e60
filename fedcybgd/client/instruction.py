"""A train instruction, read field by field before anything is done with it.

The server's instruction is untrusted. Every field the ClientApp uses is read here once, typed
and checked; a missing, mistyped or malformed one raises :class:`~fedcybgd.client.limits.Refusal`
naming the field, which the ClientApp answers ``refused`` (nothing done, the run goes on).
Whether the values are within the node's limits is :mod:`fedcybgd.client.limits`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fedcybgd import protocol
from fedcybgd.client.limits import Refusal
from fedcybgd.compression import CodecError, parse_spec
from fedcybgd.protocol import Holding, selfsync

T = TypeVar("T")
# The JSON fields (holdings, self-synced blocks) list blocks: a few kB for any real model.
MAX_JSON = 1 << 20


@dataclass(frozen=True)
class Instruction:
    """The fields of one train instruction (:mod:`fedcybgd.protocol` names them)."""

    server_round: int
    block: str
    rule: str  # the server's update rule (a node's own `update-rule` overrides it)
    seed: int
    lineage: str
    base_hash: str
    expect: dict[str, Holding]  # what the node should hold once the downloads are in
    upload_codec: str  # a codec spec, or "seedlog"
    local_steps: int  # the steps the server asked for: what one downloaded step log may hold
    lr: float | None  # the round's rate (the server's schedule); None: the run config's
    dp_clip: float | None  # central DP, adaptive clip: the round's clip; None: the run config's
    class_prior: list[float] | None
    keep_pending: bool  # self-sync: keep the decoded upload as a pending copy
    promotions: dict[str, selfsync.Promotion]  # self-synced blocks the server installed
    seedlog_fallback: str = ""  # upload-codec "seedlog": the weights codec when no exact replay
    zo_fingerprint: str = ""  # upload-codec "seedlog": the server's z arithmetic
    zo_torch: str = ""  # upload-codec "seedlog": the server's torch version


def _field(key: str, read: Callable[[], T]) -> T:
    """``read()``, any error it raises on a malformed value turned into a :class:`Refusal`
    naming ``key``."""
    try:
        return read()
    except (ValueError, TypeError, RecursionError, CodecError) as err:
        message = str(err) if str(err) else type(err).__name__
        raise Refusal(f"instruction field {key!r}: {message[:300]}") from None


def _text(cfg: Mapping[str, Any], key: str, max_len: int = 4096) -> str:
    value = protocol.get_str(cfg, key)
    if len(value) > max_len:
        raise ValueError(f"{len(value)} characters, more than {max_len}")
    return value


def _codec(cfg: Mapping[str, Any], key: str, seedlog_ok: bool) -> str:
    spec = _text(cfg, key, 256)
    if not (seedlog_ok and spec == protocol.SEEDLOG):
        parse_spec(spec)
    return spec


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = protocol.get_int(cfg, key)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _positive(cfg: Mapping[str, Any], key: str) -> float | None:
    """An optional finite number > 0 (a rate, a clip norm)."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{value!r:.40} is not a finite number > 0")
    return float(value)


def read_lr(cfg: Mapping[str, Any]) -> float | None:
    """The round's learning rate in ``cfg`` (the server's schedule), ``None`` where absent.

    Raises
    ------
    Refusal
        The field is not a finite number > 0.
    """
    return _field(protocol.LR, lambda: _positive(cfg, protocol.LR))


def read_instruction(cfg: Mapping[str, Any] | None) -> Instruction:
    """The instruction in ``cfg`` (its :data:`~fedcybgd.protocol.CONFIG` record).

    Raises
    ------
    Refusal
        The record is missing, or a field is missing, mistyped or malformed; the message
        names the field.
    """
    if cfg is None:
        raise Refusal(f"the instruction has no {protocol.CONFIG!r} record")
    upload_codec = _field(protocol.UPLOAD_CODEC, lambda: _codec(cfg, protocol.UPLOAD_CODEC, True))
    seedlog = upload_codec == protocol.SEEDLOG
    promote = cfg.get(protocol.PROMOTE)
    return Instruction(
        server_round=_field(protocol.ROUND, lambda: protocol.get_int(cfg, protocol.ROUND)),
        block=_field(protocol.BLOCK, lambda: _text(cfg, protocol.BLOCK, 256)),
        rule=_field(protocol.RULE, lambda: _text(cfg, protocol.RULE, 256)),
        seed=_field(protocol.SEED, lambda: protocol.get_int(cfg, protocol.SEED)),
        lineage=_field(protocol.LINEAGE, lambda: _text(cfg, protocol.LINEAGE, 256)),
        base_hash=_field(protocol.BASE_HASH, lambda: _text(cfg, protocol.BASE_HASH, 256)),
        expect=_field(protocol.EXPECT, lambda: protocol.load_holdings(
            _text(cfg, protocol.EXPECT, MAX_JSON))),
        upload_codec=upload_codec,
        local_steps=_field(protocol.LOCAL_STEPS, lambda: _positive_int(cfg, protocol.LOCAL_STEPS)),
        lr=read_lr(cfg),
        dp_clip=_field(protocol.DP_CLIP, lambda: _positive(cfg, protocol.DP_CLIP)),
        class_prior=_field(protocol.CLASS_PRIOR, lambda: protocol.class_prior(cfg)),
        keep_pending=cfg.get(protocol.SELF_SYNC) is True,
        promotions=({} if promote is None else _field(
            protocol.PROMOTE, lambda: selfsync.load_promotions(
                _text(cfg, protocol.PROMOTE, MAX_JSON)))),
        seedlog_fallback=(_field(protocol.SEEDLOG_FALLBACK,
                                 lambda: _codec(cfg, protocol.SEEDLOG_FALLBACK, False))
                          if seedlog else ""),
        zo_fingerprint=str(cfg.get(protocol.ZO_FINGERPRINT, ""))[:256],
        zo_torch=str(cfg.get(protocol.ZO_TORCH, ""))[:256],
    )
