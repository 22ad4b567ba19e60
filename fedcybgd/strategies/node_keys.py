"""Stable node keys: the order nodes are sampled in and their seeds, independent of node ids.

Flower gives each node an id of its own choosing (in simulation a random one per run), so
sampling over sorted node ids, or seeds derived from them, change from one run to the next
with the same ``seed``. Instead each node is known by a key that a deployment controls: its
node config's ``node-key``, else its ``partition-id`` (:attr:`fedcybgd.config.NodeConfig.key`).

The server does not see node configs, so it asks: each node it has not met yet gets one small
QUERY message (:data:`fedcybgd.protocol.QUERY_NODE_KEY`), and the ClientApp answers with its
key in a ConfigRecord (and, optionally, what its zeroth-order replay runs on,
:data:`fedcybgd.protocol.ZO_NODE`, so that seed-log downloads can reach it from its first round,
and its class counts, :data:`fedcybgd.protocol.CLASS_COUNTS`, for ``class-prior = global``).
The reply is untrusted input: it must hold exactly that record, the key a short string matching
:data:`fedcybgd.protocol.NODE_KEY_PATTERN`; anything else is logged and the node is asked again
next round. A query still unanswered at its timeout stays awaited: a late answer (a slow cold
start) keys the node in a later round. A node without a key is not sampled. Two nodes with the
same key (a misconfigured deployment) are ordered by node id, which is deterministic within a
run, and logged as a warning; their seeds differ by their rank among the duplicates.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedcybgd import protocol
from fedcybgd.protocol.prior import check_counts
from fedcybgd.strategies.replies import (
    CLIENT_ERROR,
    MALFORMED,
    Dropped,
    guarded,
    only_records,
    text,
)

log = logging.getLogger(__name__)

_KEY = re.compile(protocol.NODE_KEY_PATTERN)
POLL_S = 0.2  # how often unanswered queries are polled


def key_order(key: str) -> tuple[int, int, str]:
    """Sort order of keys: decimal numbers (partition ids) by value first, then the rest as
    text (so partition 10 comes after 9)."""
    if key.isascii() and key.isdigit():
        return (0, int(key), key)
    return (1, 0, key)


_OPTIONAL = (protocol.ZO_NODE, protocol.CLASS_COUNTS)


def read_key(reply: Message) -> tuple[str, str, list[int] | None]:
    """The node key, ``zo-node`` (``""`` if absent) and class counts (``None`` if absent) in a
    reply to the node-key query, or :class:`Dropped` saying why not."""
    if reply.has_error():
        raise Dropped(CLIENT_ERROR, str(reply.error.reason)[:500])
    content = reply.content
    only_records(content, arrays=set(), metrics=set(), configs={protocol.IDENTITY})
    record = content.config_records[protocol.IDENTITY]
    if not {protocol.NODE_KEY} <= set(record) <= {protocol.NODE_KEY, *_OPTIONAL}:
        raise Dropped(MALFORMED, f"identity fields {sorted(record)[:5]}, expected "
                                 f"['{protocol.NODE_KEY}'] (and any of {list(_OPTIONAL)})")
    key = text(record, protocol.NODE_KEY, max_len=64)
    if not _KEY.fullmatch(key):
        raise Dropped(MALFORMED, f"node key {key!r} does not match {protocol.NODE_KEY_PATTERN}")
    counts = None
    if protocol.CLASS_COUNTS in record:
        try:
            counts = check_counts(record[protocol.CLASS_COUNTS])
        except ValueError as err:
            raise Dropped(MALFORMED, f"{protocol.CLASS_COUNTS}: {err}") from None
    return key, text(record, protocol.ZO_NODE, default="", max_len=128), counts


def key_query(node: int, server_round: int) -> Message:
    """The query that asks ``node`` for its key."""
    content = RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND: server_round})})
    return Message(content, dst_node_id=node, message_type=protocol.QUERY_NODE_KEY,
                   group_id=f"node-key-{server_round}")


class NodeKeys:
    """Node id -> stable key, learnt by querying each new node once.

    Parameters
    ----------
    timeout_s : float
        How long one round's queries wait for replies (they come back as soon as all have
        answered; a node that has not by then is asked again next round, and its late answer
        to either query counts).
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.keys: dict[int, str] = {}
        self.zo: dict[int, str] = {}  # node -> the "zo-node" its key reply named
        self.class_counts: dict[int, list[int]] = {}  # node -> the class counts it stated
        self._warned: set[str] = set()
        self._pending: dict[str, int] = {}  # query message id -> node, until answered

    def learn(self, grid: Grid, nodes: Iterable[int], server_round: int,
              timeout_s: float | None = None) -> None:
        """Ask every node in ``nodes`` whose key is not known yet for it, waiting up to
        ``timeout_s`` (default: the instance's) for the answers.

        An earlier round's unanswered query is still awaited: a node slower than the timeout
        (a cold start) is keyed by its late answer, here or in a later round.
        """
        wanted = sorted({n for n in nodes if n not in self.keys})
        if not wanted:
            return
        # of a node's earlier unanswered queries only the oldest is still awaited (a slow node
        # answers it first), so a node that never answers does not grow the list each round
        oldest: dict[int, str] = {}
        for message_id, node in self._pending.items():
            oldest.setdefault(node, message_id)
        self._pending = {message_id: node for node, message_id in oldest.items()}
        queries = [key_query(node, server_round) for node in wanted]
        grid.push_messages(queries)
        self._pending.update({q.metadata.message_id: q.metadata.dst_node_id for q in queries})
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        answered: set[int] = set()
        while True:
            for reply in grid.pull_messages(list(self._pending)):
                answered.add(self._read(reply, server_round))
            if all(n in answered or n in self.keys for n in wanted):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        for node in wanted:
            if node not in answered and node not in self.keys:
                log.warning("round %d: node %d did not answer the node-key query within %.0f s; "
                            "it is not sampled until it does (a late answer counts)",
                            server_round, node, timeout_s)
        self._warn_duplicates()

    def _read(self, reply: Message, server_round: int) -> int:
        """Take the key ``reply`` tells (or log why not); returns the node it answers for
        (-1 when it answers no open query)."""
        node = self._pending.pop(reply.metadata.reply_to_message_id, None)
        if node is None:
            log.warning("round %d: ignored a node-key reply from node %d that answers no "
                        "open query", server_round, reply.metadata.src_node_id)
            return -1
        if node in self.keys:
            return node  # a late answer to an earlier query: the key is known already
        try:
            self.keys[node], zo, counts = guarded(functools.partial(read_key, reply))
            if zo:
                self.zo[node] = zo
            if counts is not None:
                self.class_counts[node] = counts
        except Dropped as drop:
            log.warning("round %d: node %d sent no usable node key (%s: %s); it is not "
                        "sampled until it does", server_round, node, drop.reason,
                        drop.detail)
        return node

    def _warn_duplicates(self) -> None:
        for key, nodes in self._groups().items():
            if len(nodes) > 1 and key not in self._warned:
                self._warned.add(key)
                log.warning("nodes %s all have node key %r: they are ordered by node id, which "
                            "differs between runs, so runs are not reproducible; give each "
                            "node its own partition-id or node-key", sorted(nodes), key)

    def _groups(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = defaultdict(list)
        for node, key in self.keys.items():
            groups[key].append(node)
        return groups

    def sort_key(self, node: int) -> tuple[Any, ...]:
        """Where ``node`` goes in key order; nodes without a key last, by id."""
        key = self.keys.get(node)
        if key is None:
            return (1, (0, 0, ""), node)
        return (0, key_order(key), node)

    def order(self, nodes: Iterable[int]) -> list[int]:
        """The nodes of ``nodes`` that have a key, in key order (duplicates by node id)."""
        return sorted((n for n in set(nodes) if n in self.keys), key=self.sort_key)

    def ident(self, node: int) -> str:
        """What ``node``'s seeds derive from: its key, with ``#rank`` appended when other
        nodes share it (``rank`` by node id, from 1 for the second)."""
        key = self.keys[node]
        same = sorted(n for n, k in self.keys.items() if k == key)
        rank = same.index(node)
        return key if rank == 0 else f"{key}#{rank}"

    def state(self) -> dict[str, str]:
        """JSON-able: node id (as text) -> key."""
        return {str(node): key for node, key in sorted(self.keys.items())}

    def counts_state(self) -> dict[str, list[int]]:
        """JSON-able: node id (as text) -> the class counts it stated."""
        return {str(node): list(c) for node, c in sorted(self.class_counts.items())}

    def load_counts_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`counts_state`'s output (invalid entries are dropped)."""
        self.class_counts = {}
        for node, counts in state.items():
            try:
                self.class_counts[int(node)] = check_counts(counts)
            except ValueError as err:
                log.warning("checkpoint: node %s's class counts are unusable (%s)", node, err)

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`'s output (a key that is no longer valid is asked again)."""
        self.keys = {}
        for node, key in state.items():
            if isinstance(key, str) and _KEY.fullmatch(key):
                self.keys[int(node)] = key
            else:
                log.warning("checkpoint: node %s has an invalid node key %.80r; asking again",
                            node, key)
