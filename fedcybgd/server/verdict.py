"""When a run that trained nothing is a failed run: the one place the rule lives.

A FedCyBGD run is **failed** (the ServerApp stops it with :class:`RunFailed`, writes
``summary.json`` with ``"status": "failed"`` and the reason, and writes no ``final/``) when

1. **the clients fail alike**: in :data:`FAILED_ROUNDS` consecutive rounds before any block was
   installed, every node asked answered with an error reply of the ClientApp, all with one
   reason (numbers aside: "row 15" and "row 52" are one reason). A data file or run config the
   clients cannot use fails here, after the first two rounds instead of at the end;
2. **nothing was installed**: the run reached its last round and no round installed a block.

What never fails a run early, so that neither a flaky network nor a hostile node ends an honest
run cheaply: a round in which a node did not answer (a timeout), answered without an error,
answered with a runtime error that says it is away (a node unavailable, a message lost, a
ClientApp process that crashed) or failed for another reason than the others; a single round
of identical errors (it takes :data:`FAILED_ROUNDS` in a row); anything once a block has been
installed. Hostile nodes can end a run early only by being every node asked in
:data:`FAILED_ROUNDS` rounds in a row before anything was installed, when nothing could have
been trained anyway.

A round is judged on its training replies when it sent training instructions, otherwise on its
other replies (the node-key queries a round opens with: a client that cannot load its data
fails there, before any node is sampled).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

# Rounds in a row in which every reply is the same client error before the run is failed.
FAILED_ROUNDS = 2
# Error codes that mean the ClientApp itself raised (or could not be loaded): a systematic
# cause. The others (a node unavailable, a message lost, a crashed process) say a node is away.
CLIENT_FAILURE_CODES = frozenset({int(ErrorCode.UNKNOWN),
                                  int(ErrorCode.LOAD_CLIENT_APP_EXCEPTION),
                                  int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION)})
TRAIN = "train"  # Flower's message type of a training instruction and its reply
REASON_CHARS = 300  # a reason's shortened length in the failure line
MAX_REASONS = 64  # distinct client errors counted for the end-of-run line (nodes may vary them)
_READ_CHARS = 20_000  # the part of an untrusted reason that is read at all

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FLOWER_WRAP = re.compile(r"^<class '([^']+)'>:<'(.*)'>$", re.DOTALL)
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed|Failure))(?:\([\w.]*\))?: (.+)$",
    re.MULTILINE)
_WRAPPERS = ("ClientAppException", "RayTaskError")  # runtime wrappers around the real error
_CLIENT_APP_PREFIX = re.compile(r"^\s*Exception ClientAppException occurred\. Message:\s*")
_NUMBER = re.compile(r"\d+")


class RunFailed(RuntimeError):
    """The run trained nothing; the message is the one line that says why."""


@dataclass(frozen=True)
class ClientError:
    """A client's error reply, read: ``text`` to show, ``key`` to compare."""

    text: str
    key: str


def read_error(reason: str) -> ClientError:
    """The root error in a runtime error reply's ``reason``, shortened.

    Flower wraps a ClientApp's exception as ``<class 'T'>:<'message'>``; under the Simulation
    Engine the message is Ray's traceback, whose first exception line is the cause. The
    result is ``"TypeName: first line of its message"``; its key masks numbers, so one error
    reported from different rows or nodes compares equal.
    """
    text = _ANSI.sub("", reason[:_READ_CHARS]).strip()
    kind, body = "", text
    wrapped = _FLOWER_WRAP.match(text)
    if wrapped:
        kind, body = wrapped.group(1), wrapped.group(2)
    for match in _EXCEPTION_LINE.finditer(body):
        name = match.group(1).rsplit(".", 1)[-1]
        if not name.startswith(_WRAPPERS):
            kind, body = name, match.group(2)
            break
    body = _CLIENT_APP_PREFIX.sub("", body)
    first = next((line.strip() for line in body.splitlines() if line.strip()), "")
    kind = kind.rsplit(".", 1)[-1].split("(", 1)[0]
    line = f"{kind}: {first}" if kind and first else (kind or first or "(no reason given)")
    if len(line) > REASON_CHARS:
        line = line[:REASON_CHARS - 3] + "..."
    return ClientError(line, _NUMBER.sub("N", line))


def client_error(reply: Message) -> ClientError | None:
    """The reply's error if the ClientApp raised (see :data:`CLIENT_FAILURE_CODES`), else
    ``None`` (a reply with content, or a runtime error saying the node is away)."""
    if not reply.has_error():
        return None
    if int(reply.error.code) not in CLIENT_FAILURE_CODES:
        return None
    return read_error(str(reply.error.reason or ""))


@dataclass(frozen=True)
class Seen:
    """One reply, as the rule needs it: its type, the instruction it answers, its client
    error if any."""

    message_type: str
    answers: str
    error: ClientError | None

    @classmethod
    def of(cls, reply: Message) -> Seen:
        """Read ``reply`` (its content is not kept)."""
        return cls(str(reply.metadata.message_type), str(reply.metadata.reply_to_message_id),
                   client_error(reply))


@dataclass
class RoundReplies:
    """What one round asked (instruction id -> message type) and what came back."""

    asked: dict[str, str] = field(default_factory=dict)
    replies: list[Seen] = field(default_factory=list)

    def _counts(self, message_type: str) -> bool:
        return TRAIN not in self.asked.values() or message_type == TRAIN

    def judged(self) -> list[Seen]:
        """The replies the round is judged on: its training replies if it asked for training,
        else all (see the module docstring)."""
        return [r for r in self.replies if self._counts(r.message_type)]

    def complete(self) -> bool:
        """Did every judged instruction of the round get a reply? (A node that is slow or
        away leaves the round saying nothing about the clients' errors.)"""
        answered = {r.answers for r in self.judged()}
        return all(i in answered for i, kind in self.asked.items() if self._counts(kind))


class ReplyWatch(Grid):
    """A Grid that passes everything to ``grid`` and notes the replies of the current round.

    The strategy talks to the nodes through it; the server reads :meth:`take_round` after each
    round. Of each instruction only its id and type are kept, of each reply its type, the id it
    answers and its client error (:class:`Seen`), never a message's content.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.current = RoundReplies()
        # called with the training instructions about to go out, before they go
        self.on_send: Callable[[list[Message]], None] | None = None

    def _sending(self, messages: list[Message]) -> None:
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if train and self.on_send is not None:
            self.on_send(train)

    def take_round(self) -> RoundReplies:
        """The replies since the last call (the round that just ended); starts a new round."""
        done, self.current = self.current, RoundReplies()
        return done

    def set_run(self, run: Run) -> None:
        """Set the run of the wrapped grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """The wrapped grid's (deprecated in Flower)."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's node ids."""
        return self.grid.get_node_ids()

    def _sent(self, messages: list[Message]) -> None:
        # the grid set each message's id when it pushed it
        self.current.asked.update({str(m.metadata.message_id): str(m.metadata.message_type)
                                   for m in messages})

    def _received(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        self.current.replies.extend(Seen.of(r) for r in replies)
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the wrapped grid, noting what was asked."""
        messages = list(messages)
        self._sending(messages)
        ids = list(self.grid.push_messages(messages))
        self._sent(messages)
        return ids

    def pull_messages(self, message_ids: Iterable[str] | None = None, *,
                      reply_to_message_ids: Iterable[str] | None = None) -> Iterable[Message]:
        """Pull through the wrapped grid, keeping the replies. Takes Flower 1.42's name for the
        filter and 1.43's (``reply_to_message_ids``), and passes it on positionally, which
        both accept."""
        ids = message_ids if message_ids is not None else reply_to_message_ids
        if ids is None:
            raise TypeError("pull_messages needs the ids of the messages whose replies to pull")
        return self._received(self.grid.pull_messages(ids))

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Send and receive through the wrapped grid, noting what was asked and came back."""
        messages = list(messages)
        if not messages:  # e.g. a round's empty evaluation: nothing to send or wait for
            return []
        self._sending(messages)
        replies = self._received(self.grid.send_and_receive(messages, timeout=timeout))
        self._sent(messages)
        return replies


def installed_any(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Did any round of these ``metrics.jsonl`` rows install a block?"""
    return any(row.get("accepted") for row in rows)


class Verdict:
    """Applies the rule of the module docstring, round by round and at the end.

    Parameters
    ----------
    installed : bool
        Whether a block was installed before (a resumed run's earlier rounds).
    failed_rounds : int
        Rounds in a row of one same client error that fail the run (:data:`FAILED_ROUNDS`).
    """

    def __init__(self, installed: bool = False, failed_rounds: int = FAILED_ROUNDS) -> None:
        if failed_rounds < 1:
            raise ValueError(f"failed_rounds must be at least 1, got {failed_rounds}")
        self.installed = installed
        self.failed_rounds = failed_rounds
        self.streak: list[ClientError] = []  # one error per round in a row, the same key
        self.errors: Counter[str] = Counter()  # key -> replies with it, over the run
        self.texts: dict[str, str] = {}  # key -> its first text

    def after_round(self, server_round: int, round_replies: RoundReplies,
                    installed: bool) -> str | None:
        """The failure line if the run fails with this round, else ``None``."""
        errors = [seen.error for seen in round_replies.judged()]
        self.installed = self.installed or installed
        for error in errors:
            if error is not None and not self.installed and (
                    error.key in self.errors or len(self.errors) < MAX_REASONS):
                self.errors[error.key] += 1
                self.texts.setdefault(error.key, error.text)
        keys = {e.key if e is not None else None for e in errors}
        if self.installed or not errors or len(keys) != 1 or None in keys or \
                not round_replies.complete():
            self.streak = []
            return None
        error = next(e for e in errors if e is not None)
        if self.streak and self.streak[-1].key != error.key:
            self.streak = []
        self.streak.append(error)
        if len(self.streak) < self.failed_rounds:
            return None
        first = server_round - len(self.streak) + 1
        rounds = f"round {first}" if first == server_round else f"rounds {first}-{server_round}"
        return (f"every client failed in {rounds} with the same error, nothing was trained: "
                f"{error.text}")

    def at_end(self, rounds: int, dropped: Mapping[str, int]) -> str | None:
        """The failure line if nothing was installed in the whole run (``rounds`` rounds,
        ``dropped``: its drops by reason), else ``None``."""
        if self.installed:
            return None
        drops = ", ".join(f"{reason} {count}" for reason, count in sorted(dropped.items()))
        line = f"no block was installed in {rounds} round{'s' * (rounds != 1)}"
        line += f" (dropped: {drops})" if drops else " (no upload arrived)"
        if self.errors:
            key, count = self.errors.most_common(1)[0]
            line += f"; most common client error ({count}x): {self.texts[key]}"
        return line
